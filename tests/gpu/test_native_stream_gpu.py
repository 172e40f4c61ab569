"""The slot decoder (continuous batching, `nla serve --continuous-batching`) on CUDA with graphs: rows that join
between decode steps, through graph replays, decode what the eager engine's `generate` decodes for each alone, with
its log-probs, in float32. Skipped without CUDA; the CPU tests (tests/shell/test_native_stream.py) cover slot reuse
and per-row lengths eagerly."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from nla_shell.engines.native import NativeRolloutEngine  # noqa: E402
from nla_shell.engines.native_stream import SlotDecoder  # noqa: E402
from test_native_gpu import _setup, inputs  # noqa: E402,F401 - fixture
from slot_stream import alone, same_tokens, stream  # noqa: E402

T = 24


@pytest.mark.parametrize("merge_lora", [False, True])
def test_graph_replayed_slots_decode_what_eager_generate_decodes_for_each_row_alone(inputs, merge_lora):
    actor, injector, tokenizer, requests = _setup(inputs, torch.float32)
    eager = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora, greedy=True, cuda_graphs=False)
    reference = alone(eager, requests, max_new_tokens=T)
    engine = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora, greedy=True)
    decoder = SlotDecoder(engine, slots=3, max_prompt_len=64, max_new_tokens=T)
    assert decoder.cuda_graphs
    # four rows through three slots: the fourth waits for a slot, so it joins through a replayed graph mid-decode
    arrivals = [(i, r, step, T) for i, (r, step) in enumerate(zip(requests, (0, 2, 5, 6)))]
    got = stream(decoder, arrivals)
    assert decoder.cuda_graphs and decoder.graphs, "graph capture failed: the decoder fell back to eager steps"
    for i, ref in enumerate(reference):
        assert same_tokens(got[i], ref), i
        torch.testing.assert_close(got[i].behavior_logp, ref.behavior_logp, rtol=0, atol=1e-4)
