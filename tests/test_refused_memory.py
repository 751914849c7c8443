"""A refused run stays small: the two inputs that used to exhaust memory (a billion steps, an endless
prompt file) are exit 2 with one line, and the whole process peaks under 1 GB of resident memory. A run
the host's memory cannot hold is refused before loading, alike at every door."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEAK_BYTES = 10**9
A = ["--model", "tiny", "--height", "64", "--width", "64"]


# Runs the command as its child and prints that child's peak RSS: a child forked straight from this
# test process would count this process's pages until its exec (gigabytes late in the suite).
_MEASURE = (
    "import os, subprocess, sys\n"
    "proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)\n"
    "_, status, usage = os.wait4(proc.pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)\n"  # KiB on Linux
)


def _peak_run(args: list[str], tmp_path: Path) -> tuple[int, str, int]:
    """Exit code, stderr and the peak RSS (bytes) of the console script run alone (os.wait4: that
    child's own rusage), measured from a small parent of its own."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               FLUX2KLEIN_CACHE=str(tmp_path / "cache"), FLUX2KLEIN_COMPILE_CACHE=str(tmp_path / "store"))
    with open(tmp_path / "stderr", "wb") as err:
        done = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "flux2klein_cli", *args],
                              env=env, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, cwd=tmp_path,
                              timeout=300, check=True)
    *printed, last = done.stdout.decode().splitlines() or [""]
    assert printed == []  # the command printed nothing on stdout
    code, peak = (int(v) for v in last.split())
    return code, (tmp_path / "stderr").read_text(), peak


@pytest.mark.slow
@pytest.mark.parametrize("extra, line", [
    (["a fox", "--steps", "1000000000"], "error: --steps must be at most 1000, got 1000000000"),
    (["--prompt-file", "/dev/zero", "--steps", "2"], "error: prompt file /dev/zero is larger than the limit of 1 MiB"),
], ids=["steps", "prompt-file"])
def test_a_refused_run_peaks_under_1_gb(extra: list[str], line: str, tmp_path: Path) -> None:
    code, err, peak = _peak_run(["generate", *A, *extra, "-o", str(tmp_path / "x.png")], tmp_path)
    assert (code, err.splitlines()) == (2, [line])
    assert peak < PEAK_BYTES, f"peak RSS {peak / 2**20:.0f} MiB"
    assert not (tmp_path / "x.png").exists()


def test_every_door_refuses_what_memory_cannot_hold_with_one_line(tiny_checkpoint: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for the weights and one 32x32 image: two images are refused before anything loads, by
    generate (exit 2), as a batch item's error record and as serve's 400, each naming the field its way."""
    import json
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app
    from flux2klein_cli.core.compile.model_configs import configs_from_snapshot
    from flux2klein_cli.core.engine import cost
    from flux2klein_cli.core.engine.engine import Engine, EngineOptions
    from flux2klein_cli.core.engine.plan import RunFields, build_plan, model_facts
    from flux2klein_cli.core.errors import FieldError
    from flux2klein_cli.core.fields import flag
    from flux2klein_cli.core.runs.batch.run import BatchOptions, run_batch
    from flux2klein_cli.core.serve.options import ServeOptions
    from flux2klein_cli.core.serve.service import Service, api_error

    model = str(tiny_checkpoint)
    facts = model_facts(model, model_dir=tiny_checkpoint)
    fields = RunFields(prompts=("a fox",), height=32, width=32, num_images=2)
    configs = configs_from_snapshot(tiny_checkpoint)
    one = cost.Admission(configs, "bf16", memory=(0, "probe")).cost(build_plan(fields, facts))
    room = one.parameter_bytes + one.activation_bytes_per_image * 3 // 2
    monkeypatch.setattr(cost, "device_memory_bytes", lambda: (room, "test memory"))
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded a refused run"))
    detail = f"asks too much: this run needs about {one.peak_bytes / 2**30:.1f} GiB for 2 image(s), more than the " \
             f"{room / 2**30:.1f} GiB of test memory; at most 1 image(s) in all (prompts x images) would fit"

    out = tmp_path / "o.png"
    result = CliRunner().invoke(app, ["generate", "a fox", "--model", model, "--height", "32", "--width", "32",
                                      "-n", "2", "-o", str(out)], catch_exceptions=False)
    assert (result.exit_code, result.stderr.splitlines()) == (2, [f"error: --num-images {detail}"])

    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text(json.dumps({"prompt": "a fox", "height": 32, "width": 32, "num_images": 2}) + "\n")
    warned: list[str] = []
    report = run_batch(BatchOptions(EngineOptions(model=model), manifest, tmp_path / "renders"),
                       lambda name: Path(name), warn=warned.append)
    records = [json.loads(line) for line in (tmp_path / "renders" / "results.jsonl").read_text().splitlines()]
    assert (report.failed, report.exit_code, warned) == (1, 1, [f"manifest line 1: num_images {detail}"])
    assert [(r["status"], r["error"]) for r in records] == [("error", f"num_images {detail}")]
    # Two lines of one image each fit alone, but not as the one device batch --bs 2 makes of them.
    manifest.write_text("".join(json.dumps({"prompt": f"fox {i}", "height": 32, "width": 32}) + "\n"
                                for i in range(2)))
    with pytest.raises(FieldError) as too_big:
        run_batch(BatchOptions(EngineOptions(model=model), manifest, tmp_path / "paired", batch_size=2),
                  lambda name: Path(name))
    assert too_big.value.named(flag) == "--bs " + detail.replace("in all (prompts x images)", "in one device batch")
    assert not (tmp_path / "paired").exists()

    engine = SimpleNamespace(facts=facts, options=EngineOptions(model=model), run_batch=None,
                             plan=lambda f: build_plan(f, facts))  # an engine whose weights never load
    service = Service(engine, ServeOptions(engine.options), admission=cost.Admission(configs, "bf16"))
    with pytest.raises(FieldError) as refused:
        service.plan({"prompt": "a fox", "size": "32x32", "n": 2})
    error = api_error(refused.value)
    assert (error.status, error.param, error.message) == (400, "n", f"n {detail}")
    assert not out.exists()
