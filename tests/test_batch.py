"""`flux2klein batch`: manifests, grouping and shards, the results record, resume after SIGTERM, merge.

The runs use the embedded `tiny` model at 32x32, one step, 16 prompt tokens, in subprocesses
sharing one executable store (the first run compiles the shape, the rest load it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.engine.plan import RunFields, model_facts
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.runs.batch import grouping, manifest, results

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "tiny", "--height", "32", "--width", "32", "--steps", "1", "--max-sequence-length", "16"]
DEFAULTS = RunFields(prompts=(), height=32, width=32, steps=1, max_sequence_length=16)
DEADLINE_S = 300


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("batch-env")
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
                FLUX2KLEIN_CACHE=str(base / "cache"), FLUX2KLEIN_COMPILE_CACHE=str(base / "executables"))


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flux2klein_cli", "batch", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)


def _write_manifest(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "seed": i}) + "\n" for i, p in enumerate(prompts)))
    return path


def _records(out: Path, name: str = results.RESULTS) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path))


TWELVE = [f"item {i}" for i in range(12)]


# ----------------------------------------------------------------------------- manifest, no model


def test_the_three_formats_give_the_same_requests(tmp_path: Path) -> None:
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text('{"prompt": "a fox", "seeds": [3, 9], "images": ["ref.png"]}\n\n'
                     '{"prompt": "a cat", "steps": 4, "cache": "dbcache", "cache_taylorseer": true}\n')
    csv = tmp_path / "m.csv"
    csv.write_text('prompt,seeds,images,steps,cache,cache_taylorseer\n"a fox","3;9",ref.png,,,\n'
                   '"a cat",,,4,dbcache,yes\n')
    text = tmp_path / "m.txt"
    text.write_text("a fox\n\n  a cat  \n")
    got = [manifest.read_manifest(p, DEFAULTS) for p in (jsonl, csv, text)]
    assert [m.format for m in got] == ["jsonl", "csv", "text"]
    for m in got[:2]:
        fox, cat = m.entries
        assert fox.fields.prompts == ("a fox",) and fox.seeds == (3, 9) and fox.fields.num_images == 2
        assert fox.fields.references == (tmp_path / "ref.png",)  # relative to the manifest
        assert cat.fields.steps == 4 and cat.fields.height == 32  # the defaults under the line's fields
        assert (cat.fields.cache, cat.fields.cache_taylorseer, fox.fields.cache) == ("dbcache", True, None)
    assert [e.line for e in got[0].entries] == [1, 3] and [e.index for e in got[0].entries] == [0, 1]
    assert [e.fields.prompts for e in got[2].entries] == [("a fox",), ("a cat",)]


@pytest.mark.parametrize("line, message", [
    ("not json", "is not JSON"), ('["a list"]', "must be a JSON object"), ('{"steps": 2}', "prompt is missing"),
    ('{"prompt": "x", "colour": 1}', "unknown field 'colour'"), ('{"prompt": "x", "steps": "4"}', "whole number"),
    ('{"prompt": "x", "seed": 1, "seeds": [2]}', "not both"), ('{"prompt": "x", "strength": "0.5"}', "finite number"),
    ('{"prompt": "x", "seeds": [-1]}', "seed must be at least 0"),
])
def test_a_bad_line_is_an_entry_with_its_reason(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    good, bad = manifest.read_manifest(path, DEFAULTS).entries
    assert good.ok and not bad.ok and bad.line == 2 and message in bad.error


def test_outputs_that_escape_the_directory_or_collide_are_bad_lines(tmp_path: Path) -> None:
    facts = model_facts("tiny")
    path = tmp_path / "m.jsonl"
    lines = [{"prompt": "a", "output": "same.png"}, {"prompt": "b", "output": "SAME.png"},
             {"prompt": "c", "output": "../out.png"}, {"prompt": "d", "output": "/tmp/abs.png"},
             {"prompt": "e", "output": "{index}.jpg"}, {"prompt": "f", "output": "{prompt}.png"},
             {"prompt": "g", "output": "one.png", "num_images": 2}, {"prompt": "h", "output": "sub/{slug}-{seed}.png"},
             {"prompt": "i", "steps": 0}, {"prompt": "j", "images": ["missing.png"]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    entries = manifest.read_manifest(path, DEFAULTS).entries
    items, bad = grouping.plan_items(entries, facts, {})
    assert [i.entry.line for i in items] == [1, 8]
    assert items[1].outputs == ("sub/h-0.png",)
    reasons = {e.line: e.error for e in bad}
    assert "also line 1's" in reasons[2] and "outside the output directory" in reasons[3]
    assert "outside" in reasons[4] and "must end in .png" in reasons[5] and "{prompt}" in reasons[6]
    assert "one name" in reasons[7] and reasons[9].startswith("steps must be at least 1")
    assert "missing.png does not exist" in reasons[10]


def test_batches_keep_keys_together_and_shards_split_them(tmp_path: Path) -> None:
    facts = model_facts("tiny")
    path = tmp_path / "m.jsonl"
    sizes = [32, 48, 32, 48, 32, 32, 48]
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "height": h}) + "\n" for i, h in enumerate(sizes)))
    items, bad = grouping.plan_items(manifest.read_manifest(path, DEFAULTS).entries, facts, {})
    assert not bad
    batches = grouping.group_batches(items, 2)
    assert [[i.index for i in b.items] for b in batches] == [[0, 2], [4, 5], [1, 3], [6]]
    assert grouping.group_batches(items, 2) == batches  # deterministic
    shards = [grouping.Shard.parse(f"{i}/3").take(batches) for i in range(3)]
    assert sorted(i.index for s in shards for b in s for i in b.items) == list(range(7))
    for text in ("3/3", "1", "-1/2", "a/b"):
        with pytest.raises(UserInputError, match="shard"):
            grouping.Shard.parse(text)


def test_a_changed_line_or_default_changes_the_hash(tmp_path: Path) -> None:
    facts = model_facts("tiny")
    path = tmp_path / "m.jsonl"

    def digests(text: str, defaults: RunFields = DEFAULTS) -> list[str]:
        path.write_text(text)
        items, _ = grouping.plan_items(manifest.read_manifest(path, defaults).entries, facts, {"model": "tiny"})
        return [i.digest for i in items]

    first = digests('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert digests('{"prompt":"a"}\n{"prompt": "b"}\n') == first  # spacing is not a change
    changed = digests('{"prompt": "a"}\n{"prompt": "b!"}\n')
    assert changed[0] == first[0] and changed[1] != first[1]
    assert digests('{"prompt": "a"}\n{"prompt": "b"}\n', RunFields(prompts=(), steps=2)) != first


# ----------------------------------------------------------------------------- the command


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "absent.jsonl", "does not exist"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "latin1.txt").write_bytes(b"caf\xe9\n") and d / "latin1.txt", "is not UTF-8"),
    (lambda d: (d / "empty.jsonl").write_text("\n\n") and d / "empty.jsonl", "has no requests"),
    (lambda d: (d / "h.csv").write_text("text,seed\nx,1\n") and d / "h.csv", "no prompt column"),
])
def test_an_unreadable_manifest_is_exit_2_and_writes_nothing(tmp_path: Path, env: dict[str, str], make,
                                                             message: str) -> None:
    source = tmp_path / "in"
    source.mkdir()
    out = tmp_path / "out"
    done = _cli([make(source), "--out-dir", out, *SMALL], env)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""
    assert not out.exists()


def test_strict_stops_on_a_bad_line_before_anything_runs(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "no", "images": ["gone.png"]}\n')
    done = _cli([path, "--out-dir", tmp_path / "out", "--strict", *SMALL], env)
    assert done.returncode == 2 and "line 2" in done.stderr and "gone.png does not exist" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> tuple[Path, Path, dict]:
    """The twelve items of one shape, unsharded, two per batch: (manifest, out dir, report)."""
    base = tmp_path_factory.mktemp("whole")
    path = _write_manifest(base / "m.jsonl", TWELVE)
    out = base / "out"
    done = _cli([path, "--out-dir", out, "--bs", 2, "--json", *SMALL], env)
    assert done.returncode == 0, done.stderr
    return path, out, json.loads(done.stdout)


def test_a_whole_run_records_every_item_once(whole_run: tuple[Path, Path, dict]) -> None:
    _, out, report = whole_run
    assert (report["items"], report["ok"], report["failed"], report["images"], report["batches"]) == (12, 12, 0, 12, 6)
    assert report["programs_compiled"] + report["programs_loaded"] > 0 and report["images_per_second"] > 0
    records = _records(out)
    assert sorted(r["index"] for r in records) == list(range(12))
    for r in records:
        assert r["status"] == "ok" and r["outputs"] == [f"{r['index']:05d}-{r['index']}.png"]
        facts = results.file_facts(out / r["outputs"][0])
        assert r["files"][0]["sha256"] == facts["sha256"] and r["files"][0]["bytes"] == facts["bytes"]
    assert sorted(p.name for p in out.iterdir()) == sorted([results.RESULTS, *(r["outputs"][0] for r in records)])


def test_bad_lines_are_skipped_and_named_and_the_rest_runs(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "item 0", "seed": 0}\nnot json\n{"prompt": "r", "images": ["missing.png"]}\n'
                    '{"prompt": "item 1", "seed": 1}\n')
    done = _cli([path, "--out-dir", tmp_path / "out", "--json", *SMALL], env)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert [(b["line"], b["index"]) for b in report["bad_lines"]] == [(2, 1), (3, 2)]
    assert "manifest line 2: is not JSON" in done.stderr and "missing.png does not exist" in done.stderr
    assert report["ok"] == 2 and sorted(r["index"] for r in _records(tmp_path / "out")) == [0, 3]


def test_a_rerun_skips_what_is_done_and_redoes_a_changed_line(tmp_path: Path, env: dict[str, str],
                                                               whole_run: tuple[Path, Path, dict]) -> None:
    path, first, _ = whole_run
    out = tmp_path / "out"
    shutil.copytree(first, out)
    again = _cli([path, "--out-dir", out, "--bs", 2, "--json", *SMALL], env)
    assert again.returncode == 0 and json.loads(again.stdout)["skipped"] == 12
    assert json.loads(again.stdout)["ok"] == 0
    changed = _write_manifest(tmp_path / "m.jsonl", [*TWELVE[:5], "item five, changed", *TWELVE[6:]])
    (out / "00007-7.png").write_bytes(b"not the recorded file")  # a file that no longer matches its record
    redo = _cli([changed, "--out-dir", out, "--bs", 2, "--json", *SMALL], env)
    assert redo.returncode == 0, redo.stderr
    report = json.loads(redo.stdout)
    assert (report["ok"], report["skipped"]) == (2, 10)
    assert [r["index"] for r in _records(out)[12:]] == [5, 7]
    assert not np.array_equal(_pixels(out / "00005-5.png"), _pixels(first / "00005-5.png"))
    assert np.array_equal(_pixels(out / "00007-7.png"), _pixels(first / "00007-7.png"))


def test_two_shards_and_merge_give_the_unsharded_images(tmp_path: Path, env: dict[str, str],
                                                        whole_run: tuple[Path, Path, dict]) -> None:
    path, whole, _ = whole_run
    out = tmp_path / "out"
    for shard in ("0/2", "1/2"):
        done = _cli([path, "--out-dir", out, "--bs", 2, "--shard", shard, "--json", *SMALL], env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["ok"] == 6
    assert {p.name for p in out.glob("results*")} == {"results-shard-0-of-2.jsonl", "results-shard-1-of-2.jsonl"}
    merged = _cli(["--merge", out, "--json"], env)
    assert merged.returncode == 0, merged.stderr
    summary = json.loads(merged.stdout)
    assert (summary["items"], summary["ok"], summary["missing_shards"]) == (12, 12, [])
    records = _records(out)
    assert [r["index"] for r in records] == list(range(12))
    for r in records:
        name = r["outputs"][0]
        assert (out / name).read_bytes() == (whole / name).read_bytes()  # bit for bit, parameters included
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(out / "results-shard-0-of-2.jsonl", lonely)
    assert json.loads(_cli(["--merge", lonely, "--json"], env).stdout)["missing_shards"] == ["1/2"]


@pytest.mark.slow
def test_sigterm_mid_batch_then_a_rerun_does_every_item_exactly_once(tmp_path: Path, env: dict[str, str],
                                                                     whole_run: tuple[Path, Path, dict]) -> None:
    path, whole, _ = whole_run
    out = tmp_path / "out"
    args = [sys.executable, "-m", "flux2klein_cli", "batch", str(path), "--out-dir", str(out), "--bs", "2", "--json",
            *SMALL]

    def at_a_terminal() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)

    proc = subprocess.Popen(args, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=at_a_terminal)
    results_file = out / results.RESULTS
    deadline = time.monotonic() + DEADLINE_S
    while not (results_file.exists() and results_file.read_text().count("\n") >= 2):  # the first batch recorded
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 130, stderr
    report = json.loads(stdout)
    assert report["interrupted"] and 2 <= report["ok"] < 12 and report["ok"] % 2 == 0  # whole batches only
    assert "stopping after the current batch" in stderr and "Traceback" not in stderr
    first = _records(out)
    assert len(first) == report["ok"] and all(r["status"] == "ok" for r in first)
    assert not list(out.glob(".*"))  # no temporaries left
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["skipped"] == report["ok"]
    records = _records(out)
    assert sorted(r["index"] for r in records) == list(range(12))  # each exactly once
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(r["outputs"][0] for r in records)
    for name in pngs:
        assert (out / name).read_bytes() == (whole / name).read_bytes()
