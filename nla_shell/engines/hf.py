"""HF `generate` on the actor itself: the simplest engine, and the behaviour-policy baseline.

The engine samples with the trainer's own module (adapter on), so it needs no weight sync
and its behaviour log-probs are the trainer's up to padding-side numerics.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nla_shell import families
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.models import Injector, eos_token_ids, inner_lm
from nla_shell.models.common import sharded_over_ranks


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ([n, S] ids, [n, S] attention mask), padded on the left for generation."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def eos_lengths(generated: torch.Tensor, eos_ids: Sequence[int]) -> list[int]:
    """Per row of generated [N, T]: its length up to and including its first EOS, any of eos_ids
    (T when none). One device pass and one host copy for the whole batch."""
    hits = torch.isin(generated, torch.as_tensor(list(eos_ids), device=generated.device))
    first = hits.int().argmax(dim=1)  # the first hit (argmax returns the first maximum)
    return torch.where(hits.any(dim=1), first + 1, generated.shape[1]).tolist()


class HFRolloutEngine:
    """Batched `generate` with the actor: left padding, injection in prefill, temperature 1 (or greedy).

    Sampling draws from torch's global RNG (HF `generate` takes no generator), so a seeded
    run is reproducible and resume restores that RNG. A row ends at any id of the actor's
    generation_config eos list (plus the tokenizer's eos), as the reference's `generate` does.
    """

    shares_actor_weights = True

    def __init__(self, actor: torch.nn.Module, injector: Injector, tokenizer, *, max_batch: int = 256,
                 greedy: bool = False) -> None:
        families.require_engine(actor, "hf")
        self.actor, self.injector, self.tokenizer = actor, injector, tokenizer
        self.max_batch = max_batch
        self.eos_ids = eos_token_ids(inner_lm(actor).generation_config, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        # Spelled out so the checkpoint's generation_config cannot slip in top-k/top-p/penalties:
        # the importance ratio assumes samples from the plain softmax.
        self.base_generation = dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=None,
            typical_p=1.0,
            repetition_penalty=1.0,
            eos_token_id=list(self.eos_ids),
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        self.lockstep = sharded_over_ranks(actor)
        """Every rank's generate runs until the last rank's ends (HF's synced_gpus): each forward of an FSDP2-sharded
        actor (sharding=fsdp2) gathers its blocks from every rank."""
        self.greedy = greedy
        """Argmax decoding for reading explanations (`nla explain --greedy`, settable between calls); never
        for training, whose importance ratios assume samples from the softmax."""

    @property
    def device(self) -> torch.device:
        return next(self.actor.parameters()).device

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        group_size: int,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
    ) -> list[Rollout]:
        flat = [(i, req) for i, req in enumerate(requests) for _ in range(group_size)]
        rollouts: list[Rollout] = []
        for start in range(0, len(flat), self.max_batch):
            rollouts += self._generate_chunk(flat[start : start + self.max_batch], max_new_tokens)
        return rollouts

    @torch.no_grad()
    def _generate_chunk(self, flat: list[tuple[int, RolloutRequest]], max_new_tokens: int) -> list[Rollout]:
        from transformers import GenerationConfig

        ids, mask = left_pad([req.prompt_ids for _, req in flat], self.pad_id, self.device)
        vectors = torch.stack([req.activation for _, req in flat]).to(self.device, torch.float32)
        lm = inner_lm(self.actor)
        was_training = lm.training
        lm.eval()
        try:
            with self.injector.inject(ids, vectors):
                out = lm.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=GenerationConfig(**self._generation(), max_new_tokens=max_new_tokens),
                    synced_gpus=self.lockstep,
                )
        finally:
            lm.train(was_training)
        generated = out.sequences[:, ids.shape[1] :]
        # [n, T_gen] log-probs of the sampled tokens under the raw (unprocessed) logits.
        step_logits = torch.stack(out.logits, dim=1).float()
        logp = torch.log_softmax(step_logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        rollouts = []
        for row, ((prompt_index, req), n) in enumerate(zip(flat, eos_lengths(generated, self.eos_ids), strict=True)):
            gen_ids = generated[row, :n].cpu()
            rollouts.append(Rollout.from_ids(req.prompt_ids, gen_ids, logp[row, :n].cpu(), tokenizer=self.tokenizer,
                                             prompt_index=prompt_index))
        return rollouts

    def _generation(self) -> dict:
        """The generate() settings of this call: the plain softmax, or argmax when greedy."""
        if not self.greedy:
            return self.base_generation
        return {**self.base_generation, **dict(do_sample=False, temperature=None, top_k=None, top_p=None,
                                               typical_p=None)}

    def sync_weights(self, actor: torch.nn.Module) -> float:
        return 0.0

    def close(self) -> None:
        pass
