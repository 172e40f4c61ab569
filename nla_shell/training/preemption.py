"""Graceful stops: SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) end a run cleanly.

While `StopSignals` is active, the first SIGTERM or SIGINT only sets a flag; the run
finishes the step in progress, and at the next step boundary (`should_stop`, which all
torchrun ranks call together and agree on) saves a checkpoint and raises `RunStopped`.
A second signal abandons the step in progress at once: nothing of it is saved, and the
newest checkpoint stays the resume point. Either way the command prints one line,

    stopped at step N; rerun the same command to resume from save_dir/step_M

("interrupted at ..." for Ctrl-C) and exits with 128 + the signal number (143 for
SIGTERM, 130 for SIGINT), as a process killed by that signal would. N counts finished
steps, like the step_NNNNNN dir names, so N is also the step the rerun starts at when
M == N.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType

from nla_shell.training import checkpoint as ckpt
from nla_shell.training import distributed
from nla_shell.training.stopped import RunStopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _AbandonStep(BaseException):
    """Raised by a second signal inside the step in progress (a BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way swallows it)."""


def boundary_save_due(steps_done: int, *, start_step: int, save_every: int, save_on_signal: bool) -> bool:
    """Whether a run stopped after `steps_done` steps needs a checkpoint of its own: save_on_signal
    is on, this run finished a step, and the periodic save did not just take that step."""
    return save_on_signal and steps_done > start_step and steps_done % save_every != 0


class StopSignals:
    """Context manager: SIGTERM/SIGINT handlers for one run (only in the main thread).

    `save_dir` is where the newest checkpoint is looked up for the message when a second
    signal abandons a step. The previous handlers come back on exit.
    """

    def __init__(self, save_dir: str | os.PathLike[str]) -> None:
        self.save_dir = Path(save_dir)
        self.signum = 0
        """The first signal received; 0 while none."""
        self.steps_done = 0
        """Steps finished as of the last `should_stop` call."""
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be put back
                signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if isinstance(exc, _AbandonStep):
            raise RunStopped(
                self.signum, steps_done=self.steps_done, checkpoint=ckpt.latest_checkpoint(self.save_dir)
            ) from None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            raise _AbandonStep()
        self.signum = signum
        # os.write, not print: a handler may run in the middle of another print to stderr.
        os.write(2, (f"[signal] {signal.Signals(signum).name}: finishing the current step, then saving; "
                     "send it again to stop at once\n").encode())

    def should_stop(self, steps_done: int) -> bool:
        """At a step boundary: has any rank been signalled? Every rank must call this together."""
        self.steps_done = steps_done
        (agreed,) = distributed.all_reduce_max([self.signum])
        self.signum = int(agreed)
        return self.signum != 0

    def stopped(self, checkpoint: Path | None, *, command: str) -> RunStopped:
        """The exception that ends the run, once the boundary's checkpoint (if any) is saved.

        Under torchrun rank 0 prints the message and every rank waits for it here: torchrun
        stops the remaining ranks as soon as one exits, which must not cut rank 0's save
        or message short.
        """
        stopped = RunStopped(self.signum, steps_done=self.steps_done, checkpoint=checkpoint)
        if distributed.active():
            if distributed.is_main():
                print(f"nla {command}: {stopped}", file=sys.stderr, flush=True)
            distributed.barrier()
            stopped.announced = True
        return stopped
