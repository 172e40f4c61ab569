"""The exceptions a stopped run ends with, apart from the code that raises them (nla_shell.training.preemption,
the steering canary) so that the CLI can catch them without importing torch for commands that never train."""

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


class RunSpoiledError(RuntimeError):
    """Going on would spoil the run silently (e.g. rollouts no longer steered); the CLI prints the message as
    one line and exits 2."""
