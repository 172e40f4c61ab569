"""Random models at the Qwen3 shapes (8B by default) and synthetic NLA inputs, shared by the GPU benchmarks.

Weights are random (no checkpoint is read): a model is built on the meta device and then
materialised directly on the target device, so an 8B model never touches host memory.
Timing and memory do not depend on the weight values; only sampled lengths would (EOS is
practically never drawn from a random model over a 152k vocabulary).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

# The Qwen3 geometries live with the memory model that reads them (nla_shell.training.memory).
from nla_shell.training import memory  # noqa: E402

QWEN3_SHAPES = memory.QWEN3_SHAPES
TINY = dict(
    vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
"""A CPU smoke-test geometry (vocab_size: the toy tokenizer's)."""
CORPUS = (
    "The cat sat on the mat and looked at the door. A dog ran after a red ball. "
    "<explanation>The text is about animals.</explanation> Explain the activation at the marked token."
)


def bench_shape(name: str, *, tiny: bool = False) -> dict[str, Any]:
    """The geometry a benchmark builds for --shape `name`: the Qwen3 model's, or with `tiny` the CPU
    smoke geometry with that model's embedding tying (so a CPU run takes the tied path the small
    models take on the GPU)."""
    shape = QWEN3_SHAPES[name]
    return dict(TINY, tie_word_embeddings=shape["tie_word_embeddings"]) if tiny else shape


def ar_extraction_layer(name: str, *, tiny: bool = False) -> int:
    """The AR's extraction layer for --shape `name`: two thirds of the depth (8B: 24 of 36, the layer
    every 8B benchmark so far used); the tiny geometry's 3 blocks keep layer 1."""
    return 1 if tiny else memory.ar_extraction_layer(name)


def qwen3_config(shape: dict[str, Any], *, vocab_size: int, num_layers: int | None = None):
    from transformers import Qwen3Config

    geometry = dict(shape, vocab_size=shape["vocab_size"] or vocab_size)
    tied = geometry.pop("tie_word_embeddings", False)
    if num_layers is not None:
        geometry["num_hidden_layers"] = num_layers
    return Qwen3Config(
        **geometry, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )


def random_qwen3(config, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A Qwen3ForCausalLM with N(0, 0.02) matrices and unit norms, allocated on `device` only."""
    from transformers import Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.tie_weights()  # to_empty gives each module its own tensor, which unties the LM head
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm scales
            else:
                param.normal_(0.0, 0.02, generator=generator)
    # to_empty leaves non-persistent buffers (RoPE's inverse frequencies) uninitialised.
    model.model.rotary_emb = Qwen3RotaryEmbedding(config).to(device)
    return model.eval()


def attach_lora(model: torch.nn.Module, *, r: int, alpha: int, use_rslora: bool = True, seed: int = 0):
    """The trainer's adapter (LoraConfig of `nla_shell.models.load_actor`) with a non-zero B,
    so the adapted policy differs from the base (PEFT starts B at zero)."""
    from peft import get_peft_model

    from nla_shell.families import lora_targets
    from nla_shell.models import lora_config

    actor = get_peft_model(model, lora_config(r, alpha, use_rslora=use_rslora, targets=lora_targets(model)))
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 1e-3, generator=generator)
    return actor


def random_ar(shape: dict[str, Any], *, extraction_layer: int, vocab_size: int, device: torch.device,
              dtype: torch.dtype, seed: int = 1):
    """The AR as the trainer builds it: a random LM truncated after `extraction_layer`
    (extraction_layer + 1 blocks) and an identity float32 value head, in eval mode (Qwen3 has no
    dropout, so eval mode serves its gradient steps too, as train.py does)."""
    from nla_core import resolve_target_scale
    from nla_shell.models import ARModel

    lm = random_qwen3(qwen3_config(shape, vocab_size=vocab_size, num_layers=extraction_layer + 1),
                      device=device, dtype=dtype, seed=seed)
    d = lm.config.hidden_size
    head = torch.nn.Linear(d, d, bias=False, dtype=torch.float32, device=device)
    torch.nn.init.eye_(head.weight)
    return ARModel(lm, head, mse_scale=resolve_target_scale("sqrt_d_model", d)).eval()


def toy_tokenizer():
    """The hub-free toy tokenizer (EOS 2, pad 0, single-token marker "§") and its marker ids."""
    from nla_shell.io.sidecars import DEFAULT_AV_TEMPLATE, token_meta
    from nla_shell.toy import builders as toy

    tokenizer = toy.train_tokenizer([CORPUS] * 4, vocab_size=512)
    tokens = token_meta(tokenizer, DEFAULT_AV_TEMPLATE, toy.DEFAULT_INJECTION_CHAR)
    return tokenizer, tokens


def make_requests(n_prompts: int, prompt_len: int, d_model: int, tokens: dict[str, int], *, vocab: int, seed: int = 0):
    """RolloutRequests: random ids (no special ids, no marker) with one marker triple, random vectors."""
    from nla_shell.engines.base import RolloutRequest

    generator = torch.Generator().manual_seed(seed)
    marker = (tokens["injection_left_neighbor_id"], tokens["injection_token_id"], tokens["injection_right_neighbor_id"])
    requests = []
    for _ in range(n_prompts):
        ids = torch.randint(3, vocab, (prompt_len,), generator=generator)
        ids[ids == marker[1]] = 3
        at = prompt_len // 3
        ids[at : at + 3] = torch.tensor(marker)
        requests.append(RolloutRequest(tuple(ids.tolist()), torch.randn(d_model, generator=generator)))
    return requests


def make_injector(actor, tokens: dict[str, int]):
    from nla_shell.models import Injector

    return Injector(actor, marker_id=tokens["injection_token_id"], left_id=tokens["injection_left_neighbor_id"],
                    right_id=tokens["injection_right_neighbor_id"])


@contextlib.contextmanager
def trainer_options(actor, *, bf16_autocast: bool, compiled: Sequence[torch.nn.Module] = ()) -> Iterator[None]:
    """The trainer's `bf16_autocast` (on the actor) and `compile_blocks` (on each of `compiled`)
    options installed for the block, as `nla train` installs them for a run; removed after."""
    from nla_shell.models import BackboneAutocast, CompiledBlockParts

    installed = [BackboneAutocast(actor, torch.bfloat16)] if bf16_autocast else []
    installed += [CompiledBlockParts(model) for model in compiled]
    try:
        yield
    finally:
        for option in installed:
            option.remove()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of fn(), with the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan


class DeviceMemoryPeak:
    """The most memory in use on the device while the block runs, by every process and allocator
    (cudaMemGetInfo's total - free, what nvidia-smi reports), sampled by a thread every `interval`
    seconds. torch's own peak counter misses other allocators and counts sleeping vLLM's unmapped
    memory; this reads what is physically taken. NaN on the CPU."""

    def __init__(self, device: torch.device, *, interval: float = 0.05) -> None:
        self.device, self.interval, self.peak_gib = device, interval, math.nan
        self._stop = None

    def _sample(self) -> float:
        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) / 2**30

    def __enter__(self) -> "DeviceMemoryPeak":
        if self.device.type != "cuda":
            return self
        import threading

        self._stop = threading.Event()
        self.peak_gib = self._sample()

        def poll():
            while not self._stop.wait(self.interval):
                self.peak_gib = max(self.peak_gib, self._sample())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self.peak_gib = max(self.peak_gib, self._sample())


def measured(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any, dict[str, float]]:
    """(seconds, result, memory) of fn() as `timed` runs it; memory: torch's peak counter over the
    call ("peak_gib") and the device's most memory in use ("in_use_gib", `DeviceMemoryPeak`)."""
    reset_peak(device)
    with DeviceMemoryPeak(device) as in_use:
        seconds, result = timed(fn, device)
    return seconds, result, {"peak_gib": peak_gib(device), "in_use_gib": in_use.peak_gib}


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "transformers": transformers.__version__}
    info["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return info


class Record:
    """The run's JSON, rewritten after every case so a crash keeps what was measured."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {**header, "cases": [], "errors": []}
        self.save()

    def add(self, case: dict[str, Any]) -> None:
        self.data["cases"].append(case)
        self.save()

    def error(self, name: str, err: BaseException) -> None:
        message = f"{name}: {type(err).__name__}: {err}"
        print(f"[error] {message}", flush=True)
        self.data["errors"].append(message)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))
