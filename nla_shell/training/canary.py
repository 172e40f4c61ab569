"""The steering canary's verdict: a run whose rollouts stop being steered stops (vllm_canary=stop)."""

from __future__ import annotations

from nla_shell.training.stopped import RunSpoiledError


CANARY_PATIENCE = 3
"""Failed canaries in a row that stop a run under vllm_canary=stop."""


class CanaryWatch:
    """The per-step verdict on the steering canary: a failed reading (0: the vector changed nothing; NaN: no
    reading) warns, and CANARY_PATIENCE of them in a row stop the run when `stop`."""

    def __init__(self, *, stop: bool, patience: int = CANARY_PATIENCE) -> None:
        self.stop, self.patience = stop, patience
        self.failed_steps: list[int] = []
        """Steps of the current run of failed readings."""

    def check(self, step: int, reading: float) -> str | None:
        """A warning line when `reading` failed (None when it passed); raises RunSpoiledError at the
        patience-th failure in a row, when stopping."""
        if reading > 0:  # False for 0 and for NaN
            self.failed_steps = []
            return None
        self.failed_steps.append(step)
        steps = ", ".join(map(str, self.failed_steps))
        if self.stop and len(self.failed_steps) >= self.patience:
            raise RunSpoiledError(
                f"steering canary failed at steps {steps} (read {reading}): vLLM's rollouts are not steered, the "
                "injected vector does not reach the model (is vllm==0.24.0 with nla's plugin installed?); stopped "
                f"before step {step}'s update (a checkpoint after step {self.failed_steps[0]} holds updates from "
                "unsteered rollouts); vllm_canary=warn goes on regardless"
            )
        return (f"[warn] step {step}: steering canary read {reading}: the engine's rollouts are unsteered "
                f"({len(self.failed_steps)} step(s) in a row"
                + (f"; the run stops at {self.patience})" if self.stop else "; vllm_canary=warn keeps going)"))
