"""The native rollout engine on CPU: trainer parity, shared prefill, steering, EOS, merged LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fixtures
import nla_core
from nla_shell import cli
from nla_shell.toy import builders as toy
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.engines.base import RolloutEngine, RolloutRequest
from nla_shell.engines.decode_ops import sample_with_noise
from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.models import Injector, inner_lm, load_actor, response_logprobs
from nla_shell.training.update import response_batch

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def native_inputs(nla_cache_dir: Path, tiny_tokenizer):
    """(av_dir, ar_dir, parquet): the trainer tests' inputs (an AV that writes the tags)."""
    return fixtures.build_trainer_inputs(nla_cache_dir / "trainer_inputs", tiny_tokenizer)


@pytest.fixture(scope="session")
def deep_av_dir(nla_cache_dir: Path, tiny_tokenizer) -> Path:
    """A random tiny Qwen3 with 3 layers: the injection at block 1's output must reach the
    logits through a later attention layer (in the 2-layer toy AV block 1 is the last)."""
    directory = nla_cache_dir / "native_av3"
    if not (directory / "config.json").exists():
        model = toy.build_tiny_qwen3(tiny_tokenizer, hidden_size=fixtures.D_MODEL, num_layers=fixtures.NUM_LAYERS, seed=0)
        toy.save_av_checkpoint(model, tiny_tokenizer, directory)
    return directory


@pytest.fixture
def setup(native_inputs, deep_av_dir):
    """A fresh 3-layer PEFT actor with a non-zero LoRA, its injector, tokenizer and 3 requests.

    Request 1's prompt is longer than the others, so the engine's left padding is exercised.
    """
    from transformers import AutoTokenizer

    _, _, parquet = native_inputs
    tokenizer = AutoTokenizer.from_pretrained(deep_av_dir)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    torch.manual_seed(0)
    actor = load_actor(deep_av_dir, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None,
                       dtype=torch.float32, device=CPU)
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    injector = Injector(actor, marker_id=cfg.injection_token_id, left_id=cfg.injection_left_neighbor_id,
                        right_id=cfg.injection_right_neighbor_id)
    rows = load_rows(parquet, cfg, max_rows=3)
    prompts = [build_prompt_ids(r.prompt, cfg, tokenizer) for r in rows]
    prompts[1] = tokenizer.encode("The cat sat on the mat. ", add_special_tokens=False) + prompts[1]
    requests = [RolloutRequest(tuple(p), r.activation) for p, r in zip(prompts, rows)]
    return actor, injector, tokenizer, requests


def _generate(engine, requests, *, group_size=2, max_new_tokens=10, seed=1):
    return engine.generate(requests, group_size=group_size, max_new_tokens=max_new_tokens,
                           generator=torch.Generator().manual_seed(seed))


def _trainer_logprobs(actor, injector, tokenizer, requests, rollouts):
    """The update's log-probs (response_batch + response_logprobs with the injection) of the rollouts."""
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=CPU)
    vectors = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    with torch.no_grad(), injector.inject(batch.input_ids, vectors):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    return logp, batch


@pytest.mark.parametrize("merge_lora", [False, True])
def test_behaviour_logprobs_equal_the_training_forward(setup, merge_lora):
    actor, injector, tokenizer, requests = setup
    engine = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora)
    rollouts = _generate(engine, requests, group_size=3, max_new_tokens=12)
    logp, batch = _trainer_logprobs(actor, injector, tokenizer, requests, rollouts)
    diff = (logp - batch.behavior_logp)[batch.mask].abs()
    assert diff.numel() >= len(rollouts) and float(diff.max()) <= 1e-4


