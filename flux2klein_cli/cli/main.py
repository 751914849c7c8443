"""The console script: signal handling first, then the app.

Ctrl-C (SIGINT) and SIGTERM take one path: an `Interrupted` exception raised in the main thread, so
every `finally` removes its temporaries, then one line, `interrupted`, and exit 130. It is not a
KeyboardInterrupt, so neither click (which turns that into "Aborted!" and exit 1) nor a library's
`except KeyboardInterrupt` can swallow it. A watchdog thread, woken by the signal itself even while
the main thread is stuck in native code (an XLA compile), forces the same exit if the process has not
ended a few seconds later, or at once on a second signal, removing live temporaries first.

Once the command has returned, a signal no longer raises: it is noted, and the exit is 130 with
`interrupted`. Python's own shutdown restores the default handlers (which kill the process with no
message) and then tears modules down for a while, so the exit hook registered first (it runs last)
cancels the retry timer and sets SIGINT, SIGTERM and SIGALRM to be ignored before that happens.

Only the standard library is imported here: the handlers are in place before jax, so a signal
during the imports is handled too.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import NoReturn

from flux2klein_cli.cli import interrupted_line
from flux2klein_cli.core.import_hooks import around_import, skip_ipython_probes

EXIT_INTERRUPTED = 130
GRACE_S = 4.0  # time the main thread gets to clean up before the watchdog exits for it
_RETRY_S = 0.02
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state = {"signalled": False, "exiting": False, "hooked": False}


class Interrupted(BaseException):
    """SIGINT or SIGTERM: unwind, clean up, exit 130."""


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state["signalled"]:
        return  # the watchdog handles a second signal; raising again could cut a cleanup short
    _state["signalled"] = True
    if not _state["exiting"]:
        _raise_soon(frame)


def _raise_soon(frame: FrameType | None) -> None:
    """Raise `Interrupted` here, unless the main thread is inside an import: an exception in the
    middle of a module's (or an extension's) initialization leaves it half-built, which has ended
    in tracebacks wrapped as ImportError and segfaults. Then try again in a moment (SIGALRM)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            return
        frame = frame.f_back
    raise Interrupted()


def _retry(signum: int, frame: FrameType | None) -> None:
    if not _state["exiting"]:
        _raise_soon(frame)


def _unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """An `Interrupted` raised where Python cannot propagate it (a gc callback, a __del__) is
    dropped with a printed traceback: print nothing and raise it again in a moment instead."""
    if unraisable.exc_type is Interrupted:
        signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
        return
    sys.__unraisablehook__(unraisable)


def _force_exit() -> None:
    from flux2klein_cli.core.temporaries import remove_live  # imported by install_handlers already

    remove_live()
    interrupted_line.announce()
    os._exit(EXIT_INTERRUPTED)


def _watchdog(read_fd: int) -> None:
    """Blocks on the signal wakeup pipe; Python's C-level handler writes to it even when the main
    thread cannot run Python code."""
    deadline: float | None = None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read_fd], [], [], timeout)
        if not ready:
            _force_exit()
        try:
            data = os.read(read_fd, 64)
        except BlockingIOError:
            continue
        for signum in data:
            if signum not in _SIGNALS:
                continue
            if deadline is not None:  # a second signal: stop now
                _force_exit()
            deadline = time.monotonic() + GRACE_S


def install_handlers() -> None:
    """SIGINT and SIGTERM raise `Interrupted`; the watchdog listens on the wakeup pipe. A signal
    the parent set to be ignored stays ignored (a shell starts background jobs with SIGINT ignored,
    so that Ctrl-C at the terminal spares them), as Python itself does."""
    # Imported now, not by the watchdog: the main thread may hold the import lock when it fires.
    import flux2klein_cli.core.temporaries  # noqa: F401

    _state["exiting"] = False
    if not _state["hooked"]:  # first, so it runs after every exit hook the imports register
        _state["hooked"] = True
        atexit.register(_at_exit)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    os.set_blocking(read_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watchdog, args=(read_fd,), name="flux2klein-interrupts", daemon=True).start()
    sys.unraisablehook = _unraisable
    signal.signal(signal.SIGALRM, _retry)
    _reinstall()
    around_import("jax._src.xla_bridge", _xla_bridge_imported)


def _at_exit() -> None:
    """The last exit hook: from here on a signal is ignored (Python's shutdown would otherwise put
    the default handlers back); one that came since the command returned makes the exit 130."""
    _state["exiting"] = True
    signal.setitimer(signal.ITIMER_REAL, 0)
    for signum in (*_SIGNALS, signal.SIGALRM):
        signal.signal(signum, signal.SIG_IGN)
    if _state["signalled"]:
        interrupted_line.announce()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(EXIT_INTERRUPTED)


