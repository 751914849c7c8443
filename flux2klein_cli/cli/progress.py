"""Progress bars on stderr (tqdm): denoising steps, programs, downloads. Core reports through
plain callbacks; this is their only rendering. Bars are drawn only for a person: never
under --json, never when stderr is not a terminal (a log file or a pipe gets no bar)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tqdm import tqdm


def _is_terminal() -> bool:
    return sys.stderr.isatty()


def wanted(as_json: bool) -> bool:
    """Whether to draw bars: a terminal on stderr and no --json."""
    return not as_json and _is_terminal()


class StepBar:
    """`on_step(done, total)` for the denoising loop (or any count: `unit`): a bar with count,
    rate and ETA, opened at the first report and closed at the last. `pause` and `resume` run
    around it (e.g. to stop a spinner that would draw over it)."""

    def __init__(self, desc: str = "denoising", pause: Callable[[], None] = lambda: None,
                 resume: Callable[[], None] = lambda: None, unit: str = "step"):
        self.desc, self.pause, self.resume, self.unit = desc, pause, resume, unit
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.pause()
            # Steps are seconds apart: draw each one (tqdm's default skips updates within 0.1 s).
            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=sys.stderr, dynamic_ncols=True,
                            leave=False, mininterval=0)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.resume()


class PhaseLines:
    """`on_phase(text)` where no spinner is drawn (--json): one plain line per phase on stderr,
    a phase said twice in a row printed once."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.last = say, None

    def __call__(self, phase: str) -> None:
        if phase != self.last:
            self.last = phase
            self.say(phase)


def hub_tqdm(enabled: bool) -> Any:
    """A tqdm class for huggingface_hub's downloads (its `tqdm_class`: files and bytes, on
    stderr), or one that draws nothing."""

    class HubBar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.pop("name", None)  # huggingface_hub names its bars; tqdm does not take it
            kwargs.update(file=sys.stderr, disable=not enabled)
            super().__init__(*args, **kwargs)

    return HubBar
