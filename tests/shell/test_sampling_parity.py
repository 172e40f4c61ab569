"""Do the hf and native engines sample exactly the trainer's policy, before and after updates? (issue #13)

A log-prob check (behaviour == trainer log-prob of the sampled tokens) passes a biased sampler:
it only says the engine scored its tokens right. These tests look at the draws themselves:
- every generated token's randomised PIT under the trainer's conditional softmax must be
  uniform (`parity.randomized_pit`, chi-square at fixed seeds), which a temperature of 0.9
  already fails;
- after real optimizer steps, native's behaviour log-probs still equal the trainer's (the
  policy moved by far more than the tolerance, so stale weights would show);
- for the same random draws, native's rollouts equal HF generate's field by field.
The CUDA-graph decode path is checked the same way on a GPU (tests/gpu/test_learning_parity.py).
"""

from __future__ import annotations

import pytest
import torch

import nla_core
import parity
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.models import eos_token_ids, inner_lm
from nla_shell.training.update import LossOptions, policy_update

CPU = torch.device("cpu")
ENGINES = {
    "hf": lambda actor, injector, tokenizer: HFRolloutEngine(actor, injector, tokenizer),
    "native": lambda actor, injector, tokenizer: NativeRolloutEngine(actor, injector, tokenizer),
    "native_merged": lambda actor, injector, tokenizer: NativeRolloutEngine(actor, injector, tokenizer, merge_lora=True),
}


@pytest.fixture
def trained_setup(nla_run_inputs):
    """The trainer tests' AV (it writes `<explanation>...</explanation>` and EOS: a peaked policy
    with real lengths) under a fresh LoRA made non-zero, its injector, tokenizer and 3 requests."""
    av, _, parquet = nla_run_inputs
    torch.manual_seed(0)
    actor, injector, tokenizer, requests = parity.policy_and_requests(av, parquet, device=CPU)
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return actor, injector, tokenizer, requests


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
    logits, tokens = parity.conditional_logits(actor, injector, rollouts, requests, pad_id=tokenizer.pad_token_id)
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
def test_native_stays_on_policy_through_optimizer_steps(toy_sft, toy_datasets, merge_lora):
    """As in the parity runs: the SFT adapter continued (a frozen "reference" copy beside it, which
    the KL forward switches to and back each step). Three real GRPO steps at a large lr: before
    each, native's behaviour log-probs equal the updated trainer's, while the first batch's
    tokens moved by orders of magnitude more than the tolerance."""
    av, _ = toy_sft
    torch.manual_seed(0)
    actor, injector, tokenizer, requests = parity.policy_and_requests(av, toy_datasets / "rl.parquet", device=CPU)
    assert set(actor.peft_config) == {"default", "reference"}
    engine = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora)
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=3e-2)
    torch.manual_seed(3)
    batches = []
    for _ in range(3):
        rollouts = engine.generate(requests, group_size=4, max_new_tokens=10)
        golds = torch.stack([requests[r.prompt_index].activation for r in rollouts])
        stats = policy_update(actor, injector, optimizer, rollouts, torch.randn(len(rollouts)), golds,
                              loss=LossOptions(kl_beta=0.04), micro_batch=6, max_grad_norm=1e9,
                              pad_id=tokenizer.pad_token_id)
        assert stats.stepped and stats.logp_diff_max <= 1e-4, stats
        batches.append(rollouts)
    logits, tokens = parity.conditional_logits(actor, injector, batches[0], requests, pad_id=tokenizer.pad_token_id)
    now = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    then = torch.cat([r.behavior_logp for r in batches[0]])
    assert float((now - then).abs().max()) > 0.1  # the policy did move


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
        assert len({r.response_len for r in native}) > 1  # rows of several lengths
