"""The native engine on CUDA: graph-replayed decoding equals eager decoding, and the trainer's forward.

Skipped without CUDA. A tiny random 3-layer Qwen3 with a non-zero LoRA: float32 for the
exact comparisons, bf16 for the mean-gap bound the issue sets (<= 0.02).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import fixtures  # noqa: E402
from nla_shell.toy import builders as toy  # noqa: E402
from nla_shell.io.data import build_prompt_ids, load_rows  # noqa: E402
from nla_shell.io.sidecars import load_sidecar  # noqa: E402
from nla_shell.engines.base import RolloutRequest  # noqa: E402
from nla_shell.engines.native import NativeRolloutEngine  # noqa: E402
from nla_shell.models import Injector, load_actor, response_logprobs  # noqa: E402
from nla_shell.training.update import response_batch  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("native_gpu")
    av = toy.save_av_checkpoint(
        toy.build_tiny_qwen3(tiny_tokenizer, hidden_size=fixtures.D_MODEL, num_layers=3, seed=0), tiny_tokenizer,
        directory / "av",
    )
    parquet = fixtures.build_toy_rl(directory / "data", tiny_tokenizer)
    return av, parquet


def _setup(inputs, dtype):
    from transformers import AutoTokenizer

    av, parquet = inputs
    tokenizer = AutoTokenizer.from_pretrained(av)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    torch.manual_seed(0)
    actor = load_actor(av, lora_r=8, lora_alpha=16, use_rslora=True, resume_adapter=None, dtype=dtype, device=CUDA)
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    injector = Injector(actor, marker_id=cfg.injection_token_id, left_id=cfg.injection_left_neighbor_id,
                        right_id=cfg.injection_right_neighbor_id)
    rows = load_rows(parquet, cfg, max_rows=4)
    prompts = [build_prompt_ids(r.prompt, cfg, tokenizer) for r in rows]
    prompts[1] = tokenizer.encode("The cat sat on the mat. ", add_special_tokens=False) + prompts[1]
    return actor, injector, tokenizer, [RolloutRequest(tuple(p), r.activation) for p, r in zip(prompts, rows)]


def _run(engine, requests, seed=0, max_new_tokens=40):
    return engine.generate(requests, group_size=3, max_new_tokens=max_new_tokens,
                           generator=torch.Generator(CUDA).manual_seed(seed))


def _gap(actor, injector, tokenizer, requests, rollouts) -> torch.Tensor:
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=CUDA)
    vectors = torch.stack([requests[r.prompt_index].activation for r in rollouts]).to(CUDA)
    with torch.no_grad(), injector.inject(batch.input_ids, vectors):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    return (logp - batch.behavior_logp)[batch.mask].abs()


@pytest.mark.parametrize("merge_lora", [False, True])
def test_graphs_decode_as_eager_does_and_as_the_trainer_scores(inputs, merge_lora):
    actor, injector, tokenizer, requests = _setup(inputs, torch.float32)
    graphs = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora, kv_bucket=16)
    eager = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora, cuda_graphs=False)
    first, again = _run(graphs, requests), _run(graphs, requests)  # capture, then replay captured graphs
    assert graphs.cuda_graphs and graphs.graph_error is None
    reference = _run(eager, requests)
    for a, b, c in zip(first, again, reference):
        assert torch.equal(a.full_ids, b.full_ids) and torch.equal(a.full_ids, c.full_ids)
        torch.testing.assert_close(a.behavior_logp, c.behavior_logp, rtol=0, atol=1e-5)
    assert float(_gap(actor, injector, tokenizer, requests, first).max()) <= 1e-4


def test_graphs_follow_the_trained_weights(inputs):
    actor, injector, tokenizer, requests = _setup(inputs, torch.float32)
    engine = NativeRolloutEngine(actor, injector, tokenizer)
    _run(engine, requests)
    with torch.no_grad():  # an optimizer step updates the LoRA in place: replays must see it
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p), alpha=0.05)
    after = _run(engine, requests)
    assert float(_gap(actor, injector, tokenizer, requests, after).max()) <= 1e-4


def test_bf16_behaviour_logprobs_stay_close_to_the_trainer(inputs):
    actor, injector, tokenizer, requests = _setup(inputs, torch.bfloat16)
    for merge_lora in (False, True):
        engine = NativeRolloutEngine(actor, injector, tokenizer, merge_lora=merge_lora)
        gap = _gap(actor, injector, tokenizer, requests, _run(engine, requests))
        assert engine.graph_error is None and float(gap.mean()) <= 0.02, (merge_lora, float(gap.mean()))
