"""The vLLM engine on a GPU: injection parity with HF, no steered-KV leak, weight-sync parity, FP8 pushes.

Skipped unless CUDA and vLLM are importable (on the lent H200: the recipe in
shared/device/vllm/README.md, then `source /tmp/vllm_env.sh`). Builds a small random
Qwen3 (head_dim 64, so vLLM's FlashAttention serves it) and compares vLLM's behaviour
log-probs with the HF actor's, teacher-forced, with the injection done by
nla_shell.models.Injector (nla_core.inject_norm_matched at the output of block 1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
        reason="needs CUDA and vLLM",
    ),
]

import nla_core  # noqa: E402
from nla_shell.toy import builders as toy  # noqa: E402
from nla_shell.engines.base import RolloutRequest  # noqa: E402
from nla_shell.models import Injector  # noqa: E402

MARKER, LEFT, RIGHT = 7, 5, 6
LAYER = 1
D = 256
PROMPT_LEN = 16  # short prompts: the marker weighs enough in attention for the parity test to see it
LEAK_PROMPT_LEN = 48  # three 16-token KV blocks; the marker sits in the second (see _requests)
LEAK_MARKER = 20  # the first token still sees it strongly, and a full cached block holds steered KV
# bf16 engine vs bf16 HF forward: the issue measured 0.017 mean |dlogp| for this comparison.
PARITY_MEAN = 0.03
# fp8 engine (vllm_quantization=fp8) vs bf16 HF forward. The bound first chosen before any measurement, 0.1,
# failed in run Z (2026-12-01, H200): mean |dlogp| 0.189 after the first push and 0.196 after the second, on this
# random model, while a stale push read 1.077. FP8's 2^-4 per operand element is large against random weights'
# logits; on the trained toy NLA the same option measured 0.0056 (bench/RESULTS.md). The bound is now that
# measurement with a margin; what guards a push is the stale-versus-new assertion.
FP8_PARITY_MEAN = 0.3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A random Qwen3 with sharper-than-default weights, so an injection visibly moves the logits."""
    model = toy.build_tiny_qwen3(
        tiny_tokenizer, hidden_size=D, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.08)
    directory = tmp_path_factory.mktemp("vllm_tiny")
    toy.save_av_checkpoint(model.to(torch.bfloat16), tiny_tokenizer, directory)
    return directory


def _requests(n: int, seed: int, vocab: int, length: int = PROMPT_LEN) -> list[RolloutRequest]:
    """Random prompts over ids >= 10 (the toy tokenizer's specials are 0..2), markers at varied places."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(n):
        ids = torch.randint(10, vocab, (length,), generator=generator)
        position = LEAK_MARKER if length == LEAK_PROMPT_LEN else 3 + (3 * i) % (PROMPT_LEN - 8)
        ids[position - 1 : position + 2] = torch.tensor([LEFT, MARKER, RIGHT])
        requests.append(RolloutRequest(tuple(ids.tolist()), torch.randn(D, generator=generator) * 3.0))
    return requests


def _engine(model_dir, tokenizer, **overrides):
    from nla_shell.engines.vllm import VLLMRolloutEngine

    kwargs = dict(
        marker_id=MARKER,
        left_id=LEFT,
        right_id=RIGHT,
        injection_layer=LAYER,
        gpu_memory_utilization=0.2,
        max_model_len=512,
        llm_kwargs={"max_num_seqs": 64, "max_logprobs": -1},  # -1: full-vocab first-token probes
    )
    kwargs.update(overrides)
    return VLLMRolloutEngine(model_dir, tokenizer, **kwargs)


def _close(engine) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine.close()
    cleanup_dist_env_and_memory()  # lets this process build the next engine


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def _lora_actor(model_dir, *, seed: int):
    """The HF model with a LoRA whose B is random, so the adapter visibly changes the policy."""
    from peft import LoraConfig, get_peft_model

    actor = get_peft_model(
        _hf_model(model_dir),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0),
    ).eval()
    _randomise_lora(actor, seed=seed)
    return actor


def _randomise_lora(actor, *, seed: int, scale: float = 0.05) -> None:
    """New random LoRA B factors: the trainer's weights after an update, as far as a push can tell."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


@torch.no_grad()
def _hf_logprobs(model, rollouts, requests, *, inject: bool) -> torch.Tensor:
    """Teacher-forced log-probs of every generated token, concatenated over rollouts."""
    injector = Injector(model, marker_id=MARKER, left_id=LEFT, right_id=RIGHT, layer_index=LAYER)
    try:
        out = []
        for rollout in rollouts:
            ids = rollout.full_ids[None].cuda()
            vector = requests[rollout.prompt_index].activation[None].cuda()
            with injector.inject(ids, vector) if inject else contextlib.nullcontext():
                logits = model(ids).logits[0]
            out.append(nla_core.token_logprobs(logits[rollout.prompt_len - 1 : -1], ids[0, rollout.prompt_len :]).cpu())
        return torch.cat(out)
    finally:
        injector.remove()


