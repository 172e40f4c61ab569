"""The imperative shell of nla: models, rollout engines, data, logging, checkpoints, CLI."""