def _pause_for_test(mark: str) -> None:
    """FLUX2KLEIN_TEST_EXIT_MARK's exit hook (registered last, so it runs first): a test hook that
    touches the path it names once the command has returned, then waits (10 s at most) for a
    signal, so a test can send one during the interpreter's shutdown (tests/test_interrupts.py)."""
    with open(mark, "w"):
        pass
    deadline = time.monotonic() + 10.0
    while not _state["signalled"] and time.monotonic() < deadline:
        time.sleep(0.01)


def _reinstall() -> None:
    for signum in _SIGNALS:
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, _handler)


def _xla_bridge_imported(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Around jax's xla_bridge import: wrap its backend initialization. XLA installs absl's
    FailureSignalHandler there, which would answer SIGTERM with a native stack dump and exit 143.
    Our handlers go back in right after; absl keeps the crash signals (SIGSEGV, SIGABRT). On a
    host without TPU chips the TPU backend is not started at all (devices/tpu.py)."""
    run(module)
    _wrap_init_backend(module)


def _wrap_init_backend(module: ModuleType) -> None:
    from flux2klein_cli.core.devices.tpu import skips_tpu_backend

    init = getattr(module, "_init_backend", None)
    if init is None:  # a jax without this private hook: SIGTERM may print absl's dump, nothing worse
        return

    def init_backend(platform: str) -> object:
        try:
            chosen = getattr(getattr(module, "config", None), "jax_platforms", None)
            if skips_tpu_backend(platform, getattr(chosen, "value", None)):
                # jax registers TPU to fail quietly: the error is kept for jax.devices("tpu") to name
                raise RuntimeError("this host has no TPU chips (no Google PCI device)")
            return init(platform)
        finally:
            if threading.current_thread() is threading.main_thread():
                _reinstall()

    module._init_backend = init_backend  # type: ignore[attr-defined]


def _set_process_environment() -> None:
    """The one place the process environment is written: defaults that libraries read when they
    load (core/devices/runtime.py says which); a value already set wins. The collector's
    thresholds are set here too, before anything heavy is imported."""
    from flux2klein_cli.core.devices.runtime import process_defaults, tune_collector

    tune_collector()
    for name, value in process_defaults().items():
        os.environ.setdefault(name, value)


def _run() -> int | str | None:
    try:
        install_handlers()
        _set_process_environment()
        skip_ipython_probes()
        from flux2klein_cli.cli.app import main as app_main

        app_main()
    except SystemExit as e:
        # 130 from a KeyboardInterrupt that cli/output.py's user_errors caught has been announced there.
        if e.code == EXIT_INTERRUPTED:
            interrupted_line.announced_elsewhere()
        return e.code
    except (Interrupted, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    except Exception:
        if _state["signalled"]:  # a library turned the interrupt into its own error
            return EXIT_INTERRUPTED
        raise
    return 0


def main() -> None:
    try:
        try:
            code = _run()
        finally:
            _state["exiting"] = True  # the command is over: a signal from now on is noted, not raised
    except (Interrupted, KeyboardInterrupt):  # the signal came while _run was handling an exit
        code = EXIT_INTERRUPTED
    from flux2klein_cli.core.settings import test_exit_mark

    mark = test_exit_mark()
    if mark:
        atexit.register(_pause_for_test, mark)
    if _state["signalled"] or code == EXIT_INTERRUPTED:
        # Also when a library swallowed the exception and the command went on: the user asked to stop.
        interrupted_line.announce()
        code = EXIT_INTERRUPTED
    sys.exit(code)


def console() -> NoReturn:
    """The console script and `python -m flux2klein_cli`: `main`, then the end of the process as
    Python's own exit makes it (other threads joined, exit hooks run, streams flushed), without
    the interpreter's teardown after that: freeing jax's, flax's and XLA's objects one by one,
    which the OS does at once (figures in docs/benchmarks.md). In-process callers keep `main`, and
    their C library's malloc as they set it: the process entry sets its own (runtime.tune_allocator),
    except for a command that runs no program (runtime.ALLOCATOR_UNTUNED_COMMANDS)."""
    from flux2klein_cli.core.devices.runtime import ALLOCATOR_UNTUNED_COMMANDS, tune_allocator

    if _command(sys.argv[1:]) not in ALLOCATOR_UNTUNED_COMMANDS:
        tune_allocator()
    try:
        main()
    except SystemExit as e:
        _exit_now(e.code)
    raise AssertionError("main() returns only by SystemExit")


def _command(args: list[str]) -> str | None:
    """The command a command line names (the app takes no option with a value before it)."""
    return next((arg for arg in args if not arg.startswith("-")), None)


def _exit_now(code: object) -> NoReturn:
    shutdown, run_hooks = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_hooks is None:  # not the CPython this was written for: its own exit
        sys.exit(code)
    status = 0 if code is None else code if isinstance(code, int) else 1
    if not isinstance(code, int | None):  # what sys.exit does with a message
        print(code, file=sys.stderr)
    shutdown()
    run_hooks()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            status = status or 120  # Python's own status when its final flush fails
    os._exit(status)
