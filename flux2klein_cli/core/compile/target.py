"""What a program is and where it is compiled for: `Target` (the devices of a mesh, a libtpu
topology, XLA's effort) and `ProgramSpec` (a jitted function and its abstract arguments)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh

from flux2klein_cli.core import choices

if TYPE_CHECKING:
    from flux2klein_cli.core.devices.tpu import TpuPreset

# How hard XLA works on an executable's speed. "fast" trades run time for compile time
# (figures in docs/benchmarks.md); XLA reads -1.0 as its least effort. At "fast" for TPU targets
# the VAE's programs are also traced with their 3x3 convolutions as matmuls (specs.trace_options).
# The value is part of the store key.
_EFFORT_OPTIONS: dict[str, dict[str, Any]] = {"fast": {"exec_time_optimization_effort": -1.0}}
EFFORTS: dict[str, dict[str, Any]] = {name: _EFFORT_OPTIONS.get(name, {}) for name in choices.EFFORTS}
# More per platform. libtpu's multi-output fusion pass runs alone on one core, superlinear in the
# program's size, and dominates the HLO passes of large programs; skipping it costs little run time
# by XLA's cost model (docs/benchmarks.md).
PLATFORM_EFFORTS: dict[tuple[str, str], dict[str, Any]] = {
    ("tpu", "fast"): {"xla_disable_hlo_passes": "tpu_multi_output_fusion"},
}


@dataclass(frozen=True)
class Target:
    """Where a program runs: the devices of its mesh. `topology` names a libtpu topology
    description (e.g. "v6e:2x2") whose devices can compile but not run on this host;
    `effort` names XLA's optimisation effort (EFFORTS)."""

    mesh: Mesh
    topology: str | None = None
    effort: str = "default"

    @classmethod
    def local(cls) -> Target:
        from flux2klein_cli.core.devices.mesh import default_mesh

        return cls(default_mesh())

    @classmethod
    def for_preset(cls, preset: TpuPreset) -> Target:
        """A `--tpu` preset's target: the real devices when this host has that slice, else
        libtpu's compile-only devices for its topology (devices/tpu.py)."""
        from flux2klein_cli.core.devices.tpu import preset_mesh

        mesh, topology = preset_mesh(preset)
        return cls(mesh, topology=topology)

    @property
    def devices(self) -> list[Any]:
        return list(self.mesh.devices.flat)

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    @property
    def compile_only(self) -> bool:
        return self.topology is not None

    @property
    def compiler_options(self) -> dict[str, Any]:
        """XLA's options for this target's programs: its effort's, and on CPU which work goes to
        YNNPACK (devices/cpu.py). Part of the store key."""
        from flux2klein_cli.core.devices import cpu

        host = cpu.xla_options() if self.platform == "cpu" else {}
        return {**EFFORTS[self.effort], **PLATFORM_EFFORTS.get((self.platform, self.effort), {}), **host}

    def describe(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "device_count": len(self.devices),
            "mesh": mesh_desc(self.mesh),
            "topology": self.topology,
            "effort": self.effort,
        }


@dataclass(frozen=True)
class ProgramSpec:
    """One program: a jitted function, its abstract arguments, and what else identifies it.

    `key_parts` holds JSON-able facts the arguments do not show (model configs, dtypes of
    constants, options); shapes not in the arguments (an output's) go under `key_parts["shapes"]`:
    another shape is another program, never a stale entry. `model` names the component whose
    parameters the program reads, for memory accounting."""

    name: str
    fn: Any  # a jax.jit-wrapped function: .lower(*args)
    args: tuple[Any, ...]
    key_parts: dict[str, Any] = field(default_factory=dict)
    target: Target | None = None
    model: str | None = None

    def lower(self) -> jax.stages.Lowered:
        target = self.target or Target.local()
        # The pipeline calls its programs under `jax.set_mesh` when it has a mesh: the model's
        # sharding constraints and shard_maps (core/devices/sharding.py) must see the same mesh here.
        mesh = jax.set_mesh(target.mesh) if target.mesh.size > 1 else contextlib.nullcontext()
        # The function carries its trace options (core/compile/specs.trace_options): a TPU
        # program lowered on a CPU host is traced in the TPU forms, nothing global is patched.
        with mesh:
            return self.fn.lower(*self.args)

    @property
    def in_tree(self) -> Any:
        # Compiled.args_info is (args, kwargs); ShapeDtypeStructs are leaves like the real arrays.
        return jax.tree_util.tree_structure((tuple(self.args), {}))


def mesh_desc(mesh: Mesh) -> dict[str, Any]:
    """A mesh as JSON-able data (axis sizes, device ids), as targets and keys record it."""
    return {"axes": {str(k): int(v) for k, v in mesh.shape.items()},
            "devices": [int(d.id) for d in mesh.devices.flat]}
