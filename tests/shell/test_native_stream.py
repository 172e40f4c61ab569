"""The slot decoder (continuous batching on the native engine) on CPU, float32: rows that join between decode steps
decode what `NativeRolloutEngine.generate` decodes for them alone, with the trainer's log-probs; a slot freed by an
EOS serves a later row without leaking the earlier row's cache; each row ends at its own max_new_tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.engines.native_stream import SlotDecoder
from nla_shell.models import inner_lm
from slot_stream import T, alone, same_tokens, stream
from test_native import _trainer_logprobs, deep_av_dir, native_inputs, setup  # noqa: F401 - fixtures


@pytest.mark.parametrize("merge_lora", [False, True])
def test_greedy_rows_joining_at_different_steps_decode_what_generate_decodes_for_each_alone(setup, merge_lora):
    actor, injector, tokenizer, requests = setup
    engine = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora, greedy=True)
    reference = alone(engine, requests)
    decoder = SlotDecoder(engine, slots=3, max_prompt_len=64, max_new_tokens=T)
    got = stream(decoder, [(i, r, step, T) for i, (r, step) in enumerate(zip(requests, (0, 2, 5)))])
    for i, ref in enumerate(reference):
        assert same_tokens(got[i], ref), i
        torch.testing.assert_close(got[i].behavior_logp, ref.behavior_logp, rtol=0, atol=1e-5)
    logp, batch = _trainer_logprobs(actor, injector, tokenizer, requests,
                                    [replace(got[i], prompt_index=i) for i in range(len(requests))])
    diff = (logp - batch.behavior_logp)[batch.mask].abs()
    assert diff.numel() == 3 * T and float(diff.max()) <= 1e-4


def test_sampled_rows_carry_the_trainer_s_log_probs(setup):
    """Sampling at temperature 1 (rows joining at different steps, two samples per prompt): the behaviour
    log-prob of every sampled token equals the training forward's, within its tolerance (1e-4)."""
    actor, injector, tokenizer, requests = setup
    engine = NativeRolloutEngine(actor, injector, tokenizer)
    decoder = SlotDecoder(engine, slots=6, max_prompt_len=64, max_new_tokens=12)
    generator = torch.Generator().manual_seed(3)
    with decoder.running():
        ended = decoder.admit(requests[:2], keys=[0, 1], rows=2, generator=generator)
        for _ in range(3):
            ended += decoder.step(generator)
        ended += decoder.admit(requests[2:], keys=[2], rows=2, generator=generator)
        while decoder.busy:
            ended += decoder.step(generator)
    rollouts = [replace(f.rollout, prompt_index=f.key) for f in ended]
    assert sorted((f.key, f.sample) for f in ended) == [(k, s) for k in range(3) for s in range(2)]
    logp, batch = _trainer_logprobs(actor, injector, tokenizer, requests, rollouts)
    diff = (logp - batch.behavior_logp)[batch.mask].abs()
    assert diff.numel() >= len(rollouts) and float(diff.max()) <= 1e-4
    assert any(not same_tokens(a, b) for a, b in zip(rollouts[0::2], rollouts[1::2]))  # two draws, not one twice


def test_a_slot_freed_by_an_eos_serves_a_later_row_without_the_earlier_row_s_cache(setup):
    """Two slots: row B ends at an EOS while row A decodes on; row C takes B's slot mid-decode (its own write
    column, its own mask). Each decodes what it decodes alone; a shared write column or a mask reaching past a
    row's own columns would change C's tokens or log-probs."""
    actor, injector, tokenizer, requests = setup
    free_run = alone(NativeRolloutEngine(actor, injector, tokenizer, greedy=True), requests, max_new_tokens=12)
    gen = [r.full_ids[r.prompt_len :].tolist() for r in free_run]
    stops = [k for k in range(1, 6) if gen[1][k] not in gen[1][:k] + gen[0] + gen[2]]
    assert stops, f"no token of row 1's first steps is new to all rows: {gen}"
    inner_lm(actor).generation_config.eos_token_id = [gen[1][stops[0]]]  # row B (request 1) ends there
    engine = NativeRolloutEngine(actor, injector, tokenizer, greedy=True)
    reference = alone(engine, requests, max_new_tokens=12)
    assert reference[1].response_len == stops[0] + 1 and reference[0].response_len == 12
    log = {}
    got = stream(SlotDecoder(engine, slots=2, max_prompt_len=64, max_new_tokens=12),
                 [("A", requests[0], 0, 12), ("B", requests[1], 0, 12), ("C", requests[2], 1, 12)], log=log)
    assert log["C"][1] == log["B"][1] and log["C"][2] == {"A"}  # B's slot, while A still decoded
    assert log["C"][0] == stops[0]  # at the step after B's EOS
    for key, ref in zip("ABC", reference):
        assert same_tokens(got[key], ref), key
        torch.testing.assert_close(got[key].behavior_logp, ref.behavior_logp, rtol=0, atol=1e-5)


def test_rows_with_different_max_new_tokens_end_at_their_own_length(setup):
    actor, injector, tokenizer, requests = setup
    engine = NativeRolloutEngine(actor, injector, tokenizer, greedy=True)
    reference = alone(engine, requests, max_new_tokens=T)
    budgets = {0: 3, 1: T, 2: 1}
    log = {}
    got = stream(SlotDecoder(engine, slots=3, max_prompt_len=64, max_new_tokens=T),
                 [(i, r, 0, budgets[i]) for i, r in enumerate(requests)], log=log)
    for i, ref in enumerate(reference):
        n = min(budgets[i], ref.response_len)
        assert got[i].response_len == n
        assert got[i].full_ids.tolist() == ref.full_ids[: ref.prompt_len + n].tolist()
        torch.testing.assert_close(got[i].behavior_logp, ref.behavior_logp[:n], rtol=0, atol=1e-5)


def test_admission_past_the_free_slots_or_the_cache_is_refused_in_one_line(setup):
    actor, injector, tokenizer, requests = setup
    decoder = SlotDecoder(NativeRolloutEngine(actor, injector, tokenizer), slots=2, max_prompt_len=64,
                          max_new_tokens=4)
    with decoder.running():
        with pytest.raises(ValueError, match="3 requests x 1 rows, 3 keys, 2 free slots"):
            decoder.admit(requests, keys=[0, 1, 2])
        with pytest.raises(ValueError, match=r"max_new_tokens \[5\] outside 1..4"):
            decoder.admit(requests[:1], keys=[0], max_new_tokens=5)
        with pytest.raises(RuntimeError, match="no row is active"):
            decoder.step()
    assert decoder.free == 2