def test_rollouts_keep_the_engine_contract(setup):
    actor, injector, tokenizer, requests = setup
    engine = NativeRolloutEngine(actor, injector, tokenizer, max_batch=4)  # 2 prompts per chunk: 2 chunks
    assert isinstance(engine, RolloutEngine) and engine.shares_actor_weights
    assert engine.sync_weights(actor) == 0.0
    rollouts = _generate(engine, requests, group_size=2, max_new_tokens=7)
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2]
    for r in rollouts:
        req = requests[r.prompt_index]
        n_gen = r.response_len
        assert r.prompt_len == len(req.prompt_ids) and r.full_ids[: r.prompt_len].tolist() == list(req.prompt_ids)
        assert r.full_ids.dtype == torch.long and 1 <= n_gen <= 7
        assert r.behavior_logp.dtype == torch.float32 and r.behavior_logp.shape == (n_gen,)
        assert bool((r.behavior_logp <= 0).all())
        gen = r.full_ids[r.prompt_len :]
        assert tokenizer.eos_token_id not in gen[:-1].tolist()  # nothing after an EOS
        assert r.text == tokenizer.decode(gen, skip_special_tokens=True)
    engine.close()


def test_each_prompt_is_prefilled_once_for_its_group(setup):
    actor, injector, tokenizer, requests = setup
    calls = []
    hook = inner_lm(actor).model.layers[0].register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape[:2])))
    try:
        rollouts = _generate(NativeRolloutEngine(actor, injector, tokenizer), requests, group_size=4, max_new_tokens=6)
    finally:
        hook.remove()
    prefills = [c for c in calls if c[1] > 1]
    assert len(prefills) == 1 and prefills[0][0] == len(requests)  # one forward, one row per prompt
    assert calls[1:] and all(c == (len(requests) * 4, 1) for c in calls[1:])  # then B*G one-token steps
    assert len(calls) - 1 == max(r.response_len for r in rollouts) - 1


def test_the_injected_vector_steers_the_rollout(setup):
    actor, injector, tokenizer, requests = setup
    engine = NativeRolloutEngine(actor, injector, tokenizer)
    base = _generate(engine, requests[:1], group_size=1, max_new_tokens=4)[0]
    other = RolloutRequest(requests[0].prompt_ids, torch.randn(requests[0].activation.shape, generator=torch.Generator().manual_seed(5)))
    steered = _generate(engine, [other], group_size=1, max_new_tokens=4)[0]
    # Two vectors, same noise: the first token's log-prob differs.
    assert not torch.equal(base.behavior_logp[:1], steered.behavior_logp[:1])
    # Unsteered (no injection) the first token has yet another log-prob, and the engine's is the injected one.
    prompt = torch.tensor([requests[0].prompt_ids])
    lm = inner_lm(actor)
    with torch.no_grad():
        plain = torch.log_softmax(lm(prompt).logits[0, -1].float(), -1)
        with injector.inject(prompt, requests[0].activation[None]):
            injected = torch.log_softmax(lm(prompt).logits[0, -1].float(), -1)
    assert float((plain - injected).abs().max()) > 1e-3  # float32 noise is ~1e-6
    first = base.full_ids[base.prompt_len]
    assert abs(float(base.behavior_logp[0] - injected[first])) <= 1e-5


def _engine_stopping_at(actor, injector, tokenizer, *extra_eos: int) -> NativeRolloutEngine:
    """A fresh engine on an actor whose generation_config lists extra_eos (the tokenizer's eos is always added)."""
    inner_lm(actor).generation_config.eos_token_id = list(extra_eos)
    return NativeRolloutEngine(actor, injector, tokenizer)


