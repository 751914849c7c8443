"""Many devices: meshes on 8 virtual CPU devices and a real two-process run, in subprocesses
(the device count is fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.choices import MESH_AXES
from flux2klein_cli.core.devices import sharding
from flux2klein_cli.core.devices.mesh import MeshSpec
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.pipeline.pipeline import UNFIT

# Which requests run on which mesh (tests/mesh_worker.py's MESH@NAME,...): every mesh runs two or
# three, every request runs on every axis, and data x context x tensor runs them all. Every request
# on every mesh (here and in ANY_BATCH_MESHES) cost four minutes of the suite for no axis or request more.
EVERY_MESH_REQUESTS = {
    "fsdp=8": ("text-to-image", "kv-edit"),
    "data=2,fsdp=4": ("edit-2-refs", "kv-edit"),
    "tensor=2,fsdp=4": ("text-to-image", "edit-2-refs"),
    "context=2,fsdp=4": ("edit-2-refs", "kv-edit"),
    "data=2,context=2,tensor=2": ("text-to-image", "edit-2-refs", "kv-edit"),
}


def restricted(chosen: dict[str, tuple[str, ...]]) -> list[str]:
    """The worker's arguments: each mesh with the requests it runs."""
    return [f"{mesh}@{','.join(names)}" for mesh, names in chosen.items()]
ROOT = Path(__file__).resolve().parents[1]


def env_with_devices(n: int) -> dict[str, str]:
    """n virtual CPU devices. LLVM's optimisation level 0 compiles these tiny programs about a
    quarter faster; every comparison here is between runs in the same settings."""
    flags = f"--xla_force_host_platform_device_count={n} --xla_backend_optimization_level=0"
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", FLUX2KLEIN_XLA_CACHE="off")


@pytest.mark.slow
def test_every_mesh_gives_the_single_device_images(tiny_checkpoint: Path, tiny_kv_checkpoint: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.mesh_worker", str(tiny_checkpoint), str(tiny_kv_checkpoint),
                           *restricted(EVERY_MESH_REQUESTS)], env=env_with_devices(8), cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["mesh"], r["request"]) for r in rows) == sorted(
        (m, r) for m, names in EVERY_MESH_REQUESTS.items() for r in names)
    for row in rows:
        assert row["max_diff"] <= 1, row
        assert row["std"] > 10, row  # real images, not blanks
        spec = MeshSpec.parse(row["mesh"])
        # Column-parallel q: input features over fsdp, heads over tensor; row-parallel out: the reverse.
        assert row["q_spec"] == ["None", "fsdp", "tensor"] and row["out_spec"] == ["None", "tensor", "fsdp"]
        assert row["q_shards"] == spec.fsdp * spec.tensor, row


@pytest.mark.slow
def test_guidance_on_a_mesh_gives_the_single_device_images(tiny_base_checkpoint: Path) -> None:
    """Classifier-free guidance (undistilled models): the negative prompt broadcast and the 2B batch
    inside the denoise program, sharded over data x fsdp and tensor."""
    meshes = ["data=2,fsdp=2,tensor=2", "fsdp=4,context=2"]
    done = subprocess.run([sys.executable, "-m", "tests.mesh_worker", "--cfg", str(tiny_base_checkpoint), *meshes],
                          env=env_with_devices(8), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["mesh"] for r in rows) == sorted(meshes)
    for row in rows:
        assert row["request"] == "cfg" and row["max_diff"] <= 1 and row["std"] > 10, row


@pytest.mark.slow
def test_guidance_on_a_mesh_matches_diffusers(tiny_base_checkpoint: Path) -> None:
    """A base model's guided image on fsdp=2 (the CFG pair fills it) and data=2 x fsdp=2 (the pair
    split over one axis, copied over the other) against diffusers' Flux2KleinPipeline on the same
    weights and noise, within the single-device parity bounds."""
    from tests.test_pipeline_parity import MAX_DIFF, MIN_SSIM

    meshes = ["fsdp=2", "data=2,fsdp=2"]
    done = subprocess.run([sys.executable, "-m", "tests.mesh_worker", "--cfg-diffusers", str(tiny_base_checkpoint),
                           *meshes], env=env_with_devices(4), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["mesh"] for r in rows] == meshes
    for row in rows:
        assert row["ssim"] >= MIN_SSIM and row["max_diff"] <= MAX_DIFF and row["std"] > 10, row


