"""Pipeline programs from configs are the pipeline's own calls; `flux2klein compile` and its TPU targets."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

# Other processes on a shared host may hold libtpu's machine-wide lock; topology compiles here
# need none of the TPU itself. Set before jax touches libtpu (the CLI does the same).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from flux2klein_cli.cli.app import app  # noqa: E402
from flux2klein_cli.core.compile import specs as P  # noqa: E402
from flux2klein_cli.core.compile.compile_all import compile_all  # noqa: E402
from flux2klein_cli.core.compile.model_configs import model_configs  # noqa: E402
from flux2klein_cli.core.compile.store import ExecutableStore  # noqa: E402
from flux2klein_cli.core.devices.tpu import parse_preset  # noqa: E402
from flux2klein_cli.core.errors import UserInputError  # noqa: E402
from flux2klein_cli.core.models import trace  # noqa: E402
from flux2klein_cli.core.pipeline.geometry import LatentGeometry  # noqa: E402

KLEIN = LatentGeometry(pixels_per_token=16, channels=128)  # the tiny fixtures', as the published models'

runner = CliRunner()
SMALL = ["--height", "32", "--width", "32", "--max-sequence-length", "16", "--steps", "2"]


@pytest.mark.slow
def test_programs_from_configs_run_the_real_pipeline(tmp_path: Path) -> None:
    """Executables compiled from configs alone accept the engine's real arguments (a Compiled
    rejects any other tree, shape, dtype or sharding: the engine would warn and jit instead)
    and give its images: a KV edit of two prompts, which has every program a plain edit has and
    the references-only pass (a plain edit's stored programs: tests/test_compile_counter.py)."""
    from flux2klein_cli.core.engine.plan import RunFields
    from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
    from tests.fixtures.engine import engine_on, upload

    # The project's own writer: no torch needed, so the base tier runs this too.
    checkpoint = write_random_checkpoint(tmp_path / "ckpt", "tiny", kv=True, seed=1)
    run = P.RunShape(32, 32, KLEIN, batch=2, prompts=2, steps=2, references=((64, 96),), max_sequence_length=16,
                     dtype=jnp.float32, kv=True)
    specs = P.pipeline_programs(model_configs(str(checkpoint)), run)
    results = compile_all(specs, ExecutableStore(tmp_path / "store"))
    executables = {info.name: compiled for compiled, info in results}
    assert set(executables) == {"text_encoder", "noise", "denoise", "vae_decode", "vae_encode_64x96", "reference_kv"}

    from PIL import Image

    ref = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8))
    fields = RunFields(prompts=("a fox", "a cat"), steps=2, height=32, width=32, references=(upload(ref),),
                       max_sequence_length=16, kv=True)
    jitted = engine_on(checkpoint)
    plan = jitted.plan(fields)
    assert plan.shape(jnp.float32) == run
    warnings: list[str] = []
    stored = engine_on(checkpoint, store=True, compile_cache=tmp_path / "store", warn=warnings.append)
    done = stored.run(plan)
    assert {r["name"]: r["status"] for r in done.executables} == dict.fromkeys(executables, "hit")
    np.testing.assert_allclose(done.images.astype(int), jitted.run(plan).images, atol=1)
    assert not warnings
    noise = np.asarray(executables["noise"](np.asarray(plan.seeds, np.uint32)))
    np.testing.assert_array_equal(noise.transpose(0, 3, 1, 2), jitted.initial_noise(plan))