def test_every_eos_of_the_generation_config_ends_a_row_and_decoding_stops_once_all_rows_ended(setup):
    actor, injector, tokenizer, requests = setup
    free = _generate(_engine_stopping_at(actor, injector, tokenizer), requests, group_size=2, max_new_tokens=12)
    gen0 = free[0].full_ids[free[0].prompt_len :].tolist()
    k = next(i for i in range(2, len(gen0)) if gen0[i] not in gen0[:i])
    # A token row 0 samples first at step k joins the eos list (as Qwen3 lists <|endoftext|> beside <|im_end|>).
    engine = _engine_stopping_at(actor, injector, tokenizer, gen0[k])
    assert engine.eos_ids == (gen0[k], tokenizer.eos_token_id)
    ended = _generate(engine, requests, group_size=2, max_new_tokens=12)
    assert ended[0].full_ids[ended[0].prompt_len :].tolist() == gen0[: k + 1]
    assert torch.equal(ended[0].behavior_logp, free[0].behavior_logp[: k + 1])
    for before, after in zip(free, ended):
        gen = before.full_ids[before.prompt_len :].tolist()
        cut = next((i + 1 for i, t in enumerate(gen) if t in engine.eos_ids), len(gen))
        assert after.full_ids[after.prompt_len :].tolist() == gen[:cut]
    # Once every row has ended, decoding stops: one sample, ended at its step j.
    (single,) = _generate(_engine_stopping_at(actor, injector, tokenizer), requests[:1], group_size=1, max_new_tokens=12)
    gen = single.full_ids[single.prompt_len :].tolist()
    j = next(i for i in range(2, len(gen)) if gen[i] not in gen[:i])
    engine = _engine_stopping_at(actor, injector, tokenizer, gen[j])
    (alone,) = _generate(engine, requests[:1], group_size=1, max_new_tokens=12)
    assert alone.full_ids[alone.prompt_len :].tolist() == gen[: j + 1] and engine.last_stats["decode_steps"] == j


def test_merged_lora_restores_the_weights_bit_exactly(setup):
    actor, injector, tokenizer, requests = setup
    before = {name: (p.detach().clone(), p.data_ptr(), p.requires_grad) for name, p in actor.named_parameters()}
    unmerged = _generate(NativeRolloutEngine(actor, injector, tokenizer), requests, group_size=2)
    merged_engine = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=True)
    merged = _generate(merged_engine, requests, group_size=2)
    _generate(merged_engine, requests, group_size=2)  # the scratch copies are reused, and restored again
    for name, p in actor.named_parameters():
        value, ptr, grad = before[name]
        assert torch.equal(p.detach(), value) and p.data_ptr() == ptr and p.requires_grad == grad, name
    assert not any(m.disable_adapters for m in actor.modules() if hasattr(m, "lora_A"))
    assert inner_lm(actor).config._attn_implementation == "sdpa"
    for a, b in zip(unmerged, merged):  # the same policy up to float32 rounding: same tokens, same log-probs
        assert torch.equal(a.full_ids, b.full_ids)
        torch.testing.assert_close(a.behavior_logp, b.behavior_logp, rtol=0, atol=1e-5)


def test_the_sampler_draws_what_nla_core_draws():
    logits = 3 * torch.randn(6, 500, generator=torch.Generator().manual_seed(0))
    reference = nla_core.sample_tokens(logits, generator=torch.Generator().manual_seed(7))
    noise = torch.empty(6, 500).exponential_(generator=torch.Generator().manual_seed(7))
    ours = sample_with_noise(logits, noise)
    assert torch.equal(ours.tokens, reference.tokens)
    torch.testing.assert_close(ours.logp, reference.logp, rtol=0, atol=0)


def test_generation_is_reproducible_and_leaves_the_actor_as_it_was(setup):
    actor, injector, tokenizer, requests = setup
    actor.train()
    engine = NativeRolloutEngine(actor, injector, tokenizer)
    a, b = _generate(engine, requests, seed=3), _generate(engine, requests, seed=3)
    c = _generate(engine, requests, seed=4)
    assert all(torch.equal(x.full_ids, y.full_ids) and torch.equal(x.behavior_logp, y.behavior_logp) for x, y in zip(a, b))
    assert any(not torch.equal(x.full_ids, y.full_ids) for x, y in zip(a, c))
    torch.manual_seed(11)
    d = engine.generate(requests, group_size=2, max_new_tokens=10)
    torch.manual_seed(11)
    e = engine.generate(requests, group_size=2, max_new_tokens=10)
    assert all(torch.equal(x.full_ids, y.full_ids) for x, y in zip(d, e))
    assert inner_lm(actor).training and inner_lm(actor).config._attn_implementation == "sdpa"