def _behavior(rollouts) -> torch.Tensor:
    return torch.cat([r.behavior_logp for r in rollouts])


def _nearer(x: dict[int, float], a: dict[int, float], *, than: dict[int, float]) -> bool:
    """x is closer to a than to `than`: which run x repeats, judged relative to the steering
    effect itself rather than against a fixed tolerance (a random tiny model moves the
    first token by little, about bf16 noise from a changed kernel path)."""
    return _gap(x, a) < _gap(x, than)


def _gap(a: dict[int, float], b: dict[int, float]) -> float:
    """Mean |difference| of two full first-token log-prob distributions."""
    assert a.keys() == b.keys()
    return sum(abs(a[t] - b[t]) for t in a) / len(a)


@pytest.mark.parametrize("runner", ["0", "1"], ids=["v1_runner", "v2_runner"])
def test_steered_generation_matches_hf_injection(model_dir, tiny_tokenizer, monkeypatch, runner):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    engine = _engine(model_dir, tiny_tokenizer)
    try:
        config = engine.llm.llm_engine.vllm_config
        assert config.use_v2_model_runner == (runner == "1")
        assert config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE, "the fast path must keep CUDA graphs"
        requests = _requests(8, seed=0, vocab=len(tiny_tokenizer))
        rollouts = engine.generate(requests, group_size=4, max_new_tokens=24)
        assert len(rollouts) == 32 and [r.prompt_index for r in rollouts] == [i for i in range(8) for _ in range(4)]
        assert engine.steering_canary(requests[0]) > 0.05
    finally:
        _close(engine)
    model = _hf_model(model_dir)
    behavior = _behavior(rollouts)
    injected = (behavior - _hf_logprobs(model, rollouts, requests, inject=True)).abs()
    plain = (behavior - _hf_logprobs(model, rollouts, requests, inject=False)).abs()
    print(f"runner v{2 if runner == '1' else 1}: mean|dlogp| injected {injected.mean():.4f} (max {injected.max():.3f}), "
          f"without injection {plain.mean():.4f} (max {plain.max():.3f})")
    assert injected.mean() <= PARITY_MEAN
    # Measured on the H200 (2026-11-29, v1 runner): 0.0184 injected vs 0.0499 without.
    assert plain.mean() >= 2 * injected.mean(), "the injection barely matters on this model: the test cannot see it"


@pytest.fixture(scope="module")
def cached_engine(model_dir, tiny_tokenizer):
    """Prefix caching ON: the configuration in which steered KV could leak."""
    engine = _engine(model_dir, tiny_tokenizer, enable_prefix_caching=True)
    yield engine
    _close(engine)


def test_prefix_caching_would_leak_without_the_salt(cached_engine, tiny_tokenizer):
    """Control: the leak mechanism is real here, so the next test can see a leak."""
    from vllm import SamplingParams, TokensPrompt

    from nla_shell.engines.vllm import nla_extra_args, sampling_kwargs

    (request,) = _requests(1, seed=5, vocab=len(tiny_tokenizer), length=LEAK_PROMPT_LEN)
    (spec,) = cached_engine.build_specs([request], group_size=1, max_new_tokens=1)
    assert cached_engine.llm.reset_prefix_cache()

    def first(extra_args):
        params = SamplingParams(**sampling_kwargs(spec, extra_args=extra_args, logprobs=-1))
        (out,) = cached_engine.llm.generate([TokensPrompt(prompt_token_ids=list(spec.prompt_ids))], [params], use_tqdm=False)
        return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}

    steered = first(nla_extra_args(spec))
    unsalted_plain = first(None)  # no salt: may read the blocks the steered request wrote
    assert cached_engine.llm.reset_prefix_cache()
    fresh_plain = first(None)
    assert _nearer(unsalted_plain, steered, than=fresh_plain), "expected the unsalted request to reuse the steered KV"


def test_no_steered_kv_leak_with_prefix_caching(cached_engine, tiny_tokenizer):
    (request,) = _requests(1, seed=7, vocab=len(tiny_tokenizer), length=LEAK_PROMPT_LEN)
    other = RolloutRequest(request.prompt_ids, torch.randn(D, generator=torch.Generator().manual_seed(9)) * 3.0)

    def first(req, *, steered):
        return cached_engine.first_token_logprobs(req, steered=steered, top_k=-1)

    assert cached_engine.llm.reset_prefix_cache()
    plain = first(request, steered=False)
    steered = first(request, steered=True)
    # steered, then unsteered on the same tokens: the unsteered result must stay unsteered
    plain_again = first(request, steered=False)
    assert _nearer(plain_again, plain, than=steered)
    assert _gap(steered, plain) > _gap(plain_again, plain), "steering must move the first token beyond cache noise"
    # two vectors on the same tokens: each keeps its own result, cached or fresh
    steered_other = first(other, steered=True)
    assert _nearer(first(request, steered=True), steered, than=steered_other)
    assert cached_engine.llm.reset_prefix_cache()
    assert _nearer(first(other, steered=True), steered_other, than=steered)


