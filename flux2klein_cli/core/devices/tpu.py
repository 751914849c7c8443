"""TPU targets by the names Cloud TPU and runbooks use, compiled for from any host.

`--tpu v6e-4` (or `v6-4`, `v6e:2x2`) names a generation and a slice size. On a host without
that TPU, libtpu's topology description (`jax.experimental.topologies`, the `tpu` extra)
gives compile-only devices: programs lower and compile for the slice exactly as on it, and
`memory_analysis()` tells what each device needs, to hold against the chip's HBM. On a host
that has the slice, the same preset just builds the mesh over its real devices.

Naming, as Cloud TPU writes accelerator types: v5e and v6e count chips (v5litepod-8,
v6e-4); v4, v5p and v7 count TensorCores, two per chip (v4-8 and v5p-8 are 4 chips, v7-2 is
one chip, v7-8 four).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError

GIB = 1024**3


@dataclass(frozen=True)
class Generation:
    name: str  # canonical prefix of preset names
    libtpu: str  # the name libtpu's topology strings use
    prefixes: tuple[str, ...]  # every accepted spelling before "-N"
    hbm_gib: float  # per chip
    cores_per_chip: int
    names_count: str  # "chips" or "cores": what N in NAME-N counts
    host_chips: int  # chips one host holds in a single-host slice
    slices: dict[int, str]  # chips -> topology


# HBM per chip and TensorCores per chip, from Cloud TPU's system architecture pages:
#   v4   32 GiB, 2 TensorCores   https://cloud.google.com/tpu/docs/v4
#   v5e  16 GB,  1 TensorCore    https://docs.cloud.google.com/tpu/docs/v5e  (read as GiB, like the others)
#   v5p  95 GiB, 2 TensorCores   https://docs.cloud.google.com/tpu/docs/v5p-training
#   v6e  32 GB,  1 TensorCore    https://docs.cloud.google.com/tpu/docs/v6e.md.txt (32 GiB in the TPU7x table)
#   v7   192 GiB, 2 TensorCores  https://docs.cloud.google.com/tpu/docs/tpu7x (TPU7x, Ironwood)
_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}
GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v4", "v4", ("v4",), 32, 2, "cores", 4, _3D),
        Generation("v5e", "v5e", ("v5litepod", "v5e", "v5lite"), 16, 1, "chips", 8, _2D),
        Generation("v5p", "v5p", ("v5p",), 95, 2, "cores", 4, _3D),
        Generation("v6e", "v6e", ("v6e", "v6"), 32, 1, "chips", 8, _2D),
        Generation("v7", "tpu7x", ("v7", "v7x", "tpu7x"), 192, 2, "cores", 4, {1: "1x1x1", **_3D}),
    )
}


@dataclass(frozen=True)
class TpuPreset:
    generation: Generation
    chips: int

    @property
    def name(self) -> str:
        """The canonical name: v5litepod-N for v5e (Cloud's accelerator type), else GEN-N."""
        n = self.chips * (self.generation.cores_per_chip if self.generation.names_count == "cores" else 1)
        prefix = "v5litepod" if self.generation.name == "v5e" else self.generation.name
        return f"{prefix}-{n}"

    @property
    def topology(self) -> str:
        return self.generation.slices[self.chips]

    @property
    def topology_name(self) -> str:
        """What libtpu's topology description takes, e.g. "v6e:2x2"."""
        return f"{self.generation.libtpu}:{self.topology}"

    @property
    def hbm_bytes_per_chip(self) -> int:
        return int(self.generation.hbm_gib * GIB)

    @property
    def single_host(self) -> bool:
        return self.chips <= self.generation.host_chips

    def chips_per_host_bounds(self) -> list[int] | None:
        """A single-host slice smaller or larger than libtpu's default host (2x2x1) needs its
        own bounds, or libtpu splits it over hosts (v6e-8 is one host of 8 chips)."""
        if not self.single_host or self.topology in ("2x2", "2x2x1"):
            return None
        dims = [int(d) for d in self.topology.split("x")]
        return dims + [1] * (3 - len(dims))

    def describe(self) -> dict[str, Any]:
        return {"preset": self.name, "generation": self.generation.name, "chips": self.chips,
                "topology": self.topology, "hbm_gib_per_chip": self.generation.hbm_gib,
                "cores_per_chip": self.generation.cores_per_chip}


def preset_names() -> list[str]:
    return [TpuPreset(g, chips).name for g in GENERATIONS.values() for chips in g.slices]


def parse_preset(text: str) -> TpuPreset:
    """`v6e-4`, `v6-4`, `v5litepod-8`, `v5e-4`, `v5p-8`, `v4-8`, `v7-2`, `tpu7x-8`, or a
    topology `v6e:2x2`; anything else is a UserInputError listing the valid names."""
    raw = text.strip().lower()
    preset = _parse(raw)
    if preset is None:
        raise UserInputError(f"unknown TPU preset {text!r}: use one of {', '.join(preset_names())} "
                             "(or GEN:TOPOLOGY, e.g. v6e:2x2)")
    return preset


def _parse(raw: str) -> TpuPreset | None:
    topo = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+){1,2})", raw)
    if topo:
        gen = _generation(topo.group(1))
        chips = math.prod(int(d) for d in topo.group(2).split("x"))
        if gen is None or gen.slices.get(chips) != topo.group(2):
            return None
        return TpuPreset(gen, chips)
    named = re.fullmatch(r"([a-z0-9]+)-(\d+)", raw)
    if not named:
        return None
    gen = _generation(named.group(1))
    if gen is None:
        return None
    n = int(named.group(2))
    per = gen.cores_per_chip if gen.names_count == "cores" else 1
    if n % per or n // per not in gen.slices:
        return None
    return TpuPreset(gen, n // per)


def _generation(prefix: str) -> Generation | None:
    return next((g for g in GENERATIONS.values() if prefix in g.prefixes or prefix == g.libtpu), None)


# ----------------------------------------------------------------------------- devices


def tpu_chips_present() -> bool:
    """Google TPU PCI devices on this host (vendor 0x1ae0), as jax itself checks; no jax import."""
    for vendor in Path("/sys/bus/pci/devices").glob("*/vendor"):
        try:
            if vendor.read_text().strip() == "0x1ae0":
                return True
        except OSError:
            continue
    return False


def skips_tpu_backend(platform: str, chosen_platforms: str | None) -> bool:
    """Whether jax's TPU backend is better not started: jax starts it wherever libtpu is installed
    when nothing chose the platforms (JAX_PLATFORMS unset), loading the library on every command
    only to find no chips and fall back (docs/benchmarks.md). jax itself skips CUDA without an
    NVIDIA GPU; this is that rule for TPU. A TPU topology for
    `--tpu` (compile, bench) loads libtpu on its own (_topology_devices), as before."""
    return platform == "tpu" and not chosen_platforms and not tpu_chips_present()


def libtpu_defaults(accelerator: str | None = None) -> dict[str, str]:
    """The environment libtpu should load with on a host without TPU chips (none on a TPU host).
    libtpu (when installed) still loads with jax there and prints multi-line errors about the
    missing TPU metadata, and takes a machine-wide lock that makes a second process's topology
    compile fail. Neither helps: say which slice we compile for and allow several processes. The
    console entry (cli/main.py) sets these where unset, before jax loads."""
    if tpu_chips_present():
        return {}
    return {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": accelerator or "v6e-4",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def mesh_for_devices(devices: list[Any]) -> Any:
    """All devices on the fsdp axis of the four named axes: parameters and the batch are
    split over chips, as maxdiffusion's FSDP runs of the 9B model on v6e-4 do."""
    from flux2klein_cli.core.devices.mesh import MeshSpec, make_mesh

    # As a run with `--tpu` lays them out (distributed.run_mesh), so its executables are found.
    return make_mesh(MeshSpec(fsdp=len(devices)), devices)


def preset_mesh(preset: TpuPreset) -> tuple[Any, str | None]:
    """The mesh a preset compiles for, and the libtpu topology it names when its devices are
    compile-only: the real devices when this host has that slice (topology None), else
    libtpu's devices for its topology."""
    import jax

    local = jax.devices()
    if local[0].platform == "tpu":  # a TPU host: run on its devices when they are this slice
        wanted = _topology_devices(preset)
        if local[0].device_kind == wanted[0].device_kind and len(local) == len(wanted):
            return mesh_for_devices(local), None
    return mesh_for_devices(_topology_devices(preset)), preset.topology_name


def check_topology_compiler(preset: TpuPreset) -> None:
    """A preset needs libtpu: jax's TPU backend on a TPU host, the topology description and the
    compiler elsewhere. Checked before anything is read or printed, so its absence is one line."""
    try:
        import libtpu  # noqa: F401  (the compiler lives in the libtpu package)
    except ImportError:
        raise FieldError("tpu", f"{preset.name} on a host without that TPU needs libtpu: "
                             "pip install 'flux2klein-cli[tpu]'") from None


def _topology_devices(preset: TpuPreset) -> list[Any]:
    try:
        from jax.experimental import topologies
    except ImportError as e:  # very old jax
        raise Flux2KleinError(f"this jax has no topology descriptions ({e})") from None
    check_topology_compiler(preset)
    kwargs: dict[str, Any] = {}
    bounds = preset.chips_per_host_bounds()
    if bounds:
        kwargs["chips_per_host_bounds"] = bounds
    try:
        return list(topologies.get_topology_desc(preset.topology_name, "tpu", **kwargs).devices)
    except Exception as e:  # libtpu reports its own error types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Flux2KleinError(f"libtpu cannot describe topology {preset.topology_name}: {first}") from None


# ----------------------------------------------------------------------------- memory


def verdict(peak_bytes: int, preset: TpuPreset, devices_per_chip: int) -> dict[str, Any]:
    """Per-device need against per-device HBM: fits or not, by how much."""
    hbm = preset.hbm_bytes_per_chip // max(devices_per_chip, 1)
    margin = hbm - peak_bytes
    fits = margin >= 0
    text = (f"fits {preset.name}: {_gib(peak_bytes)} of {_gib(hbm)} HBM per device, {_gib(margin)} free"
            if fits else
            f"does not fit {preset.name}: needs {_gib(peak_bytes)} per device, {_gib(-margin)} more than "
            f"its {_gib(hbm)} HBM")
    return {"fits": fits, "needed_bytes": peak_bytes, "hbm_bytes_per_device": hbm, "margin_bytes": margin,
            "text": text}


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
