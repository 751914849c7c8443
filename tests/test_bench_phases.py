"""`bench --phase lora` and `bench --phase decode` on the tiny random checkpoint (what they report,
not how fast: no timed assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.hub.random_checkpoint import preset, with_small_decoder, write_random_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))


def bench(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["bench", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_lora_phase_times_each_rank_beside_plain_and_leaves_nothing(tiny: Path, tmp_path: Path) -> None:
    code, out, err = bench("--model", tiny, "--phase", "lora", "--ranks", "2,4", "--reps", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert list(result["forms"]) == ["plain", "rank2", "rank4"]
    assert all(form["seconds"]["n"] == 2 for form in result["forms"].values())
    assert 0 < result["forms"]["rank2"]["file_mb"] < result["forms"]["rank4"]["file_mb"]
    cache = tmp_path / "cache"
    assert not cache.exists() or not [p for p in cache.iterdir() if "bench-lora" in p.name]
    code, _, err = bench("--model", tiny, "--phase", "lora", "--ranks", "0")
    assert code == 2 and "--ranks 0" in err
    code, _, err = bench("--model", tiny, "--phase", "decode", "--ranks", "4")
    assert code == 2 and "--ranks: only with --phase lora" in err


def test_decode_phase_decodes_the_overridden_vae(tiny: Path, tmp_path: Path) -> None:
    small = write_random_checkpoint(tmp_path / "small", with_small_decoder(preset("tiny")), components=("vae",))
    widths = {}
    for name, extra in (("full", ()), ("small", ("--vae", small / "vae"))):
        code, out, err = bench("--model", tiny, "--phase", "decode", "--height", 64, "--width", 32, "--reps", 1,
                               "--dtype", "fp32", "--json", *extra)
        assert code == 0, err
        result = json.loads(out)
        assert (result["height"], result["width"], result["decode_s"]["n"]) == (64, 32, 1)
        widths[name] = (result["decoder_widths"], result["parameters"])
    assert widths["small"][0] != widths["full"][0] and widths["small"][1] < widths["full"][1]