@pytest.mark.slow
def test_fast_effort_traces_the_vae_convolutions_as_matmuls(tiny_checkpoint: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """At `--effort fast` for a TPU the VAE programs have no 3x3 convolution left (only the 1x1
    ones and the downsamplers) and give the pipeline's decode and encode; elsewhere (slower
    there, to compile and to run) they keep their convolutions. The matmul form is checked here,
    on the CPU, by counting the CPU among its platforms."""
    import dataclasses

    from flux2klein_cli.core.compile.target import Target
    from tests.fixtures.engine import engine_on

    run = P.RunShape(32, 32, KLEIN, batch=2, prompts=2, steps=2, references=((32, 48),), max_sequence_length=16,
                     dtype=jnp.float32)
    configs = model_configs(str(tiny_checkpoint))
    def vae_programs(effort: str) -> list:
        target = dataclasses.replace(Target.local(), effort=effort)
        return [s for s in P.pipeline_programs(configs, run, target) if s.name.startswith("vae_")]

    by_effort = {effort: vae_programs(effort) for effort in ("default", "fast")}

    def same_3x3_convolutions(spec: object) -> int:
        """Convolutions padded by one pixel on every side: the 3x3 'same' ones (the others
        are 1x1, unpadded, or the stride-2 downsamplers, padded on one side)."""
        text = spec.lower().as_text()  # type: ignore[attr-defined]
        return sum("stablehlo.convolution" in line and "pad = [[1, 1], [1, 1]]" in line for line in text.splitlines())

    for default, fast in zip(by_effort["default"], by_effort["fast"], strict=True):
        assert same_3x3_convolutions(default) > 0 and same_3x3_convolutions(fast) > 0, default.name
    monkeypatch.setattr(trace, "MATMUL_CONV_PLATFORMS", frozenset({"tpu", "cpu"}))
    by_effort["fast"] = vae_programs("fast")
    for default, fast in zip(by_effort["default"], by_effort["fast"], strict=True):
        assert same_3x3_convolutions(default) > 0 and same_3x3_convolutions(fast) == 0, default.name
    executables = {info.name: compiled for compiled, info in compile_all(by_effort["fast"], ExecutableStore(tmp_path))}

    pipeline = engine_on(tiny_checkpoint).pipeline
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 2, 2, 128)).astype(np.float32)
    pixels = rng.uniform(-1, 1, (1, 32, 48, 3)).astype(np.float32)
    for name, jitted, x in (("vae_decode", pipeline._decode, latents), ("vae_encode_32x48", pipeline._encode, pixels)):
        expected = np.asarray(jitted(pipeline.vae_state, x))
        np.testing.assert_allclose(np.asarray(executables[name](pipeline.vae_state, x)), expected, atol=1e-4,
                                   err_msg=name)


@pytest.mark.slow
def test_tiny_for_tpu_v6e_4_has_a_manifest_with_memory_figures(tiny_checkpoint: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'flux2klein-cli[tpu]'); CI installs it")
    args = ["compile", "--model", str(tiny_checkpoint), *SMALL, "--tpu", "v6e-4", "--cache-dir", str(tmp_path),
            "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["target"]["topology"] == "v6e:2x2" and report["target"]["device_count"] == 4
    assert report["parallel"] is False  # TPU programs compile one at a time (compile_all.compiles_serially)
    assert report["target"]["device_kind"] == "TPU v6 lite"
    assert {p["name"]: p["status"] for p in report["programs"]} == {
        "text_encoder": "miss", "noise": "miss", "denoise": "miss", "vae_decode": "miss"}
    assert report["verdict"]["fits"] and report["verdict"]["hbm_bytes_per_device"] == 32 * 1024**3
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["executables"]) == 4
    for entry in manifest["executables"]:
        memory = entry["memory"]
        assert memory["argument"] > 0 and memory["generated_code"] > 0 and memory["peak"] > 0, entry["name"]
        assert entry["key_parts"]["versions"]["libtpu"]
    again = runner.invoke(app, args)  # verified from the store, not recompiled
    assert again.exit_code == 0, again.stderr
    assert [p["status"] for p in json.loads(again.stdout)["programs"]] == ["hit"] * 4


