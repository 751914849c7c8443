"""Issue 30's reproductions, each at its root: one line naming the field or the file, nothing
written, or the input handled correctly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.cli.flags import message
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.limits import LIMITS

# --- --lora PATH:SCALE ------------------------------------------------------------------------


def test_lora_bad_scale_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core.lora.files import LoraSpec

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError) as err:
        LoraSpec.parse("style.safetensors:abc")  # the file need not exist: the name says what was meant
    assert message(err.value).startswith("--lora style.safetensors:abc: the scale 'abc' is not a number")
    (tmp_path / "style").write_bytes(b"")
    with pytest.raises(UserInputError, match="the scale 'x' is not a number"):
        LoraSpec.parse("style:x")
    # A colon that is part of an existing name, or of a Windows path, still belongs to the path.
    (tmp_path / "a:b.safetensors").write_bytes(b"")
    assert LoraSpec.parse("a:b.safetensors") == LoraSpec("a:b.safetensors")
    assert LoraSpec.parse("C:/x/y.safetensors") == LoraSpec("C:/x/y.safetensors")
    assert LoraSpec.parse("style.safetensors:0.5") == LoraSpec("style.safetensors", 0.5)


# --- --latents ---------------------------------------------------------------------------------

SHAPE = (1, 128, 4, 4)


def test_latents_text_file_is_one_clean_line(tmp_path: Path) -> None:
    from flux2klein_cli.core.inputs.latents import load_latents

    (tmp_path / "text.npy").write_text("just some notes\n")
    with pytest.raises(UserInputError) as err:
        load_latents(tmp_path / "text.npy", SHAPE)
    message = str(err.value)
    assert "not a .npy file" in message and "pickle" not in message and "\n" not in message


def test_latents_header_checked_before_data(tmp_path: Path) -> None:
    """A header declaring another shape is refused without reading its (here absent) data."""
    from flux2klein_cli.core.inputs.latents import load_latents

    path = tmp_path / "big.npy"
    with open(path, "wb") as f:
        header = {"descr": "<f4", "fortran_order": False, "shape": (4096, 128, 512, 512)}
        np.lib.format.write_array_header_1_0(f, header)
    with pytest.raises(UserInputError, match=r"have shape \(4096, 128, 512, 512\); expected \(1, 128, 4, 4\)"):
        load_latents(path, SHAPE)


def test_latents_file_size_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core import limits
    from flux2klein_cli.core.inputs import latents

    np.save(tmp_path / "ok.npy", np.zeros(SHAPE, np.float32))
    monkeypatch.setattr(latents, "LIMITS", limits.Limits(latents_bytes=1024))
    with pytest.raises(UserInputError, match=r"latents file .*ok.npy is \d+ bytes; the limit is 1 KiB"):
        latents.load_latents(tmp_path / "ok.npy", SHAPE)


# --- PNG metadata --------------------------------------------------------------------------------

PIXELS = np.zeros((16, 16, 3), np.uint8)


def _chunks(path: Path) -> list[tuple[bytes, bytes]]:
    data, out, at = path.read_bytes(), [], 8
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        out.append((data[at + 4:at + 8], data[at + 8:at + 8 + length]))
        at += 12 + length
    return out


def test_png_nul_in_prompt_round_trips_without_nul_in_text(tmp_path: Path) -> None:
    from flux2klein_cli.core.runs.image_files import read_run_metadata, write_png

    meta = {"prompt": "a fox\x00and a hen\x07", "seed": 1, "model": "tiny"}
    write_png(tmp_path / "o.png", PIXELS, meta, force=False)
    assert read_run_metadata(tmp_path / "o.png") == meta
    for kind, body in _chunks(tmp_path / "o.png"):
        _, _, text = body.partition(b"\x00")  # keyword, then (iTXt) flags, language and translated keyword
        if kind == b"iTXt":
            text = text[2:].split(b"\x00", 2)[2]
        if kind in (b"tEXt", b"iTXt"):
            assert b"\x00" not in text, (kind, body[:40])
    with Image.open(tmp_path / "o.png") as im:
        assert json.loads(im.text["prompt"]) == meta["prompt"]


def test_png_stores_each_field_once(tmp_path: Path) -> None:
    from flux2klein_cli.core.runs.image_files import read_run_metadata, write_png

    prompt = "a long prompt " * (LIMITS.prompt_bytes // 14)
    meta = {"prompt": prompt, "steps": 4, "size": [16, 16]}
    write_png(tmp_path / "o.png", PIXELS, meta, force=False)
    assert (tmp_path / "o.png").read_bytes().count(b"a long prompt a long prompt") < len(prompt) // 27 + 2
    assert read_run_metadata(tmp_path / "o.png") == meta


def test_png_metadata_bounded(tmp_path: Path) -> None:
    from flux2klein_cli.core.runs.image_files import write_png

    with pytest.raises(UserInputError, match="PNG metadata would take more than 1048576 bytes"):
        write_png(tmp_path / "o.png", PIXELS, {"prompt": "x" * LIMITS.metadata_bytes}, force=False)
    assert list(tmp_path.iterdir()) == []


def test_png_older_format_still_read(tmp_path: Path) -> None:
    from PIL.PngImagePlugin import PngInfo

    from flux2klein_cli.core.runs.image_files import read_run_metadata

    info = PngInfo()
    info.add_text("seed", "3")
    info.add_itxt("flux2klein", json.dumps({"seed": 3, "prompt": "p"}))
    Image.fromarray(PIXELS).save(tmp_path / "old.png", pnginfo=info)
    assert read_run_metadata(tmp_path / "old.png") == {"seed": 3, "prompt": "p"}


# --- references --------------------------------------------------------------------------------


def test_sixteen_bit_grayscale_reference_scaled_by_its_range(tmp_path: Path) -> None:
    from flux2klein_cli.core.inputs.images import load_reference

    values = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(values).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as im:
        assert im.mode.startswith("I")  # what Pillow makes of a 16-bit grayscale PNG
    rgb = np.asarray(load_reference(tmp_path / "g16.png"))
    expected = np.rint(values / 257.0).astype(np.uint8)
    assert rgb.shape == (64, 64, 3) and np.array_equal(rgb[..., 0], expected) and np.array_equal(rgb[..., 2], expected)
    assert rgb.min() == 0 and (rgb == 255).mean() < 0.01  # not clipped to white


def test_float_tiff_reference_in_unit_range_is_scaled(tmp_path: Path) -> None:
    from flux2klein_cli.core.inputs.images import load_reference

    values = np.linspace(0.0, 1.0, 64 * 64, dtype=np.float32).reshape(64, 64)
    Image.fromarray(values).save(tmp_path / "f.tif")
    rgb = np.asarray(load_reference(tmp_path / "f.tif"))
    assert np.array_equal(rgb[..., 1], np.rint(values.astype(np.float64) * 255).astype(np.uint8))
    assert rgb.max() == 255  # not clipped to black


@pytest.mark.parametrize("values, words", [
    (np.full((64, 64), 3.5, np.float32), "values from 3.5 to 3.5; only values in"),
    (np.full((64, 64), -0.5, np.float32), "values from -0.5 to -0.5"),
    (np.full((64, 64), np.nan, np.float32), "NaN or infinite values"),
])
def test_float_tiff_reference_out_of_range_is_refused(tmp_path: Path, values: np.ndarray, words: str) -> None:
    from flux2klein_cli.core.inputs.images import load_reference

    Image.fromarray(values).save(tmp_path / "f.tif")
    with pytest.raises(UserInputError, match=rf"reference image .*f.tif holds floating-point pixels with {words}"):
        load_reference(tmp_path / "f.tif")


@pytest.mark.parametrize("size, words", [
    ((1, 1), "is 1x1; both sides must be at least 64 px"),
    ((63, 64), "is 63x64; both sides must be at least 64 px"),
    ((64, 600), r"is 64x600 \(aspect ratio 9.4:1\)"),
])
def test_small_or_narrow_reference_names_its_file(tmp_path: Path, size: tuple[int, int], words: str) -> None:
    from flux2klein_cli.core.inputs.images import load_reference

    Image.new("RGB", size).save(tmp_path / "a.png")
    with pytest.raises(UserInputError, match=rf"^reference image {tmp_path}/a.png {words}"):
        load_reference(tmp_path / "a.png")


def test_reference_pixels_and_bytes_from_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core import limits
    from flux2klein_cli.core.inputs import images

    Image.new("RGB", (8193, 8192)).save(tmp_path / "big.png")
    with pytest.raises(UserInputError, match=r"reference image .*big.png is 8193x8192 \(67 megapixels\)"):
        images.load_reference(tmp_path / "big.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(tmp_path / "a.png")
    monkeypatch.setattr(images, "LIMITS", limits.Limits(reference_bytes=100))
    with pytest.raises(UserInputError, match=r"reference image .*a.png is \d+ bytes; the limit is 100 bytes"):
        images.load_reference(tmp_path / "a.png")


# --- --transformer / --vae -------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"some notes, not weights\n", b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]",
                                     b"\x02\x00\x00\x00\x00\x00\x00\x00{}"])
def test_component_file_not_safetensors_is_named_and_nothing_composed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes) -> None:
    from flux2klein_cli.core.hub.components import resolve_composed

    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    Path("notes.safetensors").write_bytes(content)
    with pytest.raises(UserInputError) as err:
        resolve_composed(str(model), transformer="notes.safetensors")
    message = str(err.value)
    assert message.startswith("--transformer notes.safetensors: ") and "cache" not in message, message
    assert "\n" not in message and err.value.exit_code == 2
    assert not (tmp_path / "cache").exists()


def test_component_folder_weights_checked(tmp_path: Path) -> None:
    from flux2klein_cli.core.hub.components import resolve_component

    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").write_text("not weights")
    with pytest.raises(UserInputError, match=r"^--vae .*vae/diffusion_pytorch_model.safetensors: not a usable"):
        resolve_component("vae", str(tmp_path / "vae"))


# --- --tpu without libtpu -------------------------------------------------------------------------------


def test_tpu_preset_without_libtpu_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from flux2klein_cli.core.devices import tpu

    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` raises ImportError
    with pytest.raises(UserInputError) as err:
        tpu.check_topology_compiler(tpu.parse_preset("v6-4"))
    assert message(err.value).startswith("--tpu v6e-4 on a host without that TPU needs libtpu: pip install")


def test_compile_tpu_without_libtpu_prints_one_line(tmp_path: Path) -> None:
    """The whole command: libtpu hidden behind a package that fails to import; the refusal comes
    before the model is read, so nothing else reaches stderr."""
    import os
    import subprocess
    import sys

    shadow = tmp_path / "shadow" / "libtpu"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no libtpu here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]),
               FLUX2KLEIN_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "compile", "--model", "tiny", "--tpu", "v6-4",
                           "--height", "64", "--width", "64"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["error: --tpu v6e-4 on a host without that TPU needs libtpu: "
                                        "pip install 'flux2klein-cli[tpu]'"]
    assert not (tmp_path / "cache").exists()


# --- FLUX2KLEIN_CPU_MATMUL ------------------------------------------------------------------------------


@pytest.mark.parametrize("value, ok", [("bogus", False), ("XLA", False), ("xla", True), ("auto", True), ("", True)])
def test_cpu_matmul_variable_checked(monkeypatch: pytest.MonkeyPatch, value: str, ok: bool) -> None:
    from flux2klein_cli.core import settings
    from flux2klein_cli.core.models.trace import TraceOptions

    monkeypatch.setenv("FLUX2KLEIN_CPU_MATMUL", value)
    if ok:
        assert settings.cpu_matmul() == (value or "auto")
        return
    with pytest.raises(UserInputError, match=rf"^FLUX2KLEIN_CPU_MATMUL='{value}': use one of auto, xla$"):
        TraceOptions.for_platform("cpu")  # what a CPU run asks first


# --- --help -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_help_shows_no_type_after_flags(command: str) -> None:
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", command, "--help"], capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="160", TERM="dumb"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "<bool>" not in done.stdout
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("│ --")}
    assert "--force" in lines and "--help" in lines
    if command == "generate":
        assert "<int>" in lines["--steps"]  # value-taking options keep their type


# --- FLUX2KLEIN_XLA_CACHE ---------------------------------------------------------------------------------


def test_xla_cache_variable_must_name_a_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from flux2klein_cli.core.devices import runtime

    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", str(notes))
    with pytest.raises(UserInputError, match=rf"^FLUX2KLEIN_XLA_CACHE='{notes}': {notes} is not a folder$"):
        runtime.xla_cache_dir()
    monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", str(notes / "xla"))
    with pytest.raises(UserInputError, match=f"is under {notes}, which is not a folder$"):
        runtime.xla_cache_dir()
    for fine in (tmp_path / "new" / "xla", tmp_path):  # yet to be made, or a folder
        monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", str(fine))
        assert runtime.xla_cache_dir() == fine
    monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", "off")
    assert runtime.xla_cache_dir() is None


def test_generate_refuses_an_xla_cache_that_is_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app

    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", str(notes))
    out = tmp_path / "out"
    out.mkdir()
    done = CliRunner().invoke(app, ["generate", "x", "--model", "tiny", "--height", "64", "--width", "64",
                                    "--steps", "1", "-o", str(out / "x.png")])
    assert done.exit_code == 2, done.output
    assert done.stderr.splitlines() == [f"error: FLUX2KLEIN_XLA_CACHE='{notes}': {notes} is not a folder"]
    assert list(out.iterdir()) == [] and notes.read_text() == "x"
