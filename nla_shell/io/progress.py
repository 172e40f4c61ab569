"""One progress display for every command: a tqdm bar with n/total, rate and ETA, on stderr.

The bar shows only where someone watches: on a terminal (not in CI logs, where a redrawn bar
is noise), whichever loggers a run writes to; a command may turn it off. Lines printed while a
bar is up go through `say`, so they never run into the bar.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

__all__ = ["close_bars", "progress_bar", "quiet_libraries", "say_line"]

_open_bars: weakref.WeakSet = weakref.WeakSet()
"""Bars made by progress_bar and not yet closed (close_bars closes them)."""


def progress_bar(*, total: int | None, desc: str, unit: str, initial: int = 0, enabled: bool = True) -> Any:
    """A tqdm bar over `total` units starting at `initial` (a resumed run); disabled off a terminal."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
        disable=not (enabled and sys.stderr.isatty()),
    )
    _open_bars.add(bar)
    return bar


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
