"""The exception a signal-stopped run ends with, apart from the signal handling (nla_shell.training.preemption)
so that the CLI can catch it without importing torch for commands that never train."""

from __future__ import annotations

import signal
from pathlib import Path


class RunStopped(Exception):
    """A run stopped by a signal; the CLI prints `str(self)` and exits with `exit_code`."""

    def __init__(self, signum: int, *, steps_done: int, checkpoint: Path | None) -> None:
        verb = "interrupted" if signum == signal.SIGINT else "stopped"
        resume = (
            f"rerun the same command to resume from {checkpoint}"
            if checkpoint is not None
            else "no checkpoint yet: rerun the same command to start over"
        )
        super().__init__(f"{verb} at step {steps_done}; {resume}")
        self.signum, self.steps_done, self.checkpoint = signum, steps_done, checkpoint
        self.announced = False
        """True once rank 0 has printed the message (under torchrun, see StopSignals.stopped)."""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
