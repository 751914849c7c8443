"""Interrupts leave nothing behind: real SIGINT / SIGTERM / SIGKILL sent to the console script in a
subprocess, at moments found on disk (a temporary appears, an executable is stored), never by timing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core import temporaries
from flux2klein_cli.core.errors import Flux2KleinError
from flux2klein_cli.core.runs import generate as generate_module

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = [signal.SIGINT, signal.SIGTERM]
# Polling only decides when to send a signal; a test fails on what it finds, never on a duration.
DEADLINE_S = 300


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               FLUX2KLEIN_CACHE=str(tmp_path / "cache"), FLUX2KLEIN_COMPILE_CACHE=str(tmp_path / "executables"))
    env.update(extra)
    return env


def _as_at_a_terminal() -> None:
    """SIGINT and SIGTERM at their defaults, as a command typed at a terminal starts: a test run
    started in the background (`cmd &` in a script) passes SIGINT on ignored, and the tool rightly
    keeps an inherited SIG_IGN."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    # The console script's module (`python -m` runs the same main as the `flux2klein` script).
    return subprocess.Popen([sys.executable, "-m", "flux2klein_cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_as_at_a_terminal)


def _handlers_installed(pid: int) -> bool:
    """The process catches SIGTERM: cli/main.py's handlers are in (Python alone never catches it)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def _wait_for(proc: subprocess.Popen[str], ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no sign of {what}")
        time.sleep(0.005)


def _interrupt(proc: subprocess.Popen[str], signum: int) -> tuple[int, str, str]:
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=DEADLINE_S)
    return proc.returncode, out, err


def _assert_interrupted(code: int, out: str, err: str) -> None:
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "interrupted", err
    assert err.splitlines().count("interrupted") == 1, err
    assert "Traceback" not in err and "SIGTERM received" not in err and "Aborted" not in err, err
    assert out == ""


def _partials(*dirs: Path) -> list[Path]:
    return [p for d in dirs if d.is_dir() for p in d.rglob(f"*{temporaries.MARK}*")]


def _stored(store: Path) -> list[Path]:
    return [p for p in store.glob("*/meta.json")] if store.is_dir() else []


# --- the moments: imports, model work, writes


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS, ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_imports_stops_with_130(signum: int, tmp_path: Path) -> None:
    proc = _start(["generate", "a fox", "--model", "tiny", "-o", str(tmp_path / "fox.png")], _env(tmp_path))
    _wait_for(proc, lambda: _handlers_installed(proc.pid), "its signal handlers were installed")
    _assert_interrupted(*_interrupt(proc, signum))
    # A loaded machine may get as far as the tiny write: its cache folder may stay, never a partial.
    assert not (tmp_path / "fox.png").exists() and _partials(tmp_path) == []
    assert {p.name for p in tmp_path.iterdir()} <= {"cache"}


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS, ids=["SIGINT", "SIGTERM"])
def test_generate_interrupted_after_its_first_compile(signum: int, tiny_checkpoint: Path, tmp_path: Path) -> None:
    """After the backend started (absl's FailureSignalHandler is installed then): no native stack
    dump, no PNG, no temporary, no half-written store entry; the next run works."""
    env = _env(tmp_path)
    store, out = tmp_path / "executables", tmp_path / "out"
    out.mkdir()
    args = ["generate", "a fox", "--model", str(tiny_checkpoint), "-o", str(out / "fox.png"), "-n", "2",
            "--height", "48", "--width", "80", "--json"]
    proc = _start(args, env)
    _wait_for(proc, lambda: bool(_stored(store)), "an executable was stored")
    _assert_interrupted(*_interrupt(proc, signum))
    assert list(out.iterdir()) == [] and _partials(store) == []
    for meta in _stored(store):  # every entry in place is whole
        assert {p.name for p in meta.parent.iterdir()} == {"executable.bin", "trees.json", "meta.json"}
    again = subprocess.run([sys.executable, "-m", "flux2klein_cli", *args], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.iterdir()) == ["fox-0.png", "fox-1.png"]


@pytest.mark.slow
def test_compile_interrupted_leaves_whole_entries(tiny_checkpoint: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    args = ["compile", "--model", str(tiny_checkpoint), "--height", "48", "--width", "48", "--cache-dir", str(store),
            "--sequential", "--json"]
    proc = _start(args, _env(tmp_path))
    _wait_for(proc, lambda: bool(_stored(store)), "an executable was stored")
    _assert_interrupted(*_interrupt(proc, signal.SIGINT))
    assert _partials(store) == []
    json.loads((store / "manifest.json").read_text())
    again = subprocess.run([sys.executable, "-m", "flux2klein_cli", *args], env=_env(tmp_path), capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr
    assert {p["status"] for p in json.loads(again.stdout)["programs"]} <= {"hit", "miss"}


@pytest.mark.slow
def test_convert_interrupted_leaves_nothing(tiny_checkpoint: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = work / "klein"
    args = ["convert", str(tiny_checkpoint), "--out", str(out), "--json"]
    proc = _start(args, _env(tmp_path))
    _wait_for(proc, lambda: any(work.glob(f".klein{temporaries.MARK}*/transformer/flat/*")),
              "the transformer was being written")
    _assert_interrupted(*_interrupt(proc, signal.SIGTERM))
    assert list(work.iterdir()) == []
    again = subprocess.run([sys.executable, "-m", "flux2klein_cli", *args], env=_env(tmp_path), capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr
    assert [p.name for p in work.iterdir()] == ["klein"]


@pytest.mark.slow
def test_the_first_tiny_write_killed_interrupted_then_done(tmp_path: Path) -> None:
    """SIGKILL leaves a partial (nothing can run); the next run removes it, and its own on SIGTERM;
    the third writes the checkpoint."""
    cache = tmp_path / "cache"
    partial = f".tiny-v1{temporaries.MARK}*"

    killed = _start(["fetch", "tiny"], _env(tmp_path))
    _wait_for(killed, lambda: any(cache.glob(f"{partial}/*")), "the tiny checkpoint was being written")
    killed.kill()
    killed.communicate()
    (left,) = cache.glob(partial)

    stopped = _start(["fetch", "tiny"], _env(tmp_path))
    _wait_for(stopped, lambda: any(p.parent != left for p in cache.glob(f"{partial}/*")), "the second write began")
    assert not left.exists()  # the dead writer's leftover went first
    _assert_interrupted(*_interrupt(stopped, signal.SIGTERM))
    assert [p.name for p in cache.iterdir() if p.name != "xla"] == []

    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "fetch", "tiny"], env=_env(tmp_path),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(cache / "tiny-v1")
    assert [p.name for p in cache.iterdir() if p.name != "xla"] == ["tiny-v1"]


# --- the watchdog: stuck cleanup and a second signal

STUCK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flux2klein_cli.cli import main
    from flux2klein_cli.core.temporaries import temporary_dir

    main.install_handlers()
    try:
        with temporary_dir(Path(sys.argv[1]), "x"):
            try:
                print("ready", flush=True)
                time.sleep(600)
            finally:
                time.sleep(600)  # a cleanup that never ends
    except main.Interrupted:
        print("unreachable", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("second", [False, True], ids=["grace-expires", "second-signal"])
def test_the_watchdog_exits_when_cleanup_is_stuck(second: bool, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path)], env=_env(tmp_path), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_as_at_a_terminal)
    assert proc.stdout.readline() == "ready\n"
    assert len(_partials(tmp_path)) == 1
    proc.send_signal(signal.SIGTERM)
    if second:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 130 and err == "interrupted\n" and out == "", err
    assert _partials(tmp_path) == []  # the watchdog removed the live temporary


# --- temporaries of dead processes


def test_stale_temporaries_of_dead_processes_only(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    host = temporaries.partial_name("x").split(temporaries.MARK)[1].rsplit("-", 2)[0]
    gone = tmp_path / f".out.png{temporaries.MARK}{host}-{pid}-0a1b2c3d"
    gone_dir = tmp_path / f".klein{temporaries.MARK}{host}-{pid}-0a1b2c3d"
    live = tmp_path / f".out.png{temporaries.MARK}{host}-{os.getppid()}-0a1b2c3d"
    elsewhere = tmp_path / f".out.png{temporaries.MARK}other-host-{pid}-0a1b2c3d"
    plain = tmp_path / ".out.png.tmp"
    for p in (gone, live, elsewhere, plain):
        p.write_bytes(b"x")
    gone_dir.mkdir()
    (gone_dir / "f").write_bytes(b"x")
    assert temporaries.remove_stale(tmp_path, "out.png") == [gone]
    assert sorted(temporaries.remove_stale(tmp_path)) == [gone_dir]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, elsewhere, plain))


def test_a_temporary_goes_on_failure(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), temporaries.temporary_dir(tmp_path, "out") as tmp:
        (tmp / "half").write_bytes(b"x")
        raise RuntimeError("midway")
    assert list(tmp_path.iterdir()) == []


# --- a batch that fails midway


@pytest.mark.slow
def test_a_failure_at_image_k_keeps_and_names_the_images_written(tiny_checkpoint: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = generate_module.write_png
    calls = []

    def fail_at_third(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:
            raise Flux2KleinError(f"could not write {path}: No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(generate_module, "write_png", fail_at_third)
    result = CliRunner().invoke(app, ["generate", "a fox", "--model", str(tiny_checkpoint), "-n", "4",
                                      "-o", str(tmp_path / "fox.png"), "--height", "32", "--width", "32",
                                      "--steps", "1", "--json"])
    assert result.exit_code == 1, result.stderr
    written = [str(tmp_path / "fox-0.png"), str(tmp_path / "fox-1.png")]
    assert json.loads(result.stdout) == {"error": json.loads(result.stdout)["error"], "outputs": written}
    assert "2 of 4 images were written" in result.stderr and all(w in result.stderr for w in written)
    assert sorted(str(p) for p in tmp_path.iterdir()) == written


# --- a signal as the command ends: after it returned, and during Python's own shutdown


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS, ids=["SIGINT", "SIGTERM"])
def test_a_signal_after_the_command_returned_exits_130(signum: int, tmp_path: Path) -> None:
    """The command's work is done (its result is on stdout); the signal is still answered: one
    `interrupted`, exit 130, never death by the signal with no message."""
    mark = tmp_path / "exiting"
    proc = _start(["fetch", "tiny"], _env(tmp_path, FLUX2KLEIN_TEST_EXIT_MARK=str(mark)))
    _wait_for(proc, mark.exists, "the command returned")
    code, out, err = _interrupt(proc, signum)
    assert code == 130, err
    assert err.splitlines()[-1] == "interrupted" and err.splitlines().count("interrupted") == 1, err
    assert "Traceback" not in err
    assert out.strip() == str(tmp_path / "cache" / "tiny-v1")


LATE = textwrap.dedent("""
    import os, signal, sys, time
    from flux2klein_cli.cli import main

    main.install_handlers()
    MODE = sys.argv[1]

    class Slow:  # destroyed as modules are torn down, after Python put the default handlers back
        def __del__(self, mode=MODE, os=os, signal=signal, time=time):
            if mode == "signal":
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)

    slow = Slow()
    if MODE == "timer":
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # a retry timer still pending as the process ends
""")


@pytest.mark.parametrize("mode", ["signal", "timer"])
def test_a_signal_or_a_timer_in_the_last_moments_is_ignored(mode: str, tmp_path: Path) -> None:
    """Past the last exit hook nothing can be answered any more: the signal (or the pending retry
    timer's SIGALRM) is ignored, and the process ends with its own code instead of dying of it."""
    done = subprocess.run([sys.executable, "-c", LATE, mode], env=_env(tmp_path), capture_output=True, text=True,
                          preexec_fn=_as_at_a_terminal, timeout=DEADLINE_S)
    assert (done.returncode, done.stderr) == (0, "")


def test_nothing_prints_after_interrupted(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`interrupted` is the last line: a thread still finishing after it (the programs loading
    ahead, whose pool Python's exit shut down) says nothing more."""
    import threading

    from flux2klein_cli.cli import interrupted_line, output

    output.warn("before")
    output.note("before")
    printed = threading.Event()
    printed.set()
    monkeypatch.setattr(interrupted_line, "_printed", printed)
    output.warn("stored executables unavailable (RuntimeError: cannot schedule new futures after shutdown)")
    output.note("generating 2 image(s), 4 steps")
    assert capsys.readouterr().err.split() == ["warning:", "before", "before"]
