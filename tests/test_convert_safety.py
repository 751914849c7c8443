"""`convert` never deletes what it did not write, and its write failures are one line (issue 16,
parts 1 and 6); `compile` into a store it cannot write is exit 1. Every case hashes the inputs
before and after: not a byte of them may change."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core import trust
from flux2klein_cli.core.errors import Flux2KleinError, UserInputError
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST
from flux2klein_cli.core.weights import convert as convert_module
from flux2klein_cli.core.weights import convert_target, flat_store
from flux2klein_cli.core.weights.convert import convert
from flux2klein_cli.core.weights.converted_manifest import check_converted

runner = CliRunner()


def cli(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def tree_hash(root: Path) -> dict[str, str]:
    """Every entry under `root` (links not followed): its kind and content hash or link target."""
    found = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def one_error_line(result, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # notes may precede it
    assert len(lines) == 1 and result.stderr.strip().endswith(lines[0]), result.stderr
    assert "Traceback" not in result.stderr and "warning:" not in result.stderr
    return " ".join(lines[0].split())


@pytest.fixture(scope="module")
def snapshot_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("base") / "src", "tiny", seed=5)


@pytest.fixture
def home(snapshot_src: Path, tmp_path: Path) -> Path:
    """DIR holding a copy of the snapshot (DIR/src) and a file of the user's, as in the issue."""
    import shutil

    shutil.copytree(snapshot_src, tmp_path / "src")
    (tmp_path / "notes.txt").write_text("the user's own file")
    return tmp_path


Case = namedtuple("Case", "out message")


def _cases(home: Path) -> dict[str, Case]:
    src = home / "src"
    (home / "link").symlink_to(src)
    return {
        "parent of the source": Case(home, "holds the source snapshot"),
        "the source": Case(src, "is the source snapshot"),
        "inside the source": Case(src / "transformer", "inside the source snapshot"),
        "new dir inside the source": Case(src / "new", "inside the source snapshot"),
        "a link to the source": Case(home / "link", "is the source snapshot"),
        "a link's child": Case(home / "link" / "vae", "inside the source snapshot"),
    }


@pytest.mark.parametrize("case", ["parent of the source", "the source", "inside the source",
                                  "new dir inside the source", "a link to the source", "a link's child"])
@pytest.mark.parametrize("force", [True, False])
def test_out_overlapping_the_source_is_exit_2_and_keeps_every_byte(home: Path, case: str, force: bool) -> None:
    out, message = _cases(home)[case]
    before = tree_hash(home)
    result = cli("convert", home / "src", "--out", out, *(["--force"] if force else []))
    assert message in one_error_line(result, 2)
    assert tree_hash(home) == before  # no byte changed, nothing left behind (no .link.replaced-*)


def test_force_refuses_a_directory_convert_did_not_write(home: Path) -> None:
    mine = home / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    before = tree_hash(home)
    line = one_error_line(cli("convert", home / "src", "--out", mine, "--force"), 2)
    assert str(mine) in line and CONVERTED_MANIFEST in line
    (home / "afile").write_text("x")
    before = tree_hash(home)
    line = one_error_line(cli("convert", home / "src", "--out", home / "afile", "--force"), 2)
    assert "not a directory" in line
    assert tree_hash(home) == before


def test_force_refuses_a_converted_directory_holding_the_users_files(home: Path) -> None:
    out = home / "klein"
    assert cli("convert", home / "src", "--out", out).exit_code == 0
    (out / "transformer" / "my-notes.md").write_text("mine")
    (out / "extra").mkdir()
    before = tree_hash(home)
    line = one_error_line(cli("convert", home / "src", "--out", out, "--force"), 2)
    assert f"holds {out / 'extra'}/ (and 1 more), which convert did not write" in line
    assert tree_hash(home) == before
    (out / "extra").rmdir()
    line = one_error_line(cli("convert", home / "src", "--out", out, "--force"), 2)
    assert f"holds {out / 'transformer' / 'my-notes.md'}, which convert did not write" in line
    (out / "transformer" / "my-notes.md").unlink()
    # What convert wrote, and only that, is replaced; the source and the user's file are kept.
    (out / CONVERTED_MANIFEST).write_text(json.dumps({**json.loads((out / CONVERTED_MANIFEST).read_text()),
                                                      "created": "old"}))
    inputs = tree_hash(home / "src"), (home / "notes.txt").read_text()
    result = cli("convert", home / "src", "--out", out, "--force")
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / CONVERTED_MANIFEST).read_text())["created"] != "old" and check_converted(out)
    assert (tree_hash(home / "src"), (home / "notes.txt").read_text()) == inputs
    assert sorted(p.name for p in home.iterdir()) == ["klein", "notes.txt", "src"]