ANY_BATCH_REQUESTS = {"text-to-image-1": 1, "text-to-image-3": 3, "cfg-1": 1, "edit-2-refs-1": 1, "kv-edit-1": 1}
# fsdp=8 runs them all; the meshes with a second axis each run a batch that one axis divides and
# one that neither does.
ANY_BATCH_MESHES = {
    "fsdp=8": tuple(ANY_BATCH_REQUESTS),
    "data=2,fsdp=4": ("text-to-image-3", "cfg-1", "kv-edit-1"),
    "tensor=2,fsdp=4": ("text-to-image-1", "cfg-1", "edit-2-refs-1"),
}


@pytest.mark.slow
def test_batches_that_do_not_fill_the_mesh_give_the_single_device_images(
        tiny_checkpoint: Path, tiny_base_checkpoint: Path, tiny_kv_checkpoint: Path) -> None:
    """Batch 1 and 3 on 8 devices, and one guided image (its pair is a batch of 2 inside the
    program): the batch is split over what of data x fsdp divides it, copied over the rest,
    and the weights stay split as the rules say."""
    done = subprocess.run([sys.executable, "-m", "tests.mesh_worker", "--any-batch", str(tiny_checkpoint),
                           str(tiny_base_checkpoint), str(tiny_kv_checkpoint), *restricted(ANY_BATCH_MESHES)],
                          env=env_with_devices(8), cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["mesh"], r["request"]) for r in rows) == sorted(
        (m, r) for m, names in ANY_BATCH_MESHES.items() for r in names)
    for row in rows:
        assert row["images"] == ANY_BATCH_REQUESTS[row["request"]], row
        assert row["max_diff"] <= 1 and row["std"] > 10, row
        assert row["q_spec"] == ["None", "fsdp", "tensor"], row  # the weights stay split


@pytest.mark.slow
def test_tokens_split_over_idle_axes_give_the_single_device_images(
        tiny_checkpoint: Path, tiny_base_checkpoint: Path, tiny_kv_checkpoint: Path) -> None:
    """The sequence form: at 64 px (16 image tokens) batch 1 and 3 on fsdp=8 leave fsdp idle, so
    the image tokens are split over it (queries split, keys and values gathered, as `context`)."""
    done = subprocess.run([sys.executable, "-m", "tests.mesh_worker", "--any-batch-64", str(tiny_checkpoint),
                           str(tiny_base_checkpoint), str(tiny_kv_checkpoint), "fsdp=8"],
                          env=env_with_devices(8), cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["request"] for r in rows) == sorted(ANY_BATCH_REQUESTS)
    for row in rows:
        assert row["token_axes"] == ["('context', 'fsdp')"], row
        assert row["max_diff"] <= 1 and row["std"] > 10, row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_args(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "flux2klein_cli", "generate", "a red fox", "--model", str(model), "-o", str(out),
            "-n", "2", "--height", "32", "--width", "32", "--steps", "2", "--dtype", "fp32",
            "--max-sequence-length", "16", "--json"]


