"""Do the hf and native engines sample exactly the trainer's policy, before and after updates? (issue #13)

A log-prob check (behaviour == trainer log-prob of the sampled tokens) passes a biased sampler:
it only says the engine scored its tokens right. These tests look at the draws themselves:
- every generated token's randomised PIT under the trainer's conditional softmax must be
  uniform (`parity.randomized_pit`, chi-square at fixed seeds), which a temperature of 0.9
  already fails;
- after real optimizer steps, native's behaviour log-probs still equal the trainer's (the
  policy moved by far more than the tolerance, so stale weights would show);
- for the same random draws, native's rollouts equal HF generate's field by field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import nla_core
import parity
from nla_shell.engines.base import RolloutRequest
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.models import Injector, eos_token_ids, inner_lm, load_actor
from nla_shell.training.update import LossOptions, policy_update, response_batch

CPU = torch.device("cpu")
ENGINES = {
    "hf": lambda actor, injector, tokenizer: HFRolloutEngine(actor, injector, tokenizer),
    "native": lambda actor, injector, tokenizer: NativeRolloutEngine(actor, injector, tokenizer),
    "native_merged": lambda actor, injector, tokenizer: NativeRolloutEngine(actor, injector, tokenizer, merge_lora=True),
}


@pytest.fixture
def trained_setup(nla_run_inputs):
    """The trainer tests' AV (it writes `<explanation>...</explanation>` and EOS: a peaked policy
    with real lengths) under a non-zero LoRA, its injector, tokenizer and 3 requests of 2 prompt lengths."""
    av, _, parquet = nla_run_inputs
    tokenizer = AutoTokenizer.from_pretrained(av)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    torch.manual_seed(0)
    actor = load_actor(av, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None, dtype=torch.float32, device=CPU)
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    injector = Injector(actor, marker_id=cfg.injection_token_id, left_id=cfg.injection_left_neighbor_id,
                        right_id=cfg.injection_right_neighbor_id)
    rows = load_rows(parquet, cfg, max_rows=3)
    prompts = [build_prompt_ids(r.prompt, cfg, tokenizer) for r in rows]
    prompts[1] = tokenizer.encode("The cat sat on the mat. ", add_special_tokens=False) + prompts[1]
    return actor, injector, tokenizer, [RolloutRequest(tuple(p), r.activation) for p, r in zip(prompts, rows)]


def _conditional_logits(actor, injector, tokenizer, requests, rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's full next-token logits [N_tokens, V] at every generated position, and the tokens [N_tokens]."""
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=CPU)
    vectors = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    with torch.no_grad(), injector.inject(batch.input_ids, vectors):
        logits = inner_lm(actor)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    at_positions = logits.gather(1, batch.positions[..., None].expand(-1, -1, logits.shape[-1]))
    return at_positions[batch.mask], batch.targets[batch.mask]


def test_the_pit_test_passes_exact_samples_and_fails_biased_ones():
    """The statistic's power, on a peaked synthetic policy: tempered and top-k samplers fail it."""
    logits = 4 * torch.randn(3000, 200, generator=torch.Generator().manual_seed(0))
    jitter = torch.Generator().manual_seed(1)

    def verdict(sampling_logits: torch.Tensor) -> parity.UniformityTest:
        tokens = nla_core.sample_tokens(sampling_logits, generator=torch.Generator().manual_seed(2)).tokens
        return parity.uniformity_chi_square(parity.randomized_pit(logits, tokens, generator=jitter))

    assert verdict(logits).passed
    assert not verdict(logits / 0.9).passed and not verdict(logits / 1.1).passed
    top_k = logits.masked_fill(logits < logits.topk(20, dim=-1).values[:, -1:], float("-inf"))
    assert not verdict(top_k).passed


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_every_generated_token_is_a_draw_from_the_trainers_softmax(trained_setup, engine_name):
    actor, injector, tokenizer, requests = trained_setup
    # Qwen3's sampling defaults in the checkpoint's generation_config must not reach the sampler.
    config = inner_lm(actor).generation_config
    config.temperature, config.top_k, config.top_p = 0.6, 20, 0.95
    torch.manual_seed(5)
    max_new_tokens = 12
    rollouts = ENGINES[engine_name](actor, injector, tokenizer).generate(requests, group_size=64,
                                                                        max_new_tokens=max_new_tokens)
    logits, tokens = _conditional_logits(actor, injector, tokenizer, requests, rollouts)
    pit = parity.randomized_pit(logits, tokens, generator=torch.Generator().manual_seed(0))
    exact = parity.uniformity_chi_square(pit)
    assert exact.n > 1000 and exact.passed, exact
    # The same conditionals sampled at temperature 0.9 fail: the test could see a small bias here.
    tempered = nla_core.sample_tokens(logits / 0.9, generator=torch.Generator().manual_seed(1)).tokens
    assert not parity.uniformity_chi_square(parity.randomized_pit(logits, tempered, generator=torch.Generator().manual_seed(0))).passed
    # Lengths: a rollout ends at its first EOS or runs to max_new_tokens, and some do each.
    eos = set(eos_token_ids(config, tokenizer))
    ended = [bool(r.full_ids[-1].item() in eos) for r in rollouts]
    for r, at_eos in zip(rollouts, ended):
        generated = r.full_ids[r.prompt_len :].tolist()
        assert not eos.intersection(generated[:-1]) and (at_eos or len(generated) == max_new_tokens)
    assert 0 < sum(ended) < len(rollouts)