@pytest.mark.slow
def test_fast_effort_for_tpu_skips_the_multi_output_fusion_pass(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """For TPU targets `--effort fast` also turns off libtpu's multi-output fusion pass (the
    9B decode's longest single-threaded step): the compiled decode keeps few tuple-output fusions."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'flux2klein-cli[tpu]'); CI installs it")
    import dataclasses
    import re

    from flux2klein_cli.core.compile.target import EFFORTS, Target
    from flux2klein_cli.core.devices.tpu import parse_preset

    target = dataclasses.replace(Target.for_preset(parse_preset("v6e-4")), effort="fast")
    run = P.RunShape(32, 32, KLEIN, batch=4, prompts=1, steps=2, references=(), max_sequence_length=16,
                     dtype=jnp.bfloat16)
    spec = next(s for s in P.pipeline_programs(model_configs(str(tiny_checkpoint)), run, target)
                if s.name == "vae_decode")
    lowered = spec.lower()

    def multi_output_fusions(compiled: object) -> int:
        text = compiled.as_text()  # type: ignore[attr-defined]
        return sum(bool(re.search(r"= \(.*\) fusion\(", line)) for line in text.splitlines())

    ours = multi_output_fusions(ExecutableStore(tmp_path).compile(spec, lowered)[0])
    with_pass = multi_output_fusions(lowered.compile(EFFORTS["fast"]))
    assert ours * 2 < with_pass, (ours, with_pass)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tpu", "v9-4"], "unknown TPU preset 'v9-4': use one of v4-8,"),
        (["--tpu", "v6e-3"], "unknown TPU preset 'v6e-3'"),
        (["--refs", "512by512"], "--refs '512by512' is neither a count nor HEIGHTxWIDTH"),
        (["--refs", "5"], "--refs gives 5 reference images; at most 4 are supported"),
        (["--refs", "512x500"], "width 500 is not a multiple of 16"),
        (["--height", "0", "--width", "64"], "--height must be at least 16 px, got 0"),
        (["--mesh", "model=2"], "--mesh names an unknown axis 'model'"),
        (["--mesh", "fsdp=2", "--tpu", "v6e-4"], "--mesh or --tpu: give one, not both"),
        (["--kv", "--refs", "32x32"], "--kv needs a KV-trained checkpoint"),
        (["--kv"], "--kv needs a KV-trained checkpoint"),
        (["--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["--effort", "max"], "--effort must be one of default, fast, got 'max'"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_checkpoint: Path, tmp_path: Path, extra: list[str],
                                         message: str) -> None:
    result = runner.invoke(app, ["compile", "--model", str(tiny_checkpoint), "--cache-dir", str(tmp_path), *extra])
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(" ".join(lines).split("error:")) == 2 and "Traceback" not in result.stderr
    assert message in " ".join(" ".join(lines).split()), result.stderr
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("name, canonical, topology, chips", [
    ("v6-4", "v6e-4", "v6e:2x2", 4), ("v6e:2x2", "v6e-4", "v6e:2x2", 4), ("v5e-4", "v5litepod-4", "v5e:2x2", 4),
    ("v5litepod-8", "v5litepod-8", "v5e:2x4", 8), ("v5p-8", "v5p-8", "v5p:2x2x1", 4), ("v4-8", "v4-8", "v4:2x2x1", 4),
    ("v7-2", "v7-2", "tpu7x:1x1x1", 1), ("V7-8", "v7-8", "tpu7x:2x2x1", 4), ("tpu7x-8", "v7-8", "tpu7x:2x2x1", 4),
])
def test_tpu_presets_by_runbook_and_cloud_names(name: str, canonical: str, topology: str, chips: int) -> None:
    preset = parse_preset(name)
    assert (preset.name, preset.topology_name, preset.chips) == (canonical, topology, chips)


def test_registry_alias_needs_no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core.errors import CheckpointError
    from flux2klein_cli.core.hub import snapshot

    def not_cached(*args: object, **kwargs: object) -> None:
        raise CheckpointError("not in the Hugging Face cache")

    monkeypatch.setattr(snapshot, "resolve", not_cached)
    configs = model_configs("9b")
    assert configs.source == "registry:9b" and configs.transformer["num_layers"] == 8
    assert configs.vae["block_out_channels"] == [128, 256, 512, 512]
    from flux2klein_cli.core.engine.plan import ModelFacts, build_shape

    with pytest.raises(UserInputError, match="height 1000 is not a multiple of 16"):
        build_shape(ModelFacts.of("9b", configs), dtype=None, height=1000, width=1024)


def test_fsdp_rule_splits_the_largest_divisible_dimension() -> None:
    """The compile specs place parameters by the loader's rule (core/devices/sharding.py)."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as Spec

    from flux2klein_cli.core.devices.mesh import MESH_AXES
    from flux2klein_cli.core.devices.sharding import parameter_spec

    mesh = AbstractMesh((1, 4, 1, 1), MESH_AXES)
    assert parameter_spec(mesh, ("context_embedder", "kernel"), (3072, 9216)) == Spec(None, "fsdp")
    # never the scanned layer axis
    assert parameter_spec(mesh, ("transformer_blocks", "norm_out", "kernel"), (8, 3072, 9216)) == Spec(
        None, None, "fsdp")
    assert parameter_spec(mesh, ("conv", "kernel"), (3, 3, 128, 3)) == Spec(None, None, "fsdp", None)
    # a token table over its features (a local lookup), not over the larger vocabulary
    assert parameter_spec(mesh, ("embed_tokens", "embedding"), (151936, 4096)) == Spec(None, "fsdp")
    assert parameter_spec(mesh, ("norm", "scale"), (3072,)) == Spec(None) and parameter_spec(
        mesh, ("proj", "kernel"), (5, 7)) == Spec(None, None)
    # an item of a module list (diffusers' `to_out.0`) is ruled by the list's name: row parallel
    to_out = ("transformer_blocks", "attn", "to_out", "0", "kernel")
    assert parameter_spec(AbstractMesh((1, 2, 2, 1), MESH_AXES), to_out, (8, 64, 64)) == Spec(None, "tensor", "fsdp")
