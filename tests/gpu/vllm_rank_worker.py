"""One rank of `test_vllm.py::test_per_rank_engines_under_torchrun` (run by torchrun, not by pytest).

argv: MODEL_DIR OUT_DIR. Every rank joins an NCCL group as `nla train` does, builds its own
VLLMRolloutEngine(per_rank=True) in sleep mode, pushes a LoRA actor of its own, and samples a
different number of prompts than the other rank (rank r: 4 * (r + 1) prompts x 2 samples, so a
per-step collective inside vLLM would hang the job). It writes OUT_DIR/rank{r}.json: the device
its vLLM model sits on, the mean |vLLM - HF| behaviour log-prob against its own actor, and the
sum over ranks of an all-reduce run after the engine is closed (the job's group must survive).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), *(str(p) for p in Path(__file__).resolve().parents[1:3])]

import fixtures  # noqa: E402
import test_vllm as case  # noqa: E402
from nla_shell.training import distributed  # noqa: E402


def main() -> None:
    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    rank = distributed.rank_info()
    device = torch.device("cuda", rank.local_rank)
    tokenizer = fixtures.tiny_tokenizer()
    with distributed.process_group(rank, device):
        actor = case._lora_actor(model_dir, seed=20 + rank.rank)  # on cuda:LOCAL_RANK (set by process_group)
        requests = case._requests(4 * (rank.rank + 1), seed=30 + rank.rank, vocab=len(tokenizer))
        engine = case._engine(model_dir, tokenizer, sleep_level=2, per_rank=True,
                              seed=distributed.rank_seed(0, rank.rank))
        try:
            where = engine.llm.apply_model(lambda model: str(next(model.parameters()).device))
            engine.sync_weights(actor)
            rollouts = engine.generate(requests, group_size=2, max_new_tokens=24)
        finally:
            engine.close()
        gap = (case._behavior(rollouts) - case._hf_logprobs(actor, rollouts, requests, inject=True)).abs()
        total = torch.tensor([float(rank.rank + 1)], device=device)
        dist.all_reduce(total)
        (out_dir / f"rank{rank.rank}.json").write_text(json.dumps({
            "vllm_device": where[0], "rollouts": len(rollouts), "gap_mean": float(gap.mean()),
            "allreduce_after_close": float(total.item()),
        }))


if __name__ == "__main__":
    main()
