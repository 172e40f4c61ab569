"""The fast GRPO step (issue 12) computes today's numbers: the shared-prompt update against
today's full-sequence arithmetic, the fused score + critic pass against scoring then
`critic_step`, and an AR whose trainable parameters all reach its prediction."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import fixtures
from nla_core import grpo_loss
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.models import ARModel, reference_policy, response_logprobs, trainable_parameters
from nla_shell.training import prefix
from nla_shell.training.scoring import critic_step, score_and_train_critic, score_explanations
from nla_shell.training.update import LossOptions, policy_update, response_batch


@pytest.fixture(scope="module")
def ragged_batch(nla_cache_dir: Path, tiny_tokenizer):
    """3 groups x 3 samples with prompts of 3 lengths and responses of 1..7 tokens, a non-zero LoRA."""
    from transformers import AutoTokenizer

    av, _, parquet = fixtures.build_trainer_inputs(nla_cache_dir / "trainer_inputs", tiny_tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(av)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    actor, injector = fixtures.lora_actor(av, cfg)
    rows = load_rows(parquet, cfg, max_rows=3)
    # Prompts of 3 lengths: 0, 2 and 5 extra leading tokens (the marker stays well-formed).
    requests = []
    for extra, row in zip((0, 2, 5), rows):
        ids = build_prompt_ids(row.prompt, cfg, tokenizer)
        requests.append(RolloutRequest(tuple(ids[:1] * extra + ids), row.activation))
    sampled = HFRolloutEngine(actor, injector, tokenizer).generate(requests, group_size=3, max_new_tokens=8)
    # Responses of 1..7 tokens (padding inside every micro-batch); behaviour log-probs moved
    # off the trainer's by up to +-0.3, so ratios leave the clip range and logp_diff is not 0.
    rollouts = []
    for i, r in enumerate(sampled):
        behavior = r.behavior_logp[: 1 + i % 7]
        rollouts.append(Rollout(r.full_ids[: r.prompt_len + behavior.numel()], r.prompt_len,
                                behavior + 0.3 * torch.sin(torch.arange(behavior.numel()) + i), r.text, r.prompt_index))
    acts = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    return actor, injector, tokenizer, rollouts, acts


def _todays_update(actor, injector, rollouts, advantages, acts, options: LossOptions, pad_id: int):
    """Today's arithmetic as one full batch: full sequences, reference forward, grpo_loss, backward.

    Returns (loss, kl_mean, clip_frac, logp_diff_mean, grad); policy_update's micro-batches sum to it
    (tests/shell/test_train.py::test_micro_batched_gradient_equals_full_batch_gradient).
    """
    actor.zero_grad(set_to_none=True)
    batch = response_batch(rollouts, pad_id=pad_id, device=torch.device("cpu"))
    with injector.inject(batch.input_ids, acts):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
        with torch.no_grad(), reference_policy(actor):
            ref = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    decoupled = options.tis not in ("ratio_cap", None)
    out = grpo_loss(logp, logp.detach() if decoupled else batch.behavior_logp, advantages, batch.mask, ref_logp=ref,
                    behavior_logp=batch.behavior_logp if decoupled else None, clip_eps=options.clip_eps,
                    kl_beta=options.kl_beta, tis=options.tis, tis_cap=options.tis_cap,
                    aggregation=options.aggregation, denominator=len(rollouts) if options.aggregation ==
                    "sequence_mean" else int(batch.mask.sum()))
    out.loss.backward()
    diff = torch.where(batch.mask, (batch.behavior_logp - logp.detach()).abs(), torch.zeros_like(logp))
    grad = torch.cat([p.grad.flatten() for p in trainable_parameters(actor)])
    actor.zero_grad(set_to_none=True)
    stats = (float(out.loss.detach()), float(out.kl_mean), float(out.clip_frac), float(diff.sum() / batch.mask.sum()))
    return *stats, grad


@pytest.mark.parametrize("options", [LossOptions(kl_beta=0.1),
                                     LossOptions(kl_beta=0.1, aggregation="token_mean", tis="token_truncate")],
                         ids=["sequence_mean-ratio_cap", "token_mean-token_truncate"])
def test_shared_prefix_update_equals_todays_full_sequence_update(ragged_batch, options):
    actor, injector, tokenizer, rollouts, acts = ragged_batch
    advantages = torch.linspace(-1.5, 1.5, len(rollouts))
    pad = tokenizer.pad_token_id
    loss, kl, clip, diff, grad = _todays_update(actor, injector, rollouts, advantages, acts, options, pad)
    assert grad.abs().sum() > 0 and kl > 0 and diff > 0.05
    assert clip > 0 or options.tis != "ratio_cap"  # decoupled TIS takes ratios against the trainer: 1
    optimizer = torch.optim.SGD(trainable_parameters(actor), lr=0.0)
    # micro-batch 2 splits groups (each piece computes its prompt, or the block's prompt forward
    # serves several), 4 mixes prompt lengths; prompt blocks of 1 and 2 micro-batches defer each
    # prompt backward past 1 and 2 response backwards.
    for share_prefix, micro_batch, block in ((True, 2, 1), (True, 2, 2), (True, 2, 4), (True, 4, 4), (False, 4, 4)):
        stats = policy_update(actor, injector, optimizer, rollouts, advantages, acts, loss=options,
                              micro_batch=micro_batch, reference_micro_batch=3, max_grad_norm=1e9, pad_id=pad,
                              share_prefix=share_prefix, step_optimizer=False, prompt_block=block)
        new_grad = torch.cat([p.grad.flatten() for p in trainable_parameters(actor)])
        torch.testing.assert_close(new_grad, grad, rtol=1e-4, atol=1e-7)
        assert stats.loss == pytest.approx(loss, rel=1e-4, abs=1e-8)
        assert stats.kl_mean == pytest.approx(kl, rel=1e-4)
        assert stats.clip_frac == pytest.approx(clip, rel=1e-6)
        assert stats.logp_diff_mean == pytest.approx(diff, rel=1e-5)
        assert stats.grad_norm == pytest.approx(float(grad.norm()), rel=1e-4)
        actor.zero_grad(set_to_none=True)


def test_shared_prefix_logprobs_equal_the_full_forward_and_the_injection_reaches_them(ragged_batch):
    actor, injector, tokenizer, rollouts, acts = ragged_batch
    rows = list(range(len(rollouts)))
    batch = prefix.prefix_batch(rollouts, rows, injector, pad_id=tokenizer.pad_token_id)
    assert batch.prompt_ids.shape[0] == 3 and len(set(batch.prompt_lengths.tolist())) == 3
    # Only padded prompts are run with a mask (reading an unpadded one costs transformers a sync).
    one_group = [i for i, r in enumerate(rollouts) if r.prompt_index == rollouts[0].prompt_index]
    assert batch.prompts_padded and not prefix.prefix_batch(rollouts, one_group, injector, pad_id=0).prompts_padded
    full = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad():
        shared = prefix.prefix_logprobs(actor, injector, batch, acts[batch.prompt_sources])
        with injector.inject(full.input_ids, acts):
            expected = response_logprobs(actor, full.input_ids, full.attention_mask, full.positions, full.targets)
        other = prefix.prefix_logprobs(actor, injector, batch, acts[batch.prompt_sources].flip(0))
    torch.testing.assert_close(shared[batch.mask], expected[full.mask], rtol=1e-5, atol=1e-5)
    assert float((other - shared)[batch.mask].abs().max()) > 1e-3


def test_split_batches_keep_every_prompt_and_trim_their_responses(ragged_batch):
    _, injector, tokenizer, rollouts, _ = ragged_batch
    order = prefix.plan_micro_batches(rollouts, 3)
    rows = [i for part in order for i in part]
    whole = prefix.prefix_batch(rollouts, rows, injector, pad_id=tokenizer.pad_token_id)
    parts = whole.split([len(part) for part in order])
    assert [p.rows.tolist() for p in parts] == order
    for part in parts:
        assert part.prompt_ids is whole.prompt_ids  # owner still indexes the block's prompts
        lengths = [rollouts[i].response_len for i in part.rows.tolist()]
        assert part.response_ids.shape[1] == max(lengths) and part.mask.sum(-1).tolist() == lengths
        torch.testing.assert_close(part.owner, whole.owner[[rows.index(i) for i in part.rows.tolist()]])
    with pytest.raises(ValueError, match="do not add up"):
        whole.split([1])


def test_a_prompt_block_below_one_is_refused(ragged_batch):
    actor, injector, tokenizer, rollouts, acts = ragged_batch
    optimizer = torch.optim.SGD(trainable_parameters(actor), lr=0.0)
    with pytest.raises(ValueError, match="prompt_block"):
        policy_update(actor, injector, optimizer, rollouts, torch.zeros(len(rollouts)), acts, loss=LossOptions(),
                      micro_batch=2, max_grad_norm=1.0, pad_id=tokenizer.pad_token_id, prompt_block=0)


def test_a_group_with_two_prompts_is_refused(ragged_batch):
    actor, injector, tokenizer, rollouts, _ = ragged_batch
    impostor = Rollout(rollouts[3].full_ids, rollouts[3].prompt_len, rollouts[3].behavior_logp, "", prompt_index=0)
    with pytest.raises(ValueError, match="group 0 hold different prompts"):
        prefix.prefix_batch([rollouts[0], impostor], [0, 1], injector, pad_id=tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def tiny_ar(nla_cache_dir: Path, tiny_tokenizer):
    from transformers import AutoTokenizer

    av, ar_dir, _ = fixtures.build_trainer_inputs(nla_cache_dir / "trainer_inputs", tiny_tokenizer)
    ar = ARModel.from_pretrained(ar_dir, mse_scale=8.0)
    ar.eval()
    return ar, AutoTokenizer.from_pretrained(av)  # the trainer's tokenizer (the AV's)


@pytest.mark.parametrize("broken_gold", [False, True], ids=["all-finite", "one-nan-gold"])
def test_one_ar_pass_scores_and_steps_like_scoring_then_critic_step(tiny_ar, broken_gold):
    ar, tokenizer = tiny_ar
    explanations = ["a cat on a mat", None, "the dog ran after a red ball", "x " * 200, "a", "animals and doors"]
    golds = torch.randn(len(explanations), ar.lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    if broken_gold:  # its MSE is NaN: not valid, left out of the critic's loss
        golds[2] = float("nan")
    kwargs = dict(template="Text: {explanation}", mse_scale=8.0, reward_kind="neg_log", max_tokens=40)
    today, fused = copy.deepcopy(ar).requires_grad_(True), copy.deepcopy(ar).requires_grad_(True)

    def adam(model):
        return torch.optim.AdamW(trainable_parameters(model), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)

    scores = score_explanations(today, tokenizer, explanations, golds, **kwargs, micro_batch=2)
    kept = [i for i, ids in enumerate(scores.ar_inputs) if ids is not None]
    loss, norm = critic_step(today, adam(today), [scores.ar_inputs[i] for i in kept], golds[kept],
                             pad_id=tokenizer.pad_token_id, micro_batch=2, max_grad_norm=1.0)
    new_scores, new_loss, new_norm, _ = score_and_train_critic(fused, adam(fused), tokenizer, explanations, golds,
                                                               **kwargs, micro_batch=2, max_grad_norm=1.0)
    assert scores.valid.tolist() == new_scores.valid.tolist() == [True, False, not broken_gold, False, True, True]
    assert scores.ar_inputs == new_scores.ar_inputs
    torch.testing.assert_close(new_scores.reward, scores.reward, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_scores.mse, scores.mse, rtol=1e-5, atol=1e-7, equal_nan=True)
    assert new_loss == pytest.approx(loss, rel=1e-5) and new_norm == pytest.approx(norm, rel=1e-4)
    # To 1 % of one AdamW step (lr 1e-3): where a gradient is near Adam's eps, the float32 rounding of one pass
    # against two moves a weight by more than 1e-6 (1.6e-6 on one weight of 4096 on an AMD EPYC box, every run);
    # the loss and grad norm above pin the gradient itself.
    for a, b in zip(trainable_parameters(today), trainable_parameters(fused)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(trainable_parameters(today), trainable_parameters(ar)))


@pytest.mark.parametrize("tied", [False, True])
def test_every_trainable_ar_parameter_reaches_the_prediction(tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied)
    torch.manual_seed(0)
    ar = ARModel(Qwen3ForCausalLM(config), torch.nn.Linear(16, 16, bias=False), mse_scale=4.0)
    ar.requires_grad_(False).requires_grad_(True)  # a re-enable must not revive the unreachable ones
    assert not any(p.requires_grad for p in ar._final_norm.parameters())
    assert ar.lm.lm_head.weight.requires_grad == tied  # tied, it is the embedding, which is trained
    pred = ar(torch.randint(0, 32, (2, 5)), torch.ones(2, 5, dtype=torch.long))
    pred.square().sum().backward()
    for name, p in ar.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_unpadded_prompts_attend_lower_right_causal_without_a_mask_and_the_numbers_stay(ragged_batch, monkeypatch):
    """A micro-batch whose prompts are unpadded runs its responses unmasked, lower-right causal on the grouped heads
    (models/attention.py), and its log-probs are the full forward's; outside the block the model attends as SDPA."""
    from nla_shell.models import attention, inner_lm

    actor, injector, tokenizer, rollouts, acts = ragged_batch
    one_group = [i for i, r in enumerate(rollouts) if r.prompt_index == rollouts[0].prompt_index]
    batch = prefix.prefix_batch(rollouts, one_group, injector, pad_id=tokenizer.pad_token_id)
    assert not batch.prompts_padded and len(set(batch.response_lengths)) > 1  # right-padded responses
    seen = []
    attend = attention.lower_right_attention

    def spying(module, query, key, value, mask, **kwargs):
        seen.append((mask is None and attention._active, query.shape[2], key.shape[2]))
        return attend(module, query, key, value, mask, **kwargs)

    from transformers import AttentionInterface

    attention._registered()  # so the spy stands in for a registered function, restored after
    monkeypatch.setitem(AttentionInterface._global_mapping, attention.ATTENTION, spying)
    full = response_batch([rollouts[i] for i in one_group], pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad():
        shared = prefix.prefix_logprobs(actor, injector, batch, acts[batch.prompt_sources])
        assert inner_lm(actor).config._attn_implementation == attention.ATTENTION and not attention._active
        with injector.inject(full.input_ids, acts[one_group]):
            expected = response_logprobs(actor, full.input_ids, full.attention_mask, full.positions, full.targets)
    width = batch.prompt_ids.shape[1]
    responses = [s for s in seen if s[1] > 1 and s[1] < s[2]]
    assert responses and all(unmasked and kv == width + q for unmasked, q, kv in responses)
    assert not any(unmasked for unmasked, q, kv in seen if q == kv)  # the prompt and the full forward: plain SDPA
    torch.testing.assert_close(shared[batch.mask], expected[full.mask], rtol=1e-5, atol=1e-5)


def test_a_right_padded_ar_batch_runs_unmasked_with_the_masked_forwards_numbers(tiny_av_dir, tiny_tokenizer):
    """ARModel(right_padded=True) drops the padding mask (causal attention keeps real tokens from later pads): the
    predictions and the gradients are the masked forward's; a left-padded batch still needs its mask."""
    from nla_shell.models import pad_right

    torch.manual_seed(0)
    ar = ARModel.from_pretrained(tiny_av_dir, mse_scale=8.0, extraction_layer_index=fixtures.LAYER_INDEX,
                                 create_head=True)
    texts = ["the cat sat on the mat today", "a dog", "explanation: birds fly south in the autumn"]
    tokens = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ids, mask = pad_right(tokens, tiny_tokenizer.pad_token_id, torch.device("cpu"))
    assert bool((mask == 0).any())

    def prediction_and_grads(**kwargs):
        ar.zero_grad(set_to_none=True)
        out = ar(ids, mask, **kwargs)
        out.pow(2).sum().backward()
        return out.detach(), [p.grad.clone() for p in trainable_parameters(ar)]

    masked, masked_grads = prediction_and_grads()
    unmasked, unmasked_grads = prediction_and_grads(right_padded=True)
    torch.testing.assert_close(unmasked, masked, rtol=1e-5, atol=1e-6)
    for a, b in zip(unmasked_grads, masked_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    width = ids.shape[1]
    left_ids = torch.tensor([[tiny_tokenizer.pad_token_id] * (width - len(t)) + t for t in tokens])
    left_mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in tokens])
    with torch.no_grad():
        left = ar(left_ids, left_mask)
        wrong = ar(left_ids, left_mask, right_padded=True)
    torch.testing.assert_close(left, masked, rtol=1e-4, atol=1e-5)
    assert float((wrong - masked).abs().max()) > 1e-3
