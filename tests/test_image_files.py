"""PNG output with parameters, atomic and never clobbering; output naming; `--latents` files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.cli.flags import message
from flux2klein_cli.core.errors import Flux2KleinError, UserInputError
from flux2klein_cli.core.inputs.latents import load_latents
from flux2klein_cli.core.runs import image_files as out
from flux2klein_cli.core.runs.image_files import read_run_metadata, write_png
from flux2klein_cli.core.runs.outputs import plan_outputs

PIXELS = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
META = {
    "prompt": "a red fox in snow, 雪の中の狐 — «ünïcödé»",
    "negative_prompt": "",
    "seed": 42,
    "steps": 4,
    "guidance": 1.0,
    "size": [32, 48],
    "model": "black-forest-labs/FLUX.2-klein-4B",
    "references": ["a.png", "dir/b c.jpg"],
    "version": "0.1.0",
    "kv": False,
}


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_metadata_round_trip(tmp_path: Path) -> None:
    path = write_png(tmp_path / "fox.png", PIXELS, META, force=False)
    assert path == tmp_path / "fox.png"
    assert read_run_metadata(path) == META
    with Image.open(path) as im:
        assert im.format == "PNG" and np.array_equal(np.asarray(im), PIXELS)
        text = im.text
    # Every key is also a chunk of its own, readable by any PNG tool: strings as is, the rest as JSON.
    assert text["prompt"] == META["prompt"] and text["negative_prompt"] == ""
    assert text["seed"] == "42" and text["guidance"] == "1.0" and text["size"] == "[32, 48]"
    assert text["references"] == '["a.png", "dir/b c.jpg"]' and text["kv"] == "false"


def test_bad_metadata_key_fails_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_png(tmp_path / "x.png", PIXELS, {"": 1}, force=False)
    with pytest.raises(ValueError):
        write_png(tmp_path / "x.png", PIXELS, {"flux2klein": 1}, force=False)
    assert listing(tmp_path) == []


def test_no_overwrite_without_force(tmp_path: Path) -> None:
    path = tmp_path / "out.png"
    path.write_bytes(b"precious")
    with pytest.raises(UserInputError) as err:
        write_png(path, PIXELS, META, force=False)
    assert err.value.exit_code == 2 and message(err.value).endswith("exists; pass --force to overwrite")
    assert path.read_bytes() == b"precious" and listing(tmp_path) == ["out.png"]

    write_png(path, PIXELS, META, force=True)
    assert read_run_metadata(path) == META and listing(tmp_path) == ["out.png"]


def test_no_clobber_when_the_file_appears_during_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process creates the target after our up-front check: the hard-link commit refuses to replace it.
    path = tmp_path / "race.png"
    real_save = Image.Image.save

    def save_then_race(self, fp, *args, **kwargs):
        real_save(self, fp, *args, **kwargs)
        path.write_bytes(b"theirs")

    monkeypatch.setattr(Image.Image, "save", save_then_race)
    with pytest.raises(UserInputError, match="exists"):
        write_png(path, PIXELS, META, force=False)
    assert path.read_bytes() == b"theirs" and listing(tmp_path) == ["race.png"]


def test_atomic_write_leaves_only_the_file(tmp_path: Path) -> None:
    write_png(tmp_path / "a.png", PIXELS, META, force=False)
    write_png(tmp_path / "a.png", PIXELS, META, force=True)
    assert listing(tmp_path) == ["a.png"]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.png").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_failure_midway_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool) -> None:
    path = tmp_path / "out.png"
    if existing:
        path.write_bytes(b"old")

    real_fdopen = os.fdopen

    class HalfWritten:  # the disk fills up after the first bytes
        def __init__(self, fd: int, mode: str) -> None:
            self.file = real_fdopen(fd, mode)

        def __enter__(self) -> HalfWritten:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, data: bytes) -> int:
            self.file.write(data[:16])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", HalfWritten)
    with pytest.raises(Flux2KleinError, match="No space left on device") as err:
        write_png(path, PIXELS, META, force=True)
    assert err.value.exit_code == 1  # a runtime failure, not bad input
    assert listing(tmp_path) == (["out.png"] if existing else [])
    if existing:
        assert path.read_bytes() == b"old"


def test_fsync_failure_and_interrupt_leave_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(out.os, "fsync", failing_fsync)
    with pytest.raises(Flux2KleinError):
        write_png(tmp_path / "a.png", PIXELS, META, force=False)
    assert listing(tmp_path) == []

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(out.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_png(tmp_path / "a.png", PIXELS, META, force=False)
    assert listing(tmp_path) == []


def test_write_png_bad_targets(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="does not exist"):
        write_png(tmp_path / "no" / "dir.png", PIXELS, META, force=False)
    with pytest.raises(UserInputError, match=r"must end in \.png"):
        write_png(tmp_path / "out.jpg", PIXELS, META, force=False)
    (tmp_path / "d.png").mkdir()
    with pytest.raises(UserInputError, match="directory"):
        write_png(tmp_path / "d.png", PIXELS, META, force=True)
    with pytest.raises(ValueError):
        write_png(tmp_path / "f.png", PIXELS.astype(np.float32), META, force=False)
    assert listing(tmp_path) == ["d.png"]


# --- plan_outputs ----------------------------------------------------------------------------------------


def test_plan_outputs_naming(tmp_path: Path) -> None:
    assert plan_outputs(tmp_path / "out.png", 1, force=False) == [tmp_path / "out.png"]
    assert plan_outputs(tmp_path / "out.png", 3, force=False) == [tmp_path / f"out-{i}.png" for i in range(3)]
    twelve = plan_outputs(tmp_path / "out.png", 12, force=False)
    assert [p.name for p in twelve[:2]] == ["out-00.png", "out-01.png"] and twelve[-1].name == "out-11.png"
    assert plan_outputs(tmp_path / "Fox.PNG", 2, force=False) == [tmp_path / "Fox-0.PNG", tmp_path / "Fox-1.PNG"]
    assert plan_outputs(Path("relative.png"), 1, force=False) == [Path("relative.png")]
    assert listing(tmp_path) == []  # planning creates nothing


def test_plan_outputs_checks_every_target_up_front(tmp_path: Path) -> None:
    (tmp_path / "out-1.png").write_bytes(b"keep")
    with pytest.raises(UserInputError) as err:
        plan_outputs(tmp_path / "out.png", 3, force=False)
    assert message(err.value) == f"{tmp_path / 'out-1.png'} exists; pass --force to overwrite"
    assert plan_outputs(tmp_path / "out.png", 3, force=True)[1] == tmp_path / "out-1.png"
    assert (tmp_path / "out-1.png").read_bytes() == b"keep"

    for i in range(5):
        (tmp_path / f"many-{i}.png").write_bytes(b"")
    with pytest.raises(UserInputError, match="and 2 more exist"):
        plan_outputs(tmp_path / "many.png", 5, force=False)


def test_plan_outputs_bad_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserInputError, match=r"must end in \.png"):
        plan_outputs(tmp_path / "out.jpg", 1, force=False)
    with pytest.raises(UserInputError, match="is a directory"):
        plan_outputs(tmp_path, 1, force=False)
    with pytest.raises(UserInputError, match="output directory .* does not exist"):
        plan_outputs(tmp_path / "missing" / "out.png", 1, force=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserInputError, match="is not a directory"):
        plan_outputs(tmp_path / "file" / "out.png", 1, force=False)
    (tmp_path / "taken-0.png").mkdir()
    with pytest.raises(UserInputError, match="taken-0.png is a directory"):
        plan_outputs(tmp_path / "taken.png", 2, force=True)
    monkeypatch.setattr(out.os, "access", lambda *a, **k: False)  # root may write anywhere: simulate
    with pytest.raises(UserInputError, match="is not writable"):
        plan_outputs(tmp_path / "out.png", 1, force=False)


# --- load_latents ----------------------------------------------------------------------------------------

SHAPE = (2, 128, 4, 6)


def test_load_latents(tmp_path: Path) -> None:
    noise = np.random.default_rng(0).standard_normal(SHAPE)
    np.save(tmp_path / "n64.npy", noise)
    np.save(tmp_path / "n32.npy", noise.astype(np.float32))
    loaded = load_latents(tmp_path / "n64.npy", SHAPE)
    assert loaded.dtype == np.float32 and loaded.flags.c_contiguous
    assert np.array_equal(loaded, noise.astype(np.float32))
    assert np.array_equal(load_latents(tmp_path / "n32.npy", list(SHAPE)), noise.astype(np.float32))


@pytest.mark.parametrize("shape", [(1, 128, 4, 6), (2, 128, 6, 4), (128, 4, 6), (2, 32, 4, 6)])
def test_load_latents_wrong_shape(tmp_path: Path, shape: tuple[int, ...]) -> None:
    np.save(tmp_path / "n.npy", np.zeros(shape, np.float32))
    with pytest.raises(UserInputError) as err:
        load_latents(tmp_path / "n.npy", SHAPE)
    message = str(err.value)
    assert "(2, 128, 4, 6)" in message and "(" + ", ".join(map(str, shape)) + ")" in message
    assert "\n" not in message and err.value.exit_code == 2


def test_load_latents_unreadable(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="does not exist"):
        load_latents(tmp_path / "missing.npy", SHAPE)
    (tmp_path / "text.npy").write_text("not an array")
    with pytest.raises(UserInputError, match="cannot read latents"):
        load_latents(tmp_path / "text.npy", SHAPE)
    np.save(tmp_path / "cut.npy", np.zeros(SHAPE, np.float32))
    data = (tmp_path / "cut.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserInputError, match="cannot read latents"):
        load_latents(tmp_path / "cut.npy", SHAPE)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))
    with pytest.raises(UserInputError, match="cannot read latents"):
        load_latents(tmp_path / "obj.npy", SHAPE)
    np.savez(tmp_path / "arch.npz", a=np.zeros(SHAPE, np.float32))
    with pytest.raises(UserInputError, match="npz"):
        load_latents(tmp_path / "arch.npz", SHAPE)
    np.save(tmp_path / "int.npy", np.zeros(SHAPE, np.int32))
    with pytest.raises(UserInputError, match="dtype int32"):
        load_latents(tmp_path / "int.npy", SHAPE)
    bad = np.zeros(SHAPE, np.float32)
    bad[0, 0, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(UserInputError, match="NaN"):
        load_latents(tmp_path / "nan.npy", SHAPE)


def test_an_output_directory_that_takes_no_files_is_refused_up_front() -> None:
    # os.access says yes to root there; only a file made and removed tells (issue 30: -o /proc/o.png)
    with pytest.raises(UserInputError, match=r"output directory /proc is not writable \("):
        plan_outputs("/proc/o.png", 1, force=False)
    assert not any(p.name.startswith(".o.png") for p in Path("/proc").iterdir())
