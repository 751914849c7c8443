"""Device meshes. One mesh with axes (data, fsdp, tensor, context); one device by default.

`--mesh data=2,fsdp=4` names the size of each axis (unnamed axes are 1); the mesh takes the
first that many devices of the run (all of them, on several processes). `compile --mesh`,
`generate`, `edit`, `bench` and `convert` all parse it and choose devices here.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flux2klein_cli.core.choices import MESH_AXES
from flux2klein_cli.core.errors import FieldError, UserInputError


@dataclass(frozen=True)
class MeshSpec:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """`data=2,fsdp=4` -> MeshSpec(data=2, fsdp=4)."""
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in MESH_AXES:
                raise FieldError("mesh", f"names an unknown axis {name!r}; axes are {', '.join(MESH_AXES)}")
            if name in sizes:
                raise FieldError("mesh", f"gives axis {name} twice")
            if not value.strip().isdigit() or int(value) < 1:
                raise FieldError("mesh", f"{item!r} needs a positive size, as in fsdp=4")
            sizes[name] = int(value)
        if not sizes:
            raise FieldError("mesh", "needs axis sizes, as in data=2,fsdp=4")
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.data, self.fsdp, self.tensor, self.context)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __str__(self) -> str:
        return ",".join(f"{a}={n}" for a, n in zip(MESH_AXES, self.shape, strict=True) if n > 1) or "single device"


def mesh_devices(spec: MeshSpec, devices: list[jax.Device] | None = None) -> list[jax.Device]:
    """The one rule for which devices a mesh uses, for compiling and for running alike (so an
    executable stored by `compile --mesh X` is the one `generate --mesh X` looks up): the
    first `spec.size` devices of the run in JAX's order. Across several processes every
    device takes part (a process without devices in the mesh could not run its part)."""
    devices = list(jax.devices()) if devices is None else devices
    spread = len({d.process_index for d in devices}) > 1
    if spec.size > len(devices) or (spread and spec.size != len(devices)):
        raise FieldError(
            "mesh", f"{spec} needs {spec.size} devices; this run has {len(devices)} ({devices[0].platform})"
            + (" over several processes, which must all take part" if spread else "")
        )
    return devices[: spec.size]


def make_mesh(spec: MeshSpec, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh of `spec` over the devices `mesh_devices` chooses."""
    devices = mesh_devices(spec, devices)
    try:  # lays axes out along the physical topology (ICI rings on TPU)
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(spec.shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.array(devices).reshape(spec.shape)
    return Mesh(grid, MESH_AXES)


def default_mesh() -> Mesh:
    """A one-device mesh with every named axis of size 1, so shardings written for it
    stay valid when the same axes grow on larger meshes."""
    devices = np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXES))
    return Mesh(devices, MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_divides(mesh: Mesh, *, batch: int, heads: int) -> None:
    """Heads the tensor axis does not divide are an error before any work (GSPMD would
    otherwise pad them silently). Any batch runs: what (data, fsdp) does not divide is
    replicated there (core/devices/sharding.py, `fitting_axes`)."""
    if heads % mesh.shape["tensor"]:
        raise UserInputError(f"{heads} attention heads do not divide over tensor = {mesh.shape['tensor']}")