def test_nla_train_runs_with_the_native_engine(native_inputs, tmp_path):
    av, ar, parquet = native_inputs
    save_dir = tmp_path / "run"
    settings = dict(
        av_ckpt=av, ar_ckpt=ar, rl_parquet=parquet, save_dir=save_dir, num_steps=2, batch_prompts=2, group_size=3,
        max_new_tokens=10, lora_r=4, lora_alpha=8, lr=1e-3, logp_micro_batch=2, eval_every=0, max_rows=32,
        device="cpu", logger="jsonl", engine="native", train_critic="true",
    )
    assert cli.main(["train", *(f"{k}={v}" for k, v in settings.items())]) == 0
    lines = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    # The engine samples with the trainer's policy: behaviour and trainer log-probs agree.
    assert all(line["logp_diff_max"] <= 1e-4 for line in lines)


def test_embedding_replace_style_behaviour_logprobs_equal_the_training_forward(setup):
    """kitft's style through the native engine: the same Injector serves prefill and the update."""
    actor, _, tokenizer, requests = setup
    marker = setup[1]
    injector = Injector(actor, marker_id=marker.marker_id, left_id=marker.left_id, right_id=marker.right_id,
                        style="embedding_replace", injection_norm=20.0)
    engine = NativeRolloutEngine(actor, injector, tokenizer)
    rollouts = _generate(engine, requests, group_size=2, max_new_tokens=10)
    logp, batch = _trainer_logprobs(actor, injector, tokenizer, requests, rollouts)
    diff = (logp - batch.behavior_logp)[batch.mask].abs()
    assert diff.numel() >= len(rollouts) and float(diff.max()) <= 1e-4
    injector.remove()
    plain, _ = _trainer_logprobs(actor, marker, tokenizer, requests, rollouts)  # the block-1 add gives others
    assert float((plain - logp)[batch.mask].abs().max()) > 1e-3


def test_an_injection_at_a_later_block_reaches_that_block_only_and_the_engine_samples_the_trainers_policy(setup):
    """injection_layer=2 (of 3 blocks): blocks 0-1 compute what they compute without a vector, block 2's output
    carries it; the native engine's behaviour log-probs equal the update's forward with the same injector."""
    actor, block_1, tokenizer, requests = setup
    block_1.remove()
    injector = Injector(actor, marker_id=block_1.marker_id, left_id=block_1.left_id, right_id=block_1.right_id,
                        layer_index=2)
    ids = torch.tensor([requests[0].prompt_ids])
    with torch.no_grad():
        plain = actor(input_ids=ids, output_hidden_states=True).hidden_states
        with injector.inject(ids, requests[0].activation[None]):
            injected = actor(input_ids=ids, output_hidden_states=True).hidden_states
    assert all(torch.equal(plain[i], injected[i]) for i in (0, 1, 2))  # the embeddings, blocks 0 and 1's outputs
    assert not torch.allclose(plain[3], injected[3])
    engine = NativeRolloutEngine(actor, injector, tokenizer)
    rollouts = _generate(engine, requests, group_size=2, max_new_tokens=10)
    logp, batch = _trainer_logprobs(actor, injector, tokenizer, requests, rollouts)
    diff = (logp - batch.behavior_logp)[batch.mask].abs()
    assert diff.numel() >= len(rollouts) and float(diff.max()) <= 1e-4
    with pytest.raises(ValueError, match=r"injection_layer=3: the AV has 3 decoder blocks; give a block index in 0..2"):
        Injector(actor, marker_id=block_1.marker_id, left_id=block_1.left_id, right_id=block_1.right_id, layer_index=3)