@pytest.mark.parametrize("merge_lora", [False, True])
def test_native_behaviour_logprobs_stay_the_trainers_through_optimizer_steps(trained_setup, merge_lora):
    """Three real GRPO steps at a large lr: before each, native's behaviour log-probs equal the
    (updated) trainer's, while the same tokens' log-probs moved by orders of magnitude more."""
    actor, injector, tokenizer, requests = trained_setup
    engine = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora)
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=3e-2)
    torch.manual_seed(3)
    first = None
    for _ in range(3):
        rollouts = engine.generate(requests, group_size=4, max_new_tokens=10)
        first = first or rollouts
        advantages = torch.randn(len(rollouts))
        golds = torch.stack([requests[r.prompt_index].activation for r in rollouts])
        stats = policy_update(actor, injector, optimizer, rollouts, advantages, golds, loss=LossOptions(kl_beta=0.0),
                              micro_batch=6, max_grad_norm=1e9, pad_id=tokenizer.pad_token_id)
        assert stats.stepped and stats.logp_diff_max <= 1e-4, stats
    batch = response_batch(first, pad_id=tokenizer.pad_token_id, device=CPU)
    vectors = torch.stack([requests[r.prompt_index].activation for r in first])
    with torch.no_grad(), injector.inject(batch.input_ids, vectors):
        logits = inner_lm(actor)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    now = torch.log_softmax(logits.float(), -1).gather(1, batch.positions[..., None].expand(-1, -1, logits.shape[-1]))
    now = now.gather(-1, batch.targets[..., None]).squeeze(-1)
    assert float((now - batch.behavior_logp)[batch.mask].abs().max()) > 0.1  # the policy did move


def test_native_rollouts_equal_hf_generates_for_the_same_draws(trained_setup):
    """On CPU both engines draw Exp(1) noise of shape [rows, V] per step from torch's global RNG
    and take argmax(p / noise) (torch.multinomial's arithmetic), so with one seed the tokens
    agree, across chunks, prompt padding and native's prompt-width buckets, and so must every field."""
    actor, injector, tokenizer, requests = trained_setup
    for max_batch in (256, 4):  # one chunk; chunks of 2 prompts x 2 (native) and 4 rows (hf)
        torch.manual_seed(9)
        native = NativeRolloutEngine(actor, injector, tokenizer, max_batch=max_batch).generate(
            requests, group_size=2, max_new_tokens=12)
        torch.manual_seed(9)
        hf = HFRolloutEngine(actor, injector, tokenizer, max_batch=max_batch).generate(requests, group_size=2,
                                                                                      max_new_tokens=12)
        assert len(native) == len(hf) == 6
        for a, b in zip(native, hf):
            assert torch.equal(a.full_ids, b.full_ids) and a.full_ids.dtype == b.full_ids.dtype
            assert (a.prompt_len, a.prompt_index, a.text) == (b.prompt_len, b.prompt_index, b.text)
            assert a.behavior_logp.shape == b.behavior_logp.shape and a.behavior_logp.dtype == b.behavior_logp.dtype
            torch.testing.assert_close(a.behavior_logp, b.behavior_logp, rtol=0, atol=1e-5)
        assert len({r.full_ids.numel() - r.prompt_len for r in native}) > 1  # rows of several lengths
