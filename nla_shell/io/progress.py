"""One progress display for every command: a tqdm bar with n/total, rate and ETA, on stderr.

The bar shows only where someone watches: on a terminal, whichever loggers a run writes to; a
command may turn it off. Elsewhere (a log file, CI, nohup, a scheduler) a redrawn bar is noise,
so the same progress comes as a plain line every PROGRESS_EVERY_S seconds instead. Lines printed
while a bar is up go through `say_line`, so they never run into the bar.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
import types
import weakref
from typing import Any, Iterator

__all__ = ["PROGRESS_EVERY_S", "ProgressLines", "close_bars", "format_duration", "progress_bar", "quiet_libraries",
           "say_line", "terminal_only_bars"]

PROGRESS_EVERY_S = 30.0
"""Seconds between two progress lines off a terminal."""

_open_bars: weakref.WeakSet = weakref.WeakSet()
"""Bars made by progress_bar and not yet closed (close_bars closes them)."""


def progress_bar(*, total: int | None, desc: str, unit: str, initial: int = 0, enabled: bool = True,
                 lines: bool = True) -> Any:
    """A tqdm bar over `total` units starting at `initial` (a resumed run) on a terminal; elsewhere, with `lines`,
    ProgressLines every PROGRESS_EVERY_S seconds (a command that logs lines of its own passes lines=False).
    `enabled=False`: neither."""
    from tqdm.auto import tqdm

    on_terminal = sys.stderr.isatty()
    if enabled and lines and not on_terminal:
        return ProgressLines(total=total, desc=desc, unit=unit, initial=initial, every_s=PROGRESS_EVERY_S)
    bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
               disable=not (enabled and on_terminal))
    _open_bars.add(bar)
    return bar


class ProgressLines:
    """Progress off a terminal: "[desc] n/total unit (p%), r unit/s, ETA 3m10s" on stdout at most every `every_s`
    seconds, as the work advances (`update(n)`, like a tqdm bar).

    The rate is this run's average since the display was made (tqdm's smoothed rate swings with each burst of
    work: a datagen batch, an eval chunk); a resumed run's `initial` units are not counted in it.
    """

    def __init__(self, *, total: int | None, desc: str, unit: str, initial: int, every_s: float) -> None:
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n = self.initial = initial
        self.start = self.last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            say_line(self.line(now))

    def line(self, now: float) -> str:
        """The progress as one line at time `now` (perf_counter seconds)."""
        rate = (self.n - self.initial) / max(now - self.start, 1e-9)
        shown = f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}"
        text = f"[{self.desc}] {self.n}"
        if self.total:
            eta = (self.total - self.n) / rate if rate > 0 else math.inf
            text += f"/{self.total} {self.unit} ({self.n / self.total:.0%}), {shown} {self.unit}/s, " \
                    f"ETA {format_duration(eta)}"
        else:
            text += f" {self.unit}, {shown} {self.unit}/s"
        return text

    def close(self) -> None:
        """Nothing to take down (the command prints its own last line)."""

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def format_duration(seconds: float) -> str:
    """"1h05m" or "3m10s"; "?" when unknown (no progress yet)."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


@contextlib.contextmanager
def terminal_only_bars(module: types.ModuleType) -> Iterator[None]:
    """Inside the block, the tqdm bars that `module` draws itself (it calls its module-level `tqdm`, past
    transformers' progress-bar switch: the GGUF loader) show on a terminal only, as nla's own do: in a log,
    their carriage-return redraws are noise."""
    from tqdm.auto import tqdm

    drawn = getattr(module, "tqdm", None)
    if drawn is None:  # a version that draws no bar of its own
        yield
        return
    module.tqdm = functools.partial(tqdm, disable=not sys.stderr.isatty())
    try:
        yield
    finally:
        module.tqdm = drawn


def close_bars() -> None:
    """Close every bar still open, before a command's last line: a bar left open by an error or a second
    Ctrl-C would otherwise be closed (and redrawn) by the garbage collector, under that line."""
    for bar in list(_open_bars):
        bar.close()
    _open_bars.clear()


def say_line(message: str, *, error: bool = False) -> None:
    """Print one line (stdout, or stderr when `error`) above any progress bar that is showing."""
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr if error else sys.stdout)
    (sys.stderr if error else sys.stdout).flush()


def quiet_libraries() -> None:
    """Silence what libraries print on their own: transformers' "Loading weights" bar, its advisory
    log lines, and the FutureWarnings of libraries the user did not call (nla's own output stays)."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # peft asks transformers for `is_gradient_checkpointing`, which warns on every model load.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
