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


PHASE_FIXES = {
    "rollout": "lower vllm_gpu_mem or vllm_max_seqs (vLLM's KV cache), or shrink the trainer's side: an AR-LoRA "
               "ar_ckpt (nla sft --mode ar ar_lora=true) has no optimiser moments over the AR's backbone",
    "score": "lower critic_micro_batch",
    "update": "lower logp_micro_batch and ref_micro_batch, or set gradient_checkpointing=true",
    "sync": "lower vllm_gpu_mem",
}
"""What lowers each phase's memory, by TrainConfig key (docs/performance.md, "Scaling across Qwen3 sizes")."""


class OutOfGPUMemory(RuntimeError):
    """A phase of the step did not fit the GPU. The CLI prints one line, the phase and the keys that lower
    its memory, and exits 2; the run dir keeps its last checkpoint."""

    def __init__(self, phase: str, step: int, *, in_use_gib: float | None, total_gib: float | None,
                 checkpoint: Path | None = None) -> None:
        self.phase, self.step, self.in_use_gib, self.total_gib = phase, step, in_use_gib, total_gib
        memory = f" ({in_use_gib:.1f} of {total_gib:.1f} GiB in use)" if in_use_gib is not None else ""
        resume = (f"rerun to resume from {checkpoint}" if checkpoint is not None
                  else "no checkpoint yet")
        super().__init__(f"the GPU ran out of memory in the {phase} phase of step {step}{memory}: "
                         f"{PHASE_FIXES.get(phase, 'see docs/performance.md')}; {resume}")

    def with_checkpoint(self, checkpoint: Path | None) -> "OutOfGPUMemory":
        return OutOfGPUMemory(self.phase, self.step, in_use_gib=self.in_use_gib, total_gib=self.total_gib,
                              checkpoint=checkpoint)
