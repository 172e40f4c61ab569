"""Helpers for the slot decoder's tests (tests/shell/test_native_stream.py on CPU, tests/gpu/test_native_stream_gpu.py
with CUDA graphs): a row's decode alone through `generate`, and a stream of rows joining a `SlotDecoder` between steps."""

from __future__ import annotations

from nla_shell.engines.native_stream import SlotDecoder

T = 10


def alone(engine, requests, max_new_tokens=T):
    """What generate gives each request, one call per request (greedy, so no noise is involved)."""
    return [engine.generate([r], group_size=1, max_new_tokens=max_new_tokens)[0] for r in requests]


def stream(decoder: SlotDecoder, arrivals, *, greedy=True, generator=None, log=None):
    """Run the decoder until every arrival has ended. arrivals: [(key, request, first step, max_new_tokens)]; a row
    joins at its step or, when no slot is free then, at the first step after one frees. log[key] = (step joined,
    slot, keys of the rows active then). Returns {key: rollout}."""
    waiting, done, step = list(arrivals), {}, 0
    with decoder.running():
        while waiting or decoder.busy:
            while waiting and waiting[0][2] <= step and decoder.free:
                key, request, _, budget = waiting.pop(0)
                before = set(decoder.rows)
                ended = decoder.admit([request], keys=[key], max_new_tokens=budget, greedy=greedy, generator=generator)
                if log is not None:
                    (slot,) = set(decoder.rows) - before if not ended else (None,)
                    log[key] = (step, slot, {row.key for s, row in decoder.rows.items() if s != slot})
                done.update({f.key: f.rollout for f in ended})
            if decoder.busy:
                done.update({f.key: f.rollout for f in decoder.step(generator)})
            step += 1
            assert step < 200, "the decoder never finished"
    return done


def same_tokens(a, b) -> bool:
    return a.full_ids.tolist() == b.full_ids.tolist()
