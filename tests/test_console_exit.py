"""The console entry ends the process as Python's exit does, minus the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# An exit hook, a buffered line, a non-daemon thread still working, and an object whose __del__
# only the interpreter's teardown would run; then `_exit_now(CODE)`.
SCRIPT = """
import atexit, sys, threading, time
from flux2klein_cli.cli import main as entry

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()
atexit.register(lambda: print("hook ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
sys.stdout.write("buffered ")
entry._exit_now({code!r})
"""


def exit_with(code: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(code=code)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_a_status_runs_hooks_joins_threads_flushes_and_skips_teardown() -> None:
    done = exit_with(3)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["buffered", "thread", "finished", "hook", "ran"]


def test_a_message_is_printed_and_exits_1_as_sys_exit_does() -> None:
    done = exit_with("no such model")
    assert done.returncode == 1
    assert done.stderr.strip() == "no such model"


def test_none_is_success() -> None:
    assert exit_with(None).returncode == 0


def test_without_it_the_teardown_runs() -> None:
    """The check can fail: the same script ending with sys.exit prints the teardown's line."""
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(code=0).replace("entry._exit_now(0)", "sys.exit(0)")],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "teardown ran" in done.stdout
