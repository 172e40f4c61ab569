"""Every model family on a GPU: each engine that claims a family samples what the trainer scores.

Skipped without CUDA; the vLLM cases also skip without vLLM. For each family of the adapter
table a tiny random model (tests/family_models.py at head_dim 64, the smallest head size
vLLM's attention kernels serve; 4 blocks, sliding windows of 4 tokens on Mistral and Gemma,
Gemma 2's attention and final-logit soft-capping) in bf16 on CUDA:

- the native engine, CUDA graphs on, LoRA unmerged and merged: behaviour log-probs equal
  the trainer's (`models.response_logprobs`, the fused log-prob path) on the sampled tokens;
- the vLLM engine (residual_add on every family it claims, with CUDA graphs; kitft's
  embedding_replace, eager, on Llama and on Gemma 3, whose embeddings are scaled): the same;
- in every case the injection matters: the trainer's log-probs without it are further off;
- GPT-2, which neither claims, is refused by the native engine at start-up with one line
  (`nla train engine=vllm` refuses it before vLLM starts; CPU-tested in test_families.py).

Tolerance: mean |Δ log-prob| <= BF16_MEAN over the sampled tokens. Two bf16 forwards that
differ only in kernel choice and summation order (a captured graph vs the trainer's eager
forward, a merged vs a split LoRA, vLLM's attention vs SDPA) round each op's output at 2^-9
relative, which accumulates over the 4 blocks to about 1e-2 on log-probs: on the 4-block
Qwen3 of tests/gpu/test_vllm.py vLLM measured 0.017-0.018 and the native engine stays under
0.02 (test_native_gpu.py). A real error (an ignored window, soft-cap or embedding scale, a
missed injection) moves log-probs by 0.1-1. The max is printed, not asserted: a bf16
near-tie on a rare token can move one log-prob by far more than the mean.

Run (about 1 minute for the native cases, 4 more for the 8 vLLM engine start-ups, each
compiling its model; `-k native` for the first minute alone; the vLLM cases need the vLLM
bundle of shared/device/vllm):
  python -m pytest tests/gpu/test_families_gpu.py -q -s -p no:cacheprovider
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import family_models  # noqa: E402
from nla_shell import families  # noqa: E402
from nla_shell.engines.base import RolloutRequest  # noqa: E402
from nla_shell.engines.native import NativeRolloutEngine  # noqa: E402
from nla_shell.models import Injector, load_actor, response_logprobs  # noqa: E402
from nla_shell.training.update import response_batch  # noqa: E402

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")

CUDA = torch.device("cuda")
HEAD_DIM, LAYERS = 64, 4
D = family_models.HEADS * HEAD_DIM
MARKER, LEFT, RIGHT = 7, 5, 6  # toy-tokenizer ids; prompts draw the rest from ids >= 10
LAYER = 1
PROMPT_LEN, NEW_TOKENS = 10, 8  # short: the marker weighs enough in attention for the injection to show
# (float32 on the CPU, the trainer's log-probs move by 0.06 (Gemma 2, whose soft-cap at 2 squeezes
# every logit) to 0.12 (Llama) mean when its injection is left out)
BF16_MEAN = 0.03
ENGINE_FAMILIES = tuple(t for t in family_models.FAMILY_NAMES if t != "gpt2")
VLLM_CASES = [(t, "residual_add") for t in ENGINE_FAMILIES] + [("llama", "embedding_replace"),
                                                                ("gemma3_text", "embedding_replace")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """model_type -> a saved bf16 tiny model of that family (built on first use).

    Weights are redrawn sharper than the default init (N(0, 0.08^2)), as in test_vllm.py, so
    an injected vector visibly moves the logits (and Gemma 2's logits reach its soft-cap).
    """
    root = tmp_path_factory.mktemp("families_gpu")

    def build(model_type: str, *, tied: bool = False) -> Path:
        directory = root / (model_type + ("_tied" if tied else ""))
        if not (directory / "config.json").exists():
            model = family_models.build_tiny_model(model_type, tiny_tokenizer, head_dim=HEAD_DIM, layers=LAYERS,
                                                   tie_word_embeddings=tied)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.copy_(torch.randn(p.shape, generator=generator) * 0.08)
            model.to(torch.bfloat16).save_pretrained(directory)
            tiny_tokenizer.save_pretrained(directory)
        return directory

    return build


def _requests(n: int, vocab: int) -> list[RolloutRequest]:
    """Random prompts with the marker triple at varied places, one random vector each."""
    generator = torch.Generator().manual_seed(0)
    requests = []
    for i in range(n):
        ids = torch.randint(10, vocab, (PROMPT_LEN,), generator=generator)
        position = PROMPT_LEN - 2 - i % 3  # near the end: inside the first sampled tokens' sliding windows
        ids[position - 1 : position + 2] = torch.tensor([LEFT, MARKER, RIGHT])
        requests.append(RolloutRequest(tuple(ids.tolist()), torch.randn(D, generator=generator) * 3.0))
    return requests


def _actor(directory: Path, *, random_adapter: bool):
    """The trainer's actor in bf16 on CUDA; a non-zero LoRA when random_adapter (else it is the base)."""
    torch.manual_seed(0)
    actor = load_actor(directory, lora_r=8, lora_alpha=16, use_rslora=True, resume_adapter=None,
                       dtype=torch.bfloat16, device=CUDA)
    if random_adapter:
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    return actor


def _gaps(actor, injector, tokenizer, requests, rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """|behaviour - trainer| log-probs on the sampled tokens, with the trainer's injection and without it."""
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=CUDA)
    vectors = torch.stack([requests[r.prompt_index].activation for r in rollouts]).to(CUDA)
    score = lambda: response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions,  # noqa: E731
                                      batch.targets)
    with torch.no_grad():
        with injector.inject(batch.input_ids, vectors):
            injected = score()
        plain = score()
    return ((injected - batch.behavior_logp)[batch.mask].abs(), (plain - batch.behavior_logp)[batch.mask].abs())


