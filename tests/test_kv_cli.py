"""`edit --kv` as a script calls it: the KV model default, reuse through --kv-cache-dir, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.test_generate_cli import image_file, run


def kv_edit(model: Path, tmp_path: Path, name: str, *extra: object) -> dict:
    a, b = image_file(tmp_path / "a.png", 96, 64), image_file(tmp_path / "b.png", 64, 80)
    result = run("edit", "put both on the sofa", "-i", a, "-i", b, "--kv", "--model", model, "-o",
                 tmp_path / name, "--steps", 2, "--dtype", "fp32", "--json", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout) | {"stderr": result.stderr}


@pytest.mark.slow
def test_kv_edit_reuses_its_disk_cache_in_a_later_run(tiny_kv_checkpoint: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv-store"
    first = kv_edit(tiny_kv_checkpoint, tmp_path, "first.png", "--kv-cache-dir", store)
    assert first["kv"] is True and first["kv_cache"] == "computed"
    assert len(list(store.glob("*.json"))) == 1 and len(list(store.glob("*.bin"))) == 1
    second = kv_edit(tiny_kv_checkpoint, tmp_path, "second.png", "--kv-cache-dir", store)
    assert second["kv_cache"] == "disk"
    one, two = (np.asarray(Image.open(tmp_path / n), np.int16) for n in ("first.png", "second.png"))
    assert np.abs(one - two).max() <= 1


def test_an_unwritable_kv_cache_dir_is_a_warning(tiny_kv_checkpoint: Path, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("x")
    report = kv_edit(tiny_kv_checkpoint, tmp_path, "out.png", "--kv-cache-dir", not_a_dir / "kv")
    assert report["kv_cache"] == "computed" and Path(report["outputs"][0]).is_file()
    assert "warning:" in report["stderr"] and "cannot store" in report["stderr"]


BAD = {
    "kv on a model without KV training": (["-i", "{a}", "--kv", "--model", "{plain}"],
                                          "use a KV-trained model (9b-kv)"),
    "kv cache dir without kv": (["-i", "{a}", "--kv-cache-dir", "{tmp}/kv", "--model", "{kv}"],
                                "--kv-cache-dir needs --kv"),
    "kv with no image": (["--kv", "--model", "{kv}"], "--image"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_kv_errors_are_exit_2_and_write_nothing(case: str, tiny_checkpoint: Path, tiny_kv_checkpoint: Path,
                                                  tmp_path: Path) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    a = image_file(inputs / "a.png", 64, 64)
    args, expected = BAD[case]
    args = [x.format(a=a, plain=tiny_checkpoint, kv=tiny_kv_checkpoint, tmp=tmp_path) for x in args]
    result = run("edit", "x", *args, "-o", tmp_path / "out.png")
    assert result.exit_code == 2, result.output
    assert expected in result.stderr and "Traceback" not in result.output
    if case != "kv with no image":  # that one is Typer's own usage message
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs"]


def test_kv_without_model_means_9b_kv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --kv and no --model the KV model is used: offline and not cached, the error names it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = image_file(tmp_path / "a.png", 64, 64)
    result = run("edit", "x", "-i", a, "--kv", "-o", tmp_path / "out.png")
    assert result.exit_code == 2, result.output
    assert "flux2klein fetch 9b-kv" in result.stderr