def test_weight_sync_matches_the_trainer(cached_engine, model_dir, tiny_tokenizer):
    """Runs last on the shared engine: it changes the engine's weights."""
    actor = _lora_actor(model_dir, seed=3)
    base_before = {n: p.detach().clone() for n, p in actor.named_parameters() if "lora_" not in n}
    requests = _requests(8, seed=11, vocab=len(tiny_tokenizer))

    stale = cached_engine.generate(requests, group_size=2, max_new_tokens=24)
    gap_before = (_behavior(stale) - _hf_logprobs(actor, stale, requests, inject=True)).abs().mean()
    seconds = cached_engine.sync_weights(actor)
    fresh = cached_engine.generate(requests, group_size=2, max_new_tokens=24)
    gap_after = (_behavior(fresh) - _hf_logprobs(actor, fresh, requests, inject=True)).abs()
    print(f"sync {seconds:.3f}s; mean|dlogp| vs trainer before {gap_before:.4f}, after {gap_after.mean():.4f} "
          f"(max {gap_after.max():.3f})")
    assert gap_after.mean() <= PARITY_MEAN
    assert gap_before >= 3 * gap_after.mean(), "the adapter barely matters: the test cannot see a missing sync"
    for name, p in actor.named_parameters():
        if name in base_before:
            assert torch.equal(p.detach(), base_before[name]), f"sync modified the actor's {name}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_engine_steers_and_takes_weight_pushes(model_dir, tiny_tokenizer):
    """vllm_tp=2: the plugin reaches both TP workers, and a sync reaches both shards."""
    engine = _engine(model_dir, tiny_tokenizer, tensor_parallel_size=2)
    requests = _requests(8, seed=13, vocab=len(tiny_tokenizer))
    actor = _lora_actor(model_dir, seed=4)
    try:
        before = engine.generate(requests, group_size=2, max_new_tokens=24)
        engine.sync_weights(actor)
        after = engine.generate(requests, group_size=2, max_new_tokens=24)
    finally:
        _close(engine)
    with actor.disable_adapter():
        base_gap = (_behavior(before) - _hf_logprobs(actor, before, requests, inject=True)).abs().mean()
    synced_gap = (_behavior(after) - _hf_logprobs(actor, after, requests, inject=True)).abs()
    print(f"tp=2: mean|dlogp| vs base {base_gap:.4f}, after sync vs actor {synced_gap.mean():.4f} (max {synced_gap.max():.3f})")
    assert base_gap <= PARITY_MEAN
    assert synced_gap.mean() <= PARITY_MEAN