def _check(label: str, injected: torch.Tensor, plain: torch.Tensor) -> None:
    print(f"{label}: mean|dlogp| {injected.mean():.4f} (max {injected.max():.3f}) over {injected.numel()} tokens; "
          f"without the trainer's injection {plain.mean():.4f}")
    assert injected.numel() > 0
    assert float(injected.mean()) <= BF16_MEAN, label
    assert float(plain.mean()) >= 2 * float(injected.mean()), f"{label}: the injection barely matters here"


# --------------------------------------------------------------------------- native


@pytest.mark.parametrize("merge_lora", [False, True], ids=["lora", "merged"])
@pytest.mark.parametrize("model_type", ENGINE_FAMILIES)
def test_native_graphs_sample_what_the_trainer_scores(model_type, merge_lora, model_dir, tiny_tokenizer):
    actor = _actor(model_dir(model_type), random_adapter=True)
    injector = Injector(actor, marker_id=MARKER, left_id=LEFT, right_id=RIGHT, layer_index=LAYER)
    engine = NativeRolloutEngine(actor, injector, tiny_tokenizer, merge_lora=merge_lora, kv_bucket=16)
    requests = _requests(8, len(tiny_tokenizer))
    rollouts = engine.generate(requests, group_size=4, max_new_tokens=NEW_TOKENS, generator=torch.Generator(CUDA).manual_seed(0))
    assert engine.cuda_graphs and engine.graph_error is None, engine.graph_error
    _check(f"native {model_type} merge_lora={merge_lora}", *_gaps(actor, injector, tiny_tokenizer, requests, rollouts))


# --------------------------------------------------------------------------- vLLM


def _vllm_engine(directory: Path, tokenizer, *, style: str):
    from nla_shell.engines.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(
        directory, tokenizer, marker_id=MARKER, left_id=LEFT, right_id=RIGHT, injection_layer=LAYER,
        injection_style=style, injection_norm=None,
        # Eight engines start in this process, and a closed engine may keep its memory.
        gpu_memory_utilization=0.05, max_model_len=256,  # the tiny configs: max_position_embeddings 256
        # CUDA graphs (the production path) for residual_add; the embedding_replace cases run
        # eager to keep the file's time down: the style's custom op is the same either way.
        enforce_eager=style == "embedding_replace", llm_kwargs={"max_num_seqs": 64},
    )


@needs_vllm
@pytest.mark.parametrize(("model_type", "style"), VLLM_CASES)
def test_vllm_samples_what_the_trainer_scores(model_type, style, model_dir, tiny_tokenizer):
    from vllm.config import CUDAGraphMode
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    # vLLM serves Gemma 2 with tied embeddings only (as every released Gemma 2 has them; untied is refused).
    tied = families.family_of(family_models.tiny_config(model_type, tiny_tokenizer)).vllm_needs_tied_embeddings
    directory = model_dir(model_type, tied=tied)
    families.require_engine(family_models.tiny_config(model_type, tiny_tokenizer, tie_word_embeddings=tied), "vllm")
    requests = _requests(8, len(tiny_tokenizer))
    engine = _vllm_engine(directory, tiny_tokenizer, style=style)
    try:
        graphs = engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        assert graphs == (style == "residual_add")
        rollouts = engine.generate(requests, group_size=4, max_new_tokens=NEW_TOKENS)
    finally:
        engine.close()
        cleanup_dist_env_and_memory()  # lets this process build the next engine
    actor = _actor(directory, random_adapter=False)  # a zero LoRA: the policy is the checkpoint vLLM loaded
    injector = Injector(actor, marker_id=MARKER, left_id=LEFT, right_id=RIGHT, style=style, injection_norm=None,
                        layer_index=LAYER)
    _check(f"vllm {model_type} {style}", *_gaps(actor, injector, tiny_tokenizer, requests, rollouts))


# --------------------------------------------------------------------------- refusals


def test_the_native_engine_refuses_a_family_it_does_not_claim_at_start_up(model_dir, tiny_tokenizer):
    """GPT-2: one line naming the engine and the one that does claim it. (`nla train engine=vllm`
    refuses it from the config before vLLM starts: tests/shell/test_families.py, on the CPU.)"""
    actor = _actor(model_dir("gpt2"), random_adapter=False)
    injector = Injector(actor, marker_id=MARKER, left_id=LEFT, right_id=RIGHT, layer_index=LAYER)
    with pytest.raises(families.UnsupportedModelError, match=r"^engine=native does not support GPT-2 models; use engine=hf$"):
        NativeRolloutEngine(actor, injector, tiny_tokenizer)
