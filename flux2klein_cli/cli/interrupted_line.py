"""The `interrupted` line: printed once, and the run's last. cli/main.py prints it, output.py's
KeyboardInterrupt handler too, and output.py prints nothing after it: a thread still finishing
then (the programs loading ahead, whose pool Python's exit has shut down) says nothing.

Only the standard library is imported here: cli/main.py needs it before anything heavy.
"""

from __future__ import annotations

import sys
import threading

_printed = threading.Event()


def announce() -> None:
    """`interrupted` on stderr, once."""
    if _printed.is_set():
        return
    _printed.set()
    try:
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def announced_elsewhere() -> None:
    """The line was printed by other means: do not print it again."""
    _printed.set()


def announced() -> bool:
    """Whether the line was printed."""
    return _printed.is_set()
