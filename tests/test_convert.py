"""`flux2klein convert` and loading converted directories, in both layouts (flat and Orbax):
bit-identical round trips, zero-copy flat loads, the manifest, overwrite protection, interrupted
converts, sharded restores, and damaged or tampered directories."""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.errors import CheckpointError, Flux2KleinError, UserInputError
from flux2klein_cli.core.hub.checkpoint import load_models
from flux2klein_cli.core.hub.layout import Snapshot
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST
from flux2klein_cli.core.weights import convert as convert_module
from flux2klein_cli.core.weights import flat_index, flat_store
from flux2klein_cli.core.weights.convert import convert
from flux2klein_cli.core.weights.converted import load_component
from flux2klein_cli.core.weights.converted_manifest import check_converted

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

runner = CliRunner()
CLI = "from flux2klein_cli.cli.app import main; main()"


def cli(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 snapshot in the hub layout, distilled = False to see it carried through."""
    return write_random_checkpoint(tmp_path_factory.mktemp("src") / "snapshot", "tiny", distilled=False, seed=3)


@pytest.fixture(scope="module")
def converted(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default layout (flat)."""
    out = tmp_path_factory.mktemp("out") / "klein-bf16"
    result = cli("convert", str(source), "--out", str(out), "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{out}\n"  # only the path on stdout
    return out


@pytest.fixture(scope="module")
def converted_orbax(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "klein-bf16-orbax"
    result = cli("convert", str(source), "--out", str(out), "--dtype", "bf16", "--layout", "orbax")
    assert result.exit_code == 0, result.stderr
    return out


@pytest.fixture(params=["flat", "orbax"])
def any_converted(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("converted" if request.param == "flat" else "converted_orbax")


def flat(module) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(module))}


def assert_identical(a, b) -> None:
    for name in ("transformer", "text_encoder", "vae"):
        x, y = flat(getattr(a, name)), flat(getattr(b, name))
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and x[key].shape == y[key].shape, (name, key)
            assert np.array_equal(x[key].view(np.uint8), y[key].view(np.uint8)), (name, key)


@pytest.mark.parametrize("layout", ["flat", "orbax"])
def test_round_trip_is_bit_identical(source: Path, layout: str, tmp_path: Path,
                                     request: pytest.FixtureRequest) -> None:
    converted = request.getfixturevalue("converted" if layout == "flat" else "converted_orbax")
    snapshot = Snapshot.open(converted)
    assert snapshot.converted and snapshot.pipeline_class == "Flux2KleinPipeline" and not snapshot.is_distilled
    reference = load_models(Snapshot.open(source), dtype=jnp.bfloat16)
    assert_identical(load_models(snapshot, dtype=jnp.bfloat16), reference)
    # The VAE's latent statistics stay float32 in a bf16 checkpoint, as when loading safetensors.
    assert load_models(snapshot, dtype=jnp.bfloat16).vae.bn.running_mean[...].dtype == jnp.float32

    fp32 = tmp_path / "fp32"
    convert(source, fp32, dtype="fp32", layout=layout)
    assert_identical(load_models(Snapshot.open(fp32), dtype=jnp.float32),
                     load_models(Snapshot.open(source), dtype=jnp.float32))
    # Stored fp32, loaded bf16: the same rounding as converting the safetensors directly.
    assert_identical(load_models(Snapshot.open(fp32), dtype=jnp.bfloat16), reference)


def test_the_directory_alone_is_a_complete_model(source: Path, converted: Path) -> None:
    manifest = json.loads((converted / CONVERTED_MANIFEST).read_text())
    assert manifest["dtype"] == "bf16" and manifest["format"] == "flux2klein-converted"
    assert manifest["layout"] == "flat" and "mesh" not in manifest
    assert {c["layout"] for c in manifest["components"].values()} == {"flat"}
    assert (converted / "transformer" / "flat" / "params.bin").is_file()
    assert manifest["source"]["path"] == str(source) and manifest["source"]["kind"] == "local"
    files = manifest["source"]["files"]
    index = "transformer/diffusion_pytorch_model.safetensors.index.json"
    assert files[index]["bytes"] == (source / index).stat().st_size
    config = json.loads((source / "transformer" / "config.json").read_text())
    assert manifest["components"]["transformer"]["config"] == config
    assert manifest["components"]["vae"]["bytes"] > 0 and manifest["pipeline_class"] == "Flux2KleinPipeline"
    for rel in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "scheduler/scheduler_config.json",
                "model_index.json", "text_encoder/config.json", "text_encoder/generation_config.json"):
        assert (converted / rel).read_bytes() == (source / rel).read_bytes(), rel
    assert not list(converted.rglob("*.safetensors")) and not list(converted.rglob("orbax"))

    result = cli("fetch", str(converted), "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["kind"] == "converted"
    result = cli("inspect", str(converted), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["components"]["transformer"]["parameters"] > 0


def test_refuses_to_overwrite_without_force(source: Path, converted: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = cli("convert", str(source), "--out", str(out))
    assert result.exit_code == 2 and "--force" in result.stderr and result.stdout == ""
    assert (out / "keep.txt").read_text() == "mine"

    # --force replaces only what convert wrote (tests/test_convert_safety.py has the other cases).
    result = cli("convert", str(source), "--out", str(out), "--force")
    assert result.exit_code == 2 and "convert manifest" in result.stderr
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    out.rmdir()
    assert cli("convert", str(source), "--out", str(out)).exit_code == 0
    result = cli("convert", str(source), "--out", str(out), "--force", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["path"] == str(out) and report["dtype"] == "bf16" and report["components"]["vae"]["parameters"] > 0
    assert report["layout"] == "flat"
    assert check_converted(out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it

    for bad, message in ((converted, "already a converted"), (source, "inside the source")):
        result = cli("convert", str(bad), "--out", str(source / "inside") if bad == source else str(tmp_path / "x"))
        assert result.exit_code == 2 and message in result.stderr
    assert cli("convert", str(source), "--dtype", "fp16").exit_code == 2
    result = cli("convert", str(source), "--out", str(tmp_path / "y"), "--layout", "zarr")
    assert result.exit_code == 2 and "unknown layout" in result.stderr and not (tmp_path / "y").exists()


def test_a_failure_midway_leaves_nothing(source: Path, tmp_path: Path, monkeypatch) -> None:
    real = convert_module.convert_component

    def fail_at_vae(name, *args, **kwargs):
        if name == "vae":
            raise OSError(errno.EIO, "Input/output error")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(convert_module, "convert_component", fail_at_vae)
    with pytest.raises(Flux2KleinError, match="could not write .*out: Input/output error"):
        convert(source, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["flat", "orbax"])
def test_a_killed_convert_leaves_no_model(source: Path, layout: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", CLI, "convert", str(source), "--out", str(out),
                             "--layout", layout], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        # Kill it as soon as the transformer's checkpoint is being written.
        while time.monotonic() < deadline and proc.poll() is None:
            if any(tmp_path.glob(f".out.partial-*/transformer/{layout}/*")):
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "convert finished before it could be interrupted"
    assert not out.exists()
    (leftover,) = tmp_path.iterdir()
    for model in (leftover, out):
        with pytest.raises((CheckpointError, UserInputError)):
            Snapshot.open(model)
        assert cli("inspect", str(model)).exit_code == 2
    # The next convert to the same place cleans up after the dead one.
    convert(source, out, layout=layout)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_damaged_converted_directories_are_clear_errors(any_converted: Path, tmp_path: Path) -> None:
    converted = any_converted
    layout = json.loads((converted / CONVERTED_MANIFEST).read_text())["layout"]
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    shutil.rmtree(broken / "vae" / layout)
    with pytest.raises(CheckpointError, match=f"vae/{layout}"):
        Snapshot.open(broken)
    manifest = json.loads((converted / CONVERTED_MANIFEST).read_text())
    shutil.copytree(converted / "vae", broken / "vae", dirs_exist_ok=True)
    (broken / CONVERTED_MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(CheckpointError, match="format version 99"):
        Snapshot.open(broken)
    # A config that no longer matches the stored arrays: strict, like the safetensors loader.
    (broken / CONVERTED_MANIFEST).write_text(json.dumps(manifest))
    config = json.loads((broken / "transformer" / "config.json").read_text())
    (broken / "transformer" / "config.json").write_text(json.dumps({**config, "num_single_layers": 4}))
    result = cli("inspect", str(broken))
    assert result.exit_code == 2 and "single_transformer_blocks" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["flat", "orbax"])
def test_sharded_convert_and_restore_on_four_devices(source: Path, layout: str, tmp_path: Path) -> None:
    """Written (for Orbax: chunked by the row shards), restored into another sharding and into the
    same: each device gets its slice. A row shard is adopted straight from the mapping: in the flat
    file it is contiguous and aligned, in Orbax it is one chunk file."""
    code = textwrap.dedent(f"""
        import numpy as np, jax, jax.numpy as jnp
        from flax import nnx
        from jax.sharding import Mesh, PartitionSpec
        from flux2klein_cli.core.devices.mesh import MESH_AXES
        from flux2klein_cli.core.models.transformer import load_transformer
        from flux2klein_cli.core.weights.convert import convert
        from flux2klein_cli.core.weights.converted import load_component
        mesh = Mesh(np.array(jax.devices()).reshape(1, 4, 1, 1), MESH_AXES)
        def rows(path, shape):
            return PartitionSpec("fsdp") if shape and shape[0] % 4 == 0 else PartitionSpec()
        def cols(path, shape):
            return PartitionSpec(None, "fsdp") if len(shape) > 1 and shape[1] % 4 == 0 else PartitionSpec()
        convert({str(source)!r}, {str(tmp_path / "c")!r}, dtype="fp32", layout={layout!r}, mesh=mesh,
                sharding_rule=rows)
        ref = load_transformer({str(source / "transformer")!r}, dtype=jnp.float32)
        b = dict(nnx.to_flat_state(nnx.state(ref)))
        for rule, spec, axis in ((cols, PartitionSpec(None, "fsdp"), 1), (rows, PartitionSpec("fsdp"), 0)):
            ours = load_component("transformer", {str(tmp_path / "c")!r}, dtype=jnp.float32, mesh=mesh,
                                  sharding_rule=rule)
            mapped = [tuple(int(x, 16) for x in line.split()[0].split("-"))
                      for line in open("/proc/self/maps") if "/transformer/{layout}/" in line]
            sharded = adopted = 0
            for path, var in nnx.to_flat_state(nnx.state(ours)):
                x = var.get_value()
                assert np.array_equal(np.asarray(x), np.asarray(b[path].get_value())), path
                if x.sharding.spec == spec:
                    sharded += 1
                    assert len({{s.data.shape for s in x.addressable_shards}}) == 1
                    assert x.addressable_shards[0].data.shape[axis] == x.shape[axis] // 4
                    adopted += all(any(lo <= s.data.unsafe_buffer_pointer() < hi for lo, hi in mapped)
                                   for s in x.addressable_shards)
            assert sharded >= 5, sharded
            if axis == 0:
                assert adopted > sharded // 2, (adopted, sharded)  # row shards: views of the mapping
            elif {layout!r} == "orbax":
                assert adopted == 0, adopted  # column slices cut Orbax's row chunks: read by TensorStore
        print("ok")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


@pytest.mark.slow
def test_a_converted_directory_gives_the_same_image_as_its_source(source: Path, any_converted: Path) -> None:
    from flux2klein_cli.core.engine.plan import RunFields
    from tests.fixtures.engine import engine_on

    def image(model_dir: Path) -> np.ndarray:
        # base model (distilled = False) with guidance: the CFG branch runs too.
        engine = engine_on(model_dir, dtype="bf16")
        return engine.run(engine.plan(RunFields(prompts=("a red fox in snow",), negative_prompt="blur", steps=2,
                                                guidance=3.0, height=32, width=48, seed=4))).images

    from_source, from_converted = image(source), image(any_converted)
    assert from_source.shape == (1, 32, 48, 3) and from_source.std() > 1
    np.testing.assert_array_equal(from_converted, from_source)


def mapped_ranges(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of this process's mappings of `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[-1] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end, int(fields[2], 16)))
    return ranges


def test_flat_parameters_are_views_of_the_mapped_file(converted: Path) -> None:
    """On CPU every parameter's device buffer is the mapped file itself, at its offset, and the
    mapping lives exactly as long as the arrays that use it."""
    data = converted / "transformer" / "flat" / "params.bin"
    index = flat_index.read_index(data.parent)
    model = load_component("transformer", converted, dtype=jnp.bfloat16)
    ranges = mapped_ranges(data)
    assert ranges, "params.bin is not mapped"
    leaves = {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    assert leaves.keys() == index.tensors.keys()
    for key, array in leaves.items():
        pointer = array.unsafe_buffer_pointer()
        (start, _, file_offset), = [r for r in ranges if r[0] <= pointer < r[1]]
        assert pointer - start + file_offset == index.tensors[key].offset, key
        assert array.dtype == index.tensors[key].dtype

    kept, donated = sorted(leaves.values(), key=lambda a: a.nbytes)[-2:]
    expected = np.array(kept)
    # The mapping is read-only: donating a mapped parameter gives it up, but nothing is written
    # into the file (the output gets a buffer of its own).
    before = data.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "donated buffers were not usable"
        result = jax.jit(lambda x: x + 1, donate_argnums=0)(donated)
    assert donated.is_deleted() and not mapped_ranges(data)[0][0] <= result.unsafe_buffer_pointer() < \
        mapped_ranges(data)[-1][1]
    assert data.read_bytes() == before
    del donated, result
    del model, leaves, array
    gc.collect()
    assert mapped_ranges(data), "unmapped while an array still uses it"
    assert np.array_equal(np.asarray(kept).view(np.uint8), expected.view(np.uint8))
    del kept
    gc.collect()
    assert not mapped_ranges(data), "the mapping outlived its arrays"


def test_orbax_parameters_are_views_of_their_chunk_files(converted_orbax: Path) -> None:
    """The Orbax layout is plain zarr arrays of one raw chunk each: on CPU every parameter's
    device buffer is its chunk file, mapped, and the values are Orbax's own restore's."""
    import orbax.checkpoint.experimental.v1 as ocp

    state = converted_orbax / "transformer" / "orbax" / "state"
    model = load_component("transformer", converted_orbax, dtype=jnp.bfloat16)
    leaves = {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    by_orbax = ocp.load(converted_orbax / "transformer" / "orbax")
    assert by_orbax.keys() == leaves.keys()
    for key, array in leaves.items():
        chunk = state / key / ".".join("0" * array.ndim)
        assert chunk.stat().st_size == array.nbytes, key
        (start, _, file_offset), = [r for r in mapped_ranges(chunk)
                                    if r[0] <= array.unsafe_buffer_pointer() < r[1]]
        assert array.unsafe_buffer_pointer() - start + file_offset == 0, key
        assert np.array_equal(np.asarray(array).view(np.uint8), np.asarray(by_orbax[key]).view(np.uint8)), key


def test_orbax_checkpoints_in_other_forms_are_read_by_tensorstore(converted_orbax: Path, tmp_path: Path) -> None:
    """What this project wrote before (OCDBT, zarr3), or any Orbax checkpoint in its default form
    (compressed too), loads the same through TensorStore."""
    import orbax.checkpoint.experimental.v1 as ocp

    other = tmp_path / "other"
    shutil.copytree(converted_orbax, other)
    stored = ocp.load(converted_orbax / "vae" / "orbax")
    shutil.rmtree(other / "vae" / "orbax")
    ocp.save(other / "vae" / "orbax", stored)  # Orbax's defaults
    assert (other / "vae" / "orbax" / "state" / "manifest.ocdbt").exists()
    assert not any((other / "vae" / "orbax" / "state").glob("*/.zarray"))
    a = load_component("vae", other, dtype=jnp.bfloat16)
    b = load_component("vae", converted_orbax, dtype=jnp.bfloat16)
    for (_, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b)), strict=True):
        assert np.array_equal(np.asarray(x.get_value()).view(np.uint8), np.asarray(y.get_value()).view(np.uint8))


@pytest.mark.parametrize("how, message", [("truncated", r"\d+ bytes, expected \d+"), ("missing", "missing")])
def test_damaged_orbax_chunks_are_one_line_errors(converted_orbax: Path, tmp_path: Path, how: str,
                                                  message: str) -> None:
    """A raw chunk cut short or gone is an error naming it (TensorStore would read a missing
    chunk as zeros)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(converted_orbax, damaged)
    chunk = damaged / "transformer" / "orbax" / "state" / "x_embedder.kernel" / "0.0"
    if how == "truncated":
        os.truncate(chunk, chunk.stat().st_size - 64)
    else:
        chunk.unlink()
    with pytest.raises(CheckpointError, match=rf"x_embedder.kernel/0.0: damaged Orbax chunk \({message}"):
        load_component("transformer", damaged, dtype=jnp.bfloat16)
    result = cli("generate", "a fox", "--model", str(damaged), "--steps", "1", "--height", "32", "--width", "32",
                 "-o", str(tmp_path / "out.png"))
    assert result.exit_code == 2 and "damaged Orbax chunk" in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert not (tmp_path / "out.png").exists()


def _tamper(directory: Path, how: str) -> None:
    flat = directory / "transformer" / "flat"
    data, index_path = flat / "params.bin", flat / "index.json"
    if how == "truncated":
        os.truncate(data, data.stat().st_size - 4096)
    elif how == "grown":
        with data.open("ab") as f:
            f.write(b"\0" * 4096)
    elif how == "index edited":
        index = json.loads(index_path.read_text())
        first = next(iter(index["tensors"].values()))
        first["offset"] += 4096
        index_path.write_text(json.dumps(index))
    elif how == "index corrupt":
        index_path.write_text("{")
    elif how == "index missing":
        index_path.unlink()
    elif how == "other conversion":
        with data.open("r+b") as f:  # the header's conversion id (bytes 20-36)
            f.seek(20)
            f.write(b"\xff" * 16)
    elif how == "bad header":
        with data.open("r+b") as f:
            f.write(b"\0" * 16)


@pytest.mark.parametrize("how, message", [
    ("truncated", "truncated"), ("grown", "wrong size"), ("index edited", "modified after conversion"),
    ("index corrupt", "corrupt flat index"), ("index missing", "index.json is missing"),
    ("other conversion", "another conversion"), ("bad header", "bad header"),
])
def test_truncated_or_tampered_flat_files_are_one_line_errors(converted: Path, tmp_path: Path, how: str,
                                                              message: str) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    _tamper(damaged, how)
    with pytest.raises(CheckpointError, match=message):
        Snapshot.open(damaged)
    result = cli("inspect", str(damaged))
    assert result.exit_code == 2 and result.stdout == ""
    assert message in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr


def test_verify_finds_damaged_parameter_bytes(converted: Path, tmp_path: Path) -> None:
    """Flipped bytes inside a parameter are not looked for at load (that would read every byte),
    but each parameter's CRC-32 is stored and `verify` names the damaged ones."""
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    flat = damaged / "vae" / "flat"
    flat_store.verify(flat)
    key, entry = max(flat_index.read_index(flat).tensors.items(), key=lambda item: item[1].nbytes)
    with (flat / "params.bin").open("r+b") as f:
        f.seek(entry.offset + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match=rf"CRC-32 mismatch\): {key}"):
        flat_store.verify(flat)


@pytest.mark.parametrize("fmt, version", [("flux2klein-converted", 2), ("flux2klein-orbax", 1)])
def test_older_converted_directories_ask_to_convert_again(converted: Path, tmp_path: Path, fmt: str,
                                                           version: int) -> None:
    """Stored arrays are named by the models' parameter paths; directories written before the
    transformer's tree mirrored diffusers' (format versions 1 and 2) are refused in one line, exit 2."""
    old = tmp_path / "old"
    shutil.copytree(converted, old)
    manifest = json.loads((old / CONVERTED_MANIFEST).read_text())
    manifest.update(format=fmt, format_version=version)
    (old / CONVERTED_MANIFEST).write_text(json.dumps(manifest))
    result = cli("inspect", str(old))
    assert result.exit_code == 2
    assert f"format version {version}" in result.stderr and "convert the source snapshot again" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_flat_files_written_in_small_pieces_are_the_same(source: Path, converted: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters are written in pieces (row bands, and single rows split further when one row is
    over the piece size): tiny pieces give the same bytes and CRCs as whole parameters."""
    monkeypatch.setattr(flat_store, "_CHUNK_BYTES", 1000)
    small = tmp_path / "small"
    convert(source, small)
    for name in ("transformer", "text_encoder", "vae"):
        a, b = (flat_index.read_index(d / name / "flat") for d in (small, converted))
        assert {k: (t.shape, t.offset, t.crc32) for k, t in a.tensors.items()} == \
            {k: (t.shape, t.offset, t.crc32) for k, t in b.tensors.items()}
        # Byte for byte after the header (which holds each conversion's id).
        assert (small / name / "flat" / "params.bin").read_bytes()[4096:] == \
            (converted / name / "flat" / "params.bin").read_bytes()[4096:]


def test_bench_load_times_the_flat_layout_with_every_page_touched(source: Path, converted: Path) -> None:
    """bench_load's flat figures: load plus touch, with every parameter byte adopted from the mapping."""
    from flux2klein_cli.core.runs.bench.load import bench_load

    result = bench_load(source, converted_dir=converted, components=["vae"], reps=1, kinds=("flat", "cat"))
    vae = result["components"]["vae"]
    assert result["converted"] == {"flat": str(converted.resolve())}
    assert vae["flat"]["zero_copy_bytes"] == vae["flat"]["bytes"] == vae["bytes"] > 0
    assert vae["flat"]["seconds"]["min"] >= vae["flat"]["touch_seconds"]["min"] > 0
    assert "flat/cat" in vae["ratios"]