def test_sleep_level_2_frees_the_gpu_and_wakes_with_the_pushed_weights_steered(model_dir, tiny_tokenizer):
    """vllm_sleep=2: asleep, vLLM's weights and KV cache are off the GPU; at the wake-up the
    push restores the actor's weights and the re-zeroed steering buffers steer again (a level-2
    sleep discards both). The only sleep-mode engine of this process (vLLM's allocator is a
    process singleton)."""
    from nla_shell.engines.base import held_awake

    actor = _lora_actor(model_dir, seed=5)
    requests = _requests(8, seed=17, vocab=len(tiny_tokenizer))
    engine = _engine(model_dir, tiny_tokenizer, sleep_level=2)
    try:
        engine.sync_weights(actor)
        engine.generate(requests, group_size=2, max_new_tokens=24)  # then sleeps, discarding all
        free_asleep = torch.cuda.mem_get_info()[0]
        with held_awake(engine):
            free_awake = torch.cuda.mem_get_info()[0]
            rollouts = engine.generate(requests, group_size=2, max_new_tokens=24)
            canary = engine.steering_canary(requests[0])
        stats = dict(engine.last_stats)
    finally:
        _close(engine)
    freed_gib = (free_asleep - free_awake) / 2**30
    gap = (_behavior(rollouts) - _hf_logprobs(actor, rollouts, requests, inject=True)).abs()
    with actor.disable_adapter():
        base_gap = (_behavior(rollouts) - _hf_logprobs(actor, rollouts, requests, inject=True)).abs().mean()
    print(f"sleep level 2: {freed_gib:.1f} GiB held only while awake; split {stats}; canary {canary:.3f}; "
          f"mean|dlogp| vs actor {gap.mean():.4f} (max {gap.max():.3f}), vs the base {base_gap:.4f}")
    # gpu_memory_utilization 0.2 of the card is nearly all KV cache for this tiny model.
    assert freed_gib >= 0.1 * torch.cuda.mem_get_info()[1] / 2**30
    assert stats["push_s"] > 0 and stats["sleep_s"] > 0
    assert canary > 0.05
    assert gap.mean() <= PARITY_MEAN
    assert base_gap >= 3 * gap.mean(), "the adapter barely matters: the test cannot see a missing push"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_per_rank_engines_under_torchrun(model_dir, tmp_path):
    """`nla train` under torchrun with engine=vllm: two ranks, each with its own sleep-mode engine
    (vLLM's external_launcher) on its own GPU, sampling different numbers of prompts (no per-step
    collective to hang on), steered with its own pushed actor; the job's process group outlives
    the engines (`tests/gpu/vllm_rank_worker.py`)."""
    worker = Path(__file__).with_name("vllm_rank_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker), str(model_dir), str(tmp_path)]
    done = subprocess.run(command, env={**os.environ, "NCCL_NVLS_ENABLE": "0"}, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"per-rank engines: {ranks}")
    assert [r["vllm_device"] for r in ranks] == ["cuda:0", "cuda:1"]
    assert [r["rollouts"] for r in ranks] == [8, 16]
    assert all(r["gap_mean"] <= PARITY_MEAN for r in ranks)
    assert all(r["allreduce_after_close"] == 3.0 for r in ranks)


def _linear_weight_dtypes(model) -> dict[str, str]:
    """apply_model: the weight dtype of every vLLM linear layer (lm_head and embeddings are not LinearBase)."""
    from vllm.model_executor.layers.linear import LinearBase

    return {name: str(m.weight.dtype) for name, m in model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matrix products need compute capability 8.9 (Ada, Hopper) or later")
@pytest.mark.parametrize("quantization", ["fp8", "fp8_per_channel"])
def test_fp8_engine_holds_fp8_linears_and_follows_every_push(model_dir, tiny_tokenizer, quantization):
    """vllm_quantization=fp8 and fp8_per_channel (vLLM's online FP8 of the bf16 checkpoint, one scale per weight
    tensor or per output channel): every linear layer holds fp8 weights;
    each push (one re-quantising reload_weights) moves the behaviour log-probs to the pushed weights: after the
    trainer's weights change and are pushed again, the sampled tokens' log-probs are near the trainer's new bf16
    ones and clearly farther from the old ones (a stale push would keep them near the old)."""
    actor = _lora_actor(model_dir, seed=6)
    requests = _requests(8, seed=19, vocab=len(tiny_tokenizer))
    engine = _engine(model_dir, tiny_tokenizer, quantization=quantization)
    try:
        loaded_dtypes = engine.llm.apply_model(_linear_weight_dtypes)[0]
        first_push_s = engine.sync_weights(actor)
        first = engine.generate(requests, group_size=2, max_new_tokens=24)
        old_lora = {n: p.detach().clone() for n, p in actor.named_parameters() if "lora_B" in n}
        _randomise_lora(actor, seed=7, scale=0.1)  # a large move, so that FP8's own gap cannot hide a stale push
        second_push_s = engine.sync_weights(actor)
        pushed_dtypes = engine.llm.apply_model(_linear_weight_dtypes)[0]
        second = engine.generate(requests, group_size=2, max_new_tokens=24)
    finally:
        _close(engine)
    new_gap = (_behavior(second) - _hf_logprobs(actor, second, requests, inject=True)).abs()
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if name in old_lora:
                p.copy_(old_lora[name])
    first_gap = (_behavior(first) - _hf_logprobs(actor, first, requests, inject=True)).abs().mean()
    stale_gap = (_behavior(second) - _hf_logprobs(actor, second, requests, inject=True)).abs().mean()
    print(f"{quantization}: pushes {first_push_s:.3f}s, {second_push_s:.3f}s; mean|dlogp| vs the pushed actor: "
          f"first push "
          f"{first_gap:.4f}, second {new_gap.mean():.4f} (max {new_gap.max():.3f}); second vs the old weights "
          f"{stale_gap:.4f}; linear dtypes {sorted(set(pushed_dtypes.values()))}")
    assert loaded_dtypes and set(loaded_dtypes.values()) == {"torch.float8_e4m3fn"}, loaded_dtypes
    assert pushed_dtypes == loaded_dtypes, "a push must re-quantise in place, not leave bf16 weights behind"
    assert first_gap <= FP8_PARITY_MEAN
    assert new_gap.mean() <= FP8_PARITY_MEAN
    assert stale_gap >= 2 * new_gap.mean(), "the second push did not reach vLLM (or the change is too small to see)"
