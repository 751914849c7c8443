"""`--help` and argument errors answer without importing jax or flax: the commands import core lazily."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("generate", "edit", "inspect", "parity", "bench", "fetch", "convert", "compile")
HEAVY = ("jax", "flax", "numpy", "torch")

# Runs the console entry in-process once per argv, then reports the exit codes and which heavy modules loaded.
PROBE = """
import json, sys
from flux2klein_cli.cli.main import main
codes = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["flux2klein", *argv]
    try:
        main()
    except SystemExit as e:
        codes.append(e.code)
import gc
print(json.dumps({"codes": codes, "heavy": [m for m in HEAVY if m in sys.modules], "gc": gc.get_threshold()}),
      file=sys.__stderr__)
"""


def probe(argvs: list[list[str]]) -> dict:
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stderr.strip().splitlines()[-1])


def test_help_of_every_command_imports_no_jax() -> None:
    report = probe([["--help"], *([name, "--help"] for name in COMMANDS)])
    assert report["codes"] == [0] * (len(COMMANDS) + 1)
    assert report["heavy"] == []


def test_usage_errors_import_no_jax() -> None:
    argvs = [[name, "--no-such-flag"] for name in COMMANDS] + [
        ["generate", "x", "--height", "64.5"],
        ["parity", "--threshold", "nan"],
    ]
    report = probe(argvs)
    assert report["codes"] == [2] * len(argvs)
    assert report["heavy"] == []


def test_the_probe_sees_a_heavy_import() -> None:
    """The check can fail: a command that does import jax is reported."""
    report = probe([["inspect", str(ROOT / "no-such-model")]])  # runs the body, which loads core
    assert report["codes"] == [2] and "jax" in report["heavy"]


def test_the_console_entry_sets_the_collector_thresholds() -> None:
    """A command's process collects garbage at runtime.COLLECTOR_THRESHOLDS, set before any heavy import."""
    from flux2klein_cli.core.devices.runtime import COLLECTOR_THRESHOLDS

    report = probe([["generate", "--help"]])
    assert tuple(report["gc"]) == COLLECTOR_THRESHOLDS != (700, 10, 10)


def test_bad_fields_fail_before_jax(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """A run whose fields, model or files are wrong says so before jax and flax are imported: the
    model's configs, the plan's checks and the output paths need neither."""
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not an image")
    model = str(tiny_checkpoint)
    argvs = [
        ["generate", "x", "--model", model, "--steps", "0"],
        ["generate", "x", "--model", model, "--height", "13"],
        ["generate", "x", "--model", model, "--height", "100000", "--width", "100000"],
        ["generate", "x", "--model", model, "-o", str(tmp_path / "no-such-folder" / "x.png")],
        ["generate", "x", "--model", str(tmp_path / "no-such-model")],
        ["generate", "x", "--model", model, "--lora", str(tmp_path / "no-such.safetensors")],
        ["edit", "x", "--model", model, "-i", str(not_an_image)],
    ]
    report = probe(argvs)
    assert report["codes"] == [2] * len(argvs)
    assert "jax" not in report["heavy"] and "flax" not in report["heavy"], report


def test_a_good_run_is_seen_importing_jax(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """The check above can fail: the same probe on a run that loads the model reports jax."""
    out = tmp_path / "x.png"
    report = probe([["generate", "x", "--model", str(tiny_checkpoint), "--height", "32", "--width", "32",
                     "--steps", "1", "-o", str(out)]])
    assert report["codes"] == [0] and out.is_file() and "jax" in report["heavy"]


def test_bad_fields_on_a_converted_directory_fail_before_jax(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """A converted directory's manifest and flat indexes are read and checked without jax: a bad
    field, a stale manifest or a truncated parameter file is refused before the heavy imports."""
    import shutil

    from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST
    from flux2klein_cli.core.weights.convert import convert

    converted = tmp_path / "converted"
    convert(tiny_checkpoint, converted)
    stale, truncated = tmp_path / "stale", tmp_path / "truncated"
    shutil.copytree(converted, stale)
    manifest = json.loads((stale / CONVERTED_MANIFEST).read_text())
    (stale / CONVERTED_MANIFEST).write_text(json.dumps({**manifest, "format_version": 2}))
    shutil.copytree(converted, truncated)
    data = truncated / "vae" / "flat" / "params.bin"
    os.truncate(data, data.stat().st_size - 4096)
    argvs = [
        ["generate", "x", "--model", str(converted), "--steps", "0"],
        ["generate", "x", "--model", str(converted), "-o", str(tmp_path / "no-such-folder" / "x.png")],
        ["generate", "x", "--model", str(stale)],
        ["generate", "x", "--model", str(truncated)],
    ]
    report = probe(argvs)
    assert report["codes"] == [2] * len(argvs)
    assert "jax" not in report["heavy"] and "flax" not in report["heavy"], report
