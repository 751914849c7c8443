"""Which devices a run uses: JAX's distributed runtime on several hosts, and the mesh.

- `--coordinator HOST:PORT --num-processes N --process-id I` starts JAX's distributed
  runtime explicitly (any platform; CPU processes talk through gloo); on a multi-host TPU
  slice JAX finds the coordinator itself, so no flag is needed there.
- `--mesh data=2,fsdp=4` sets the axis sizes over every device of the run; `--tpu v6-4`
  on a TPU host of that slice means FSDP over its chips (the runbook default); several
  processes without either flag shard FSDP over all devices; otherwise one device.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flux2klein_cli.core import settings
from flux2klein_cli.core.errors import FieldError, UserInputError

if TYPE_CHECKING:  # jax only once devices are wanted: checking the options needs none
    from jax.sharding import Mesh

    from flux2klein_cli.core.devices.mesh import MeshSpec


@dataclass(frozen=True)
class DeviceOptions:
    mesh: str | None = None
    tpu: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def check(self) -> MeshSpec | None:
        """Everything that can be checked without touching a device."""
        if self.mesh and self.tpu:
            raise FieldError("mesh", "or {field:tpu}: give one, not both")
        explicit = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in explicit) and any(v is None for v in explicit):
            raise FieldError("coordinator", "goes with {field:num_processes} and {field:process_id}: give all three "
                             "or none")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise FieldError("coordinator", f"{self.coordinator!r}: expected HOST:PORT")
            assert self.num_processes is not None and self.process_id is not None
            if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
                raise FieldError("process_id", "must be in 0 .. {field:num_processes} - 1")
        if self.tpu:
            from flux2klein_cli.core.devices.tpu import parse_preset

            parse_preset(self.tpu)
        if not self.mesh:
            return None
        from flux2klein_cli.core.devices.mesh import MeshSpec

        return MeshSpec.parse(self.mesh)


_initialized = False


def start_runtime(options: DeviceOptions) -> None:
    """Start JAX's distributed runtime when the run spans processes (once per process)."""
    global _initialized
    if _initialized:
        return
    import jax

    if options.coordinator is not None:
        jax.distributed.initialize(coordinator_address=options.coordinator, num_processes=options.num_processes,
                                   process_id=options.process_id)
        _initialized = True
    elif "," in settings.tpu_worker_hostnames():  # a multi-host TPU slice
        jax.distributed.initialize()
        _initialized = True


def run_mesh(options: DeviceOptions) -> Mesh | None:
    """The run's mesh (None: one device, no sharding)."""
    import jax

    from flux2klein_cli.core.devices.mesh import MeshSpec, make_mesh

    spec = options.check()
    start_runtime(options)
    if options.tpu:
        from flux2klein_cli.core.devices.tpu import parse_preset

        preset = parse_preset(options.tpu)
        devices = jax.devices()
        if devices[0].platform != "tpu" or len(devices) != preset.chips * preset.generation.cores_per_chip:
            raise UserInputError(
                f"{{field:tpu}} {preset.name} runs on that TPU slice; this run has {len(devices)} "
                f"{devices[0].platform} device(s). To compile for it from here: flux2klein compile {{field:tpu}} "
                f"{options.tpu}"
            )
        spec = MeshSpec(fsdp=len(devices))
    if spec is None and jax.process_count() > 1:
        spec = MeshSpec(fsdp=jax.device_count())
    return None if spec is None else make_mesh(spec)


@contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Native libraries (gloo's connection log) print to file descriptor 1; a script reading
    our stdout must see only paths or JSON, so the run's fd 1 points at stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def is_writer() -> bool:
    """Only process 0 writes images and JSON."""
    import jax

    return jax.process_index() == 0