def test_a_symlinked_out_is_replaced_where_it_points(home: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    real = elsewhere / "klein"
    assert cli("convert", home / "src", "--out", real).exit_code == 0
    (home / "klein").symlink_to(real)
    inputs = tree_hash(home / "src")
    result = cli("convert", home / "src", "--out", home / "klein", "--force")
    assert result.exit_code == 0, result.stderr
    assert (home / "klein").is_symlink() and os.readlink(home / "klein") == str(real) and check_converted(real)
    assert sorted(p.name for p in home.iterdir()) == ["klein", "notes.txt", "src"]  # no .klein.replaced-*
    assert [p.name for p in elsewhere.iterdir()] == ["klein"]
    assert tree_hash(home / "src") == inputs


def test_out_holding_a_linked_input_is_exit_2(home: Path) -> None:
    """A hub snapshot's files link to blobs elsewhere: those blobs are inputs too."""
    blobs, snap = home / "blobs", home / "snap"
    snap.mkdir()
    for path in sorted((home / "src").rglob("*")):
        rel = path.relative_to(home / "src")
        if path.is_dir():
            (snap / rel).mkdir(parents=True)
        else:
            blob = blobs / hashlib.sha256(str(rel).encode()).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(path.read_bytes())
            (snap / rel).symlink_to(blob)
    before = tree_hash(home)
    line = one_error_line(cli("convert", snap, "--out", blobs, "--force"), 2)
    assert "holds an input of the conversion" in line
    assert tree_hash(home) == before


# --------------------------------------------------------------------------- part 6: write errors


def test_out_under_a_regular_file_is_exit_2_naming_it(home: Path) -> None:
    before = tree_hash(home)
    line = one_error_line(cli("convert", home / "src", "--out", home / "notes.txt" / "klein"), 2)
    assert line == f"error: cannot write --out {home / 'notes.txt' / 'klein'}: {home / 'notes.txt'} is not a directory"
    assert tree_hash(home) == before


def test_read_only_out_is_exit_2_and_the_default_place_exit_1(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args, **kwargs):  # root ignores chmod: the filesystem says no instead
        if self.name.startswith(".klein.partial-"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    before = tree_hash(home)
    line = one_error_line(cli("convert", home / "src", "--out", home / "klein"), 2)
    assert f"cannot write --out {home / 'klein'}" in line and "Read-only file system" in line
    with pytest.raises(Flux2KleinError, match="Read-only file system") as caught:
        convert(home / "src", home / "klein", user_out=False)
    assert not isinstance(caught.value, UserInputError)  # exit 1: not the user's --out
    assert tree_hash(home) == before


def test_too_little_free_space_is_exit_1_before_writing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(convert_target.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    written = []
    monkeypatch.setattr(convert_module, "convert_component", lambda *a, **k: written.append(a))
    before = tree_hash(home)
    line = one_error_line(cli("convert", home / "src", "--out", home / "klein"), 1)
    needed = convert_module.needed_bytes(home / "src", "bf16")
    assert needed > 2**20
    assert line == (f"error: not enough free space for {home / 'klein'}: the converted model needs about "
                    f"{convert_target.size_text(needed)}, 1.0 MiB available")
    assert written == [] and tree_hash(home) == before


def test_a_disk_that_fills_up_midway_is_exit_1_naming_needed_and_free(home: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(flat_store, "write_flat", full)
    before = tree_hash(home)
    line = one_error_line(cli("convert", home / "src", "--out", home / "klein"), 1)
    assert line.startswith(f"error: no space left on the device for {home / 'klein'}: the converted model needs about ")
    assert line.endswith(" available")
    assert tree_hash(home) == before  # the temporary is gone too


# --------------------------------------------------------------------------- compile's store

COMPILE = ("compile", "--model", "tiny", "--height", "32", "--width", "32", "--steps", "1")


def test_compile_into_a_regular_file_is_exit_1(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    line = one_error_line(cli(*COMPILE, "--cache-dir", tmp_path / "file"), 1)
    assert line == f"error: executable store {tmp_path / 'file'} is not a directory: nothing can be stored there"
    line = one_error_line(cli(*COMPILE, "--cache-dir", tmp_path / "file" / "store"), 1)
    assert f"cannot store executables in {tmp_path / 'file' / 'store'}" in line
    assert (tmp_path / "file").read_text() == "x"


def test_compile_into_a_read_only_store_is_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(path: Path) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(trust, "make_private_dir", read_only)
    line = one_error_line(cli(*COMPILE, "--cache-dir", tmp_path / "store"), 1)
    assert line == f"error: cannot store executables in {tmp_path / 'store'}: Read-only file system"
    assert not (tmp_path / "store").exists()
