"""Device meshes. One mesh with axes (data, fsdp, tensor, context); one device by default."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "context")


def default_mesh() -> Mesh:
    """A one-device mesh with every named axis of size 1, so shardings written for it
    stay valid when the same axes grow on larger meshes."""
    devices = np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXES))
    return Mesh(devices, MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
