"""Rollout engines: the HF engine (the actor itself), vLLM, and the native fast engine."""

from nla_shell.engines.base import Rollout, RolloutEngine, RolloutRequest

__all__ = ["Rollout", "RolloutEngine", "RolloutRequest"]