@pytest.mark.slow
def test_two_processes_make_the_one_process_images(tiny_checkpoint: Path, tmp_path: Path) -> None:
    one = subprocess.run(generate_args(tiny_checkpoint, tmp_path / "one.png"), env=env_with_devices(1),
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    port = free_port()
    procs = [subprocess.Popen(generate_args(tiny_checkpoint, tmp_path / "two.png") + [
        "--mesh", "fsdp=2,tensor=2,context=2", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
        "--process-id", str(i)], env=env_with_devices(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    report = json.loads(outs[0][0])  # process 0: exactly one JSON object on stdout
    assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "context": 2}
    assert outs[1][0] == ""  # process 1 writes nothing
    for _, stderr in outs:  # each process runs the executables it loaded or compiled, not a jitted fallback
        assert UNFIT not in stderr, stderr[-2000:]
    for i in range(2):
        a, b = (np.asarray(Image.open(tmp_path / f"{name}-{i}.png"), np.int16) for name in ("one", "two"))
        assert np.abs(a - b).max() <= 1


BAD = {
    "more devices than the run has": (1, ["--mesh", "fsdp=3"], "needs 3 devices"),
    "unknown axis": (1, ["--mesh", "pipeline=2"], "unknown axis"),
    "heads do not divide": (4, ["--mesh", "tensor=4"], "heads"),
    "tpu preset on a cpu host": (1, ["--tpu", "v6-4"], "flux2klein compile --tpu"),
    "coordinator alone": (1, ["--coordinator", "127.0.0.1:1234"], "--coordinator goes with --num-processes"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD))
def test_device_errors_are_exit_2_before_any_work(case: str, tiny_checkpoint: Path, tmp_path: Path) -> None:
    devices, extra, expected = BAD[case]
    args = [sys.executable, "-m", "flux2klein_cli", "generate", "x", "--model", str(tiny_checkpoint), "-o",
            str(tmp_path / "out.png"), "--height", "32", "--width", "32", *extra]
    done = subprocess.run(args, env=env_with_devices(devices), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_mesh_spec_parsing() -> None:
    assert MeshSpec.parse("data=2, fsdp=4").shape == (2, 4, 1, 1)
    assert str(MeshSpec.parse("tensor=2,context=2")) == "tensor=2,context=2"
    for bad in ("", "fsdp", "fsdp=0", "fsdp=2,fsdp=2", "fsdp=x"):
        with pytest.raises(UserInputError):
            MeshSpec.parse(bad)


def test_idle_batch_axes_split_the_tokens_in_the_sequence_form() -> None:
    """What a batch leaves idle of data=2 x fsdp=4, and the token axes of each form (no devices needed)."""
    mesh = jax.sharding.AbstractMesh((2, 4, 1, 1), MESH_AXES)
    with jax.sharding.use_abstract_mesh(mesh):
        assert {b: sharding.idle_batch_axes(mesh, b) for b in (1, 2, 3, 4, 8)} == {
            1: ("data", "fsdp"), 2: ("fsdp",), 3: ("data", "fsdp"), 4: ("data",), 8: ()}
        assert sharding.token_axes(2, "sequence") == ("context", "fsdp")
        assert sharding.token_axes(8, "sequence") == "context"  # the batch fills the mesh
        assert sharding.token_axes(1, "replicate") == "context"
        with pytest.raises(ValueError, match="idle"):
            sharding.token_axes(1, "shard")
    assert sharding.token_axes(1, "sequence") == "context"  # no mesh


@pytest.mark.slow
def test_bench_on_a_mesh_reports_memory_per_device(tiny_checkpoint: Path) -> None:
    args = [sys.executable, "-m", "flux2klein_cli", "bench", "--model", str(tiny_checkpoint), "--mesh", "fsdp=4",
            "--bs", "8", "--height", "32", "--width", "32", "--steps", "1", "--reps", "1", "--dtype", "fp32", "--json"]
    done = subprocess.run(args, env=env_with_devices(4), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    devices = json.loads(done.stdout)["devices"]
    assert devices["count"] == 4 and devices["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1, "context": 1}
    per_device = list(devices["parameter_bytes"].values())
    assert len(per_device) == 4 and len(set(per_device)) == 1
    # FSDP: each device holds a quarter of the sharded matrices and token embeddings; the VAE and the
    # norms stay whole, so less than the whole model but more than 1/4.
    single = subprocess.run([*args[:6], *args[8:]], env=env_with_devices(1), capture_output=True, text=True,
                            timeout=900)
    assert single.returncode == 0, single.stderr[-2000:]
    whole = sum(json.loads(single.stdout)["devices"]["parameter_bytes"].values())
    assert whole / 4 < per_device[0] < 0.9 * whole
