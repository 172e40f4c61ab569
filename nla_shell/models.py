"""The two networks of an NLA: the actor (AV + LoRA + injection hook) and the critic (AR).

The actor is the AV checkpoint with a PEFT LoRA on its family's attention projections
(`families.lora_targets`: q, k, v, o; GPT-2's c_attn, c_proj). An `Injector` puts the
activation at the marker in every forward that sees the whole prompt (training, reference
and generation-prefill forwards), in one of the two upstream styles: the norm-matched add
at the output of decoder block 1, or kitft's embedding replacement; decode steps (one new
token) pass through untouched.

The critic is an `ARModel`: the LM truncated after the extraction layer, its final norm
bypassed, and a float32 `Linear(D, D)` value head on the normalised last-token hidden state.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import nla_core
from nla_shell import families, quant as quantization

VALUE_HEAD_FILE = "value_head.safetensors"
AR_LORA_FILE = "ar_lora_value_head.safetensors"
"""An AR-LoRA's trained tensors: its LoRA and value head (EasyNLA nla/train_sft.py, AR --use-lora save)."""
AR_META_FILE = "ar_meta.json"
"""How to rebuild an AR-LoRA around its frozen backbone (EasyNLA nla/train_sft.py, AR --use-lora save)."""
REFERENCE_ADAPTER = "reference"
LOGPROB_CHUNK_TOKENS = 1024
"""Tokens per chunk of the fused lm_head + log-prob: [1024, V] float32 logits (0.6 GB at
V = 152k) keep the lm_head product compute-bound, where the core's default (~27 tokens at
V = 152k) re-reads the 1.2 GB lm_head weight for every 27 tokens."""


inner_lm = families.causal_lm
"""The HF *ForCausalLM under any PEFT wrapping (the name the trainer, engines and tests use)."""


# --------------------------------------------------------------------------- injection


@dataclass
class _Batch:
    seq_len: int
    sites: torch.Tensor  # [B, 2] the prompt marker of each row
    vectors: torch.Tensor  # [B, D]


class Injector:
    """The activation injection at each row's marker, driven by `with inject(...)`.

    `style` (nla_core.INJECTION_STYLES) picks the hook: "residual_add" adds the norm-matched
    vector at the output of decoder block `layer_index` (the reference's block 1);
    "embedding_replace" replaces the marker's input embedding by the vector at L2 norm
    `injection_norm` (kitft). Either hook sees every forward over the whole prompt.

    The hook never skips a row: entering `inject` with a row that has no well-formed marker
    raises. A row whose tokens hold more than one well-formed marker (a response that echoed
    the marker between the canonical neighbours) is injected at its first one only, which
    is the prompt's, and counted in `echo_rows`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        marker_id: int,
        left_id: int,
        right_id: int,
        style: str = "residual_add",
        injection_norm: float | None = None,
        layer_index: int = 1,
    ) -> None:
        if style not in nla_core.INJECTION_STYLES:
            raise ValueError(f"injection_style={style!r}: expected one of {nla_core.INJECTION_STYLES}")
        self.marker_id, self.left_id, self.right_id = marker_id, left_id, right_id
        self.style, self.injection_norm = style, injection_norm
        self.echo_rows = 0
        self._batch: _Batch | None = None
        if style == "embedding_replace":
            # HF applies embedding scales (Gemma's sqrt(D)) inside the embedding module, so its
            # output is what kitft's hook on get_input_embeddings() overwrites.
            module = inner_lm(model).get_input_embeddings()
            self._apply = functools.partial(nla_core.replace_at_sites, norm=injection_norm)
        else:
            module = families.decoder_blocks(model)[layer_index]
            self._apply = nla_core.inject_norm_matched
        self._handle = module.register_forward_hook(self._hook)

    def remove(self) -> None:
        self._handle.remove()

    def prompt_sites(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """[B, 2] (row, position) of each row's first well-formed marker, and the echo count."""
        sites = nla_core.find_injection_sites(
            input_ids, marker_id=self.marker_id, left_id=self.left_id, right_id=self.right_id
        )
        rows = sites[:, 0]
        first = torch.ones_like(rows, dtype=torch.bool)
        first[1:] = rows[1:] != rows[:-1]
        kept = sites[first]
        if kept.shape[0] != input_ids.shape[0] or not torch.equal(
            kept[:, 0], torch.arange(input_ids.shape[0], device=kept.device)
        ):
            missing = sorted(set(range(input_ids.shape[0])) - set(kept[:, 0].tolist()))
            raise ValueError(
                f"rows {missing} of input_ids {tuple(input_ids.shape)} hold no well-formed marker "
                f"(token {self.marker_id} between {self.left_id} and {self.right_id}); every prompt "
                "needs one — check the prompt template and the sidecar's token ids"
            )
        return kept, int(sites.shape[0] - kept.shape[0])

    @contextlib.contextmanager
    def inject(self, input_ids: torch.Tensor, vectors: torch.Tensor, *, sites: torch.Tensor | None = None) -> Iterator[None]:
        """Inject vectors[b] at row b's marker in forwards over exactly these input_ids' length.

        Args: input_ids: [B, S]; vectors: [B, D], one per row; sites: [B, 2] the rows'
          `prompt_sites`, when already found (on the CPU: no device synchronisation here).
        """
        if vectors.dim() != 2 or vectors.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"need one vector per row: input_ids {tuple(input_ids.shape)}, vectors {tuple(vectors.shape)}"
            )
        if sites is None:
            sites, echoes = self.prompt_sites(input_ids)
            self.echo_rows += echoes
        self._batch = _Batch(input_ids.shape[1], sites, vectors)
        try:
            yield
        finally:
            self._batch = None

    def _hook(self, module: nn.Module, args: tuple, output):
        batch = self._batch
        resid = output[0] if isinstance(output, tuple) else output
        # Decode steps see one new token: the marker lives in the (cached) prompt.
        if batch is None or resid.shape[1] != batch.seq_len:
            return output
        # Non-blocking: sites and vectors may come from the CPU; no wait on the device queue.
        sites = batch.sites.to(resid.device, non_blocking=True)
        injected = self._apply(resid, sites, batch.vectors.to(resid.device, non_blocking=True))
        return (injected, *output[1:]) if isinstance(output, tuple) else injected


# --------------------------------------------------------------------------- actor


def eos_token_ids(generation_config, tokenizer) -> tuple[int, ...]:
    """Every token id that ends a rollout, as the reference's `generate` stops.

    generation_config.eos_token_id may be an int or a list (Qwen3 lists <|im_end|> 151645 and
    <|endoftext|> 151643); the tokenizer's eos_token_id is added when missing. Order: the
    config's ids first, deduplicated.

    Args: generation_config: a transformers GenerationConfig, or None; tokenizer: has eos_token_id.
    """
    listed = getattr(generation_config, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    if tokenizer.eos_token_id is not None:
        listed.append(tokenizer.eos_token_id)
    if not listed:
        raise ValueError("neither the generation config nor the tokenizer names an eos token id; rollouts could never end")
    return tuple(dict.fromkeys(int(t) for t in listed))


def load_generation_config(model_dir: str | Path):
    """The checkpoint's GenerationConfig: generation_config.json, else derived from config.json."""
    from transformers import AutoConfig, GenerationConfig

    model_dir = Path(model_dir)
    if (model_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_dir)
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))


def is_adapter_dir(path: str | Path) -> bool:
    """True for a PEFT LoRA adapter dir (e.g. `nla sft --mode av` output), False for a full checkpoint."""
    return (Path(path) / "adapter_config.json").exists()


def is_ar_lora_dir(path: str | Path) -> bool:
    """True for an AR-LoRA dir (EasyNLA's layout: `nla sft --mode ar ar_lora=true` output), False otherwise."""
    return (Path(path) / AR_META_FILE).exists()


def base_model_dir(ckpt: str | Path) -> Path:
    """The full model under a checkpoint: itself, the base of a LoRA adapter dir (an AV), or the
    base an AR-LoRA dir names (where its tokenizer also is)."""
    ckpt = Path(ckpt)
    if is_adapter_dir(ckpt):
        return Path(json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"])
    if is_ar_lora_dir(ckpt):
        return Path(json.loads((ckpt / AR_META_FILE).read_text()).get("base_model_name_or_path", ckpt))
    return ckpt


def lora_config(r: int, alpha: int, *, use_rslora: bool, targets: Sequence[str]):
    """The actor's adapter: LoRA on `targets` (families.lora_targets), no dropout (rsLoRA scaling
    alpha/sqrt(r) by default)."""
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM", use_rslora=use_rslora,
    )


def load_actor(
    av_ckpt: str | Path,
    *,
    lora_r: int,
    lora_alpha: int,
    use_rslora: bool,
    resume_adapter: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    gradient_checkpointing: bool = False,
    merge_sft_adapter: bool = False,
    quant: str = "none",
) -> nn.Module:
    """The trainable actor: a PEFT model whose "default" adapter is trained.

    av_ckpt is either a full HF checkpoint (a fresh rsLoRA is attached; the reference policy
    is the adapter disabled) or a LoRA adapter dir from `nla sft --mode av`: that adapter is
    continued, and a frozen copy named "reference" is the KL reference, so the reference is
    the SFT'd policy; with merge_sft_adapter it is instead merged into the base weights and a
    fresh LoRA trained on top (the reference policy: the merged SFT model, adapter disabled).
    resume_adapter, when given, replaces the trained adapter's weights.
    quant ("4bit" / "8bit") loads the frozen base quantised onto `device` (nla_shell.quant).
    """
    from peft import PeftModel, get_peft_model

    av_ckpt = Path(av_ckpt)
    base = families.load_causal_lm(
        base_model_dir(av_ckpt), dtype=dtype, **quantization.load_kwargs(quant, dtype=dtype, device=device)
    )
    if quant == "none":  # a quantised load is already on its device
        base = base.to(device)
    families.family_of(base)  # an unsupported architecture stops here, with the supported list
    if is_adapter_dir(av_ckpt) and merge_sft_adapter:
        base = PeftModel.from_pretrained(base, av_ckpt).merge_and_unload()
    continue_sft = is_adapter_dir(av_ckpt) and not merge_sft_adapter
    if gradient_checkpointing:
        # LoRA leaves the embeddings frozen; checkpointed blocks need an input that requires grad.
        base.enable_input_require_grads()
    if continue_sft:
        actor = PeftModel.from_pretrained(base, resume_adapter or av_ckpt, is_trainable=True)
        actor.load_adapter(str(av_ckpt), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        actor.set_adapter("default")
    elif resume_adapter is not None:
        actor = PeftModel.from_pretrained(base, resume_adapter, is_trainable=True)
    else:
        actor = get_peft_model(
            base, lora_config(lora_r, lora_alpha, use_rslora=use_rslora, targets=families.lora_targets(base))
        )
    if gradient_checkpointing:
        inner_lm(actor).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return actor


@contextlib.contextmanager
def reference_policy(actor: nn.Module) -> Iterator[None]:
    """The KL reference: the frozen SFT adapter when there is one, else the adapter disabled."""
    if REFERENCE_ADAPTER in getattr(actor, "peft_config", {}):
        actor.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
        try:
            yield
        finally:
            actor.set_adapter("default")
    else:
        with actor.disable_adapter():
            yield


class BackboneAutocast:
    """From construction until `remove()`, the actor's decoder backbone runs under torch.autocast(dtype).

    Every forward of the backbone (training, reference, engine prefill and decode steps, CUDA-graph
    captures) then forms its matrix products in `dtype`: on a bf16 base the float32 LoRA factors
    A [r, D], B [D', r] are cast to bf16 for x @ A.T @ B.T (float32 accumulation, float32 master
    weights and gradients), where PEFT would cast x to float32 and run float32 products. The
    log-prob head (`nla_core.token_logprobs_from_hidden`, the engines' `final_logits`) runs
    after the backbone, outside the region, in the model's dtype as before.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        lm = inner_lm(model)
        if lm.dtype != dtype:
            # The KV caches and residual stream stay in the base's dtype; autocast's keys and values would not fit them.
            raise ValueError(f"autocast to {dtype} needs a {dtype} base model; this one is {lm.dtype}")
        backbone = families.backbone(lm)
        self.device_type, self.dtype = next(model.parameters()).device.type, dtype
        self._regions: list[torch.autocast] = []
        # PEFT would cast each LoRA input to the factors' float32, only for autocast to cast it back.
        self._tuner_layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
        for layer in self._tuner_layers:
            layer.cast_input_dtype_enabled = False
        self._handles = (
            backbone.register_forward_pre_hook(self._enter),
            backbone.register_forward_hook(self._leave, always_call=True),
        )

    def _enter(self, module: nn.Module, args: tuple) -> None:
        # No cast cache: a CUDA graph must not capture a pointer to a cached cast (torch.cuda.graph docs).
        region = torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)
        region.__enter__()
        self._regions.append(region)

    def _leave(self, module: nn.Module, args: tuple, output):
        self._regions.pop().__exit__(None, None, None)
        return output

    def remove(self) -> None:
        """The backbone's and PEFT's arithmetic as they were."""
        for handle in self._handles:
            handle.remove()
        for layer in self._tuner_layers:
            layer.cast_input_dtype_enabled = True


class CompiledBlockParts:
    """From construction until `remove()`, the cache-free parts of each decoder block run compiled.

    torch.compile (dynamic shapes, so micro-batches of other lengths reuse the graphs) of every
    block's largest sub-modules that see no KV cache: the norms and the MLP (Qwen3: input /
    post-attention RMSNorm, q / k RMSNorm, SwiGLU MLP), where the eager forward launches one
    kernel per element-wise op, and with `lora_layers` PEFT's LoRA layers (base product + LoRA
    product, scaled and added: the scale and the sum fuse), and with `rotary` the rotary
    embedding the attention applies to queries and keys (eager, `rotate_half`'s cat and neg and
    four products and two sums over q and k, in the forward and again in the backward). The
    attention module itself (the cache's Python bookkeeping) stays eager: compiling whole blocks
    recompiled on every cache state. Identical layers share one compiled graph. While a CUDA graph
    is being captured (the native engine's decode) the eager forward runs, so no compilation
    happens in a capture.

    The rotary embedding is a module-level function of the model's HF modeling file
    (`apply_rotary_pos_emb`, called by name from the attention's forward), so it is swapped in
    that module, for every model of the family in the process, until the last instance that
    swapped it is removed.

    With `logprob_head` the model's fused lm_head + log-prob (`hidden_logprobs`) runs each chunk's
    float32 arithmetic compiled (`nla_core.ChunkKernels`), fused into few passes over a chunk's
    [1024, V] logits where the eager ops (cast, log-sum-exp, exp, product, scatter, cast) each make one.

    Args: model: the actor (PEFT or not) or the AR's truncated LM; backend: torch.compile's;
      lora_layers: compile the LoRA layers too (False: the norms and MLPs only, for A/B benchmarks);
      rotary: compile the rotary embedding too (False: for A/B benchmarks);
      logprob_head: compile the log-prob head's chunk arithmetic too (False: for A/B benchmarks).
    """

    def __init__(self, model: nn.Module, *, backend: str = "inductor", lora_layers: bool = True,
                 rotary: bool = True, logprob_head: bool = True) -> None:
        blocks = families.decoder_blocks(model)
        self.modules = [m for block in blocks for m in _cache_free_parts(block, lora_layers)]
        """The compiled sub-modules."""
        if any("forward" in vars(m) for m in self.modules):
            raise ValueError("the model's blocks already run compiled parts: remove() the earlier CompiledBlockParts first")
        self.rotary_homes = sorted({home for block in blocks for home in _rotary_homes(block)}, key=lambda m: m.__name__) if rotary else []
        """The modeling modules whose `apply_rotary_pos_emb` runs compiled."""
        # One forward (the RMSNorm's) serves hidden and per-head inputs, with and without grad and
        # autocast, in the actor and the AR; a LoRA layer's, projections of three shapes with the
        # adapter on and off (the reference pass): more variants than dynamo's default 8 graphs per code.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for module in self.modules:
            module.forward = _compiled_unless_capturing(module.forward, backend=backend)
        for home in self.rotary_homes:
            eager, installs = _compiled_rotaries.get(home, (getattr(home, ROTARY_FUNCTION), 0))
            if not installs:
                setattr(home, ROTARY_FUNCTION, _compiled_unless_capturing(eager, backend=backend))
            _compiled_rotaries[home] = (eager, installs + 1)
        self.head_lm = inner_lm(model) if logprob_head else None
        """The LM whose log-prob head (`hidden_logprobs`) runs compiled chunk kernels."""
        if self.head_lm is not None:
            _compiled_heads[self.head_lm] = _compiled_chunk_kernels(backend)

    def remove(self) -> None:
        """The eager forwards back (the instance attribute hid the class's forward), and the eager
        rotary embedding once no other instance compiles it."""
        for module in self.modules:
            del module.forward
        for home in self.rotary_homes:
            eager, installs = _compiled_rotaries.pop(home)
            if installs > 1:
                _compiled_rotaries[home] = (eager, installs - 1)
            else:
                setattr(home, ROTARY_FUNCTION, eager)
        self.rotary_homes = []
        if self.head_lm is not None:
            del _compiled_heads[self.head_lm]
            self.head_lm = None


ROTARY_FUNCTION = "apply_rotary_pos_emb"
"""The rotary embedding's name in HF's modeling files (Llama, Mistral, Qwen2/3, Gemma 2/3)."""

_compiled_rotaries: dict[types.ModuleType, tuple[Callable, int]] = {}
"""Modeling module -> (its eager rotary function, CompiledBlockParts instances compiling it)."""


_compiled_heads: "weakref.WeakKeyDictionary[nn.Module, nla_core.ChunkKernels]" = weakref.WeakKeyDictionary()
"""LM -> the compiled chunk kernels its `hidden_logprobs` runs, while a CompiledBlockParts holds it."""


@functools.cache
def _compiled_chunk_kernels(backend: str) -> nla_core.ChunkKernels:
    """The core's per-chunk log-prob arithmetic, compiled (one instance per backend, shared by all models)."""
    return nla_core.ChunkKernels(
        logprobs=_compiled_unless_capturing(nla_core.chunk_logprobs, backend=backend),
        logit_grads=_compiled_unless_capturing(nla_core.chunk_logit_grads, backend=backend),
    )


def _rotary_homes(block: nn.Module) -> Iterator[types.ModuleType]:
    """The modeling modules of `block`'s attention modules (they carry a `layer_idx`) that define the
    rotary function (GPT-2's, with learned positions, does not)."""
    for module in block.modules():
        home = sys.modules.get(type(module).__module__)
        if hasattr(module, "layer_idx") and home is not None and callable(getattr(home, ROTARY_FUNCTION, None)):
            yield home


def _cache_free_parts(module: nn.Module, lora_layers: bool) -> Iterator[nn.Module]:
    """The largest sub-modules of `module` with no KV-cache access and no LoRA layer inside, bare
    linears aside; with `lora_layers` the LoRA layers themselves too.

    HF attention modules (the ones that update the cache) carry a `layer_idx`; PEFT's LoRA layers
    a `cast_input_dtype_enabled`. Modules holding either are searched, never compiled whole.
    """
    for child in module.children():
        if hasattr(child, "cast_input_dtype_enabled"):
            if lora_layers:
                yield child
            continue
        if hasattr(child, "layer_idx") or any(hasattr(m, "cast_input_dtype_enabled") for m in child.modules()):
            yield from _cache_free_parts(child, lora_layers)
        elif not isinstance(child, (nn.Linear, nn.Dropout, nn.Identity)):
            yield child


def _compiled_unless_capturing(forward, *, backend: str):
    compiled = torch.compile(forward, dynamic=True, backend=backend)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return forward(*args, **kwargs) if capturing else compiled(*args, **kwargs)

    return run


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def response_logprobs(
    actor: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """log pi(targets[i, t] | input_ids[i, :positions[i, t] + 1]) without full-vocab logits.

    Runs the decoder to its last hidden states and applies the fused lm_head + log-prob
    (`nla_core.token_logprobs_from_hidden`) at the requested positions only, with the
    family's final-logit soft-capping (Gemma 2/3), as the model's own forward applies it.

    Args: input_ids, attention_mask: [n, S]; positions, targets: [n, T] (positions index S).
    Returns: [n, T] float32.
    """
    lm = inner_lm(actor)
    hidden = families.backbone(lm)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    picked = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return hidden_logprobs(lm, picked, targets)


def hidden_logprobs(lm: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(lm_head(hidden))[targets] through the fused, chunked head, with the family's
    final-logit soft-capping; each chunk's arithmetic compiled while a CompiledBlockParts holds `lm`.
    Args: hidden: [n, T, D] final hidden states; targets: [n, T]. Returns [n, T] float32."""
    return nla_core.token_logprobs_from_hidden(
        hidden, lm.get_output_embeddings().weight, targets, softcap=families.final_logit_softcap(lm),
        chunk_size=LOGPROB_CHUNK_TOKENS, kernels=_compiled_heads.get(lm, nla_core.ChunkKernels()),
    )


# --------------------------------------------------------------------------- critic


@dataclass(frozen=True)
class ARLora:
    """The LoRA an AR trains on its frozen (possibly quantised) backbone: what ar_meta.json records."""

    r: int
    """LoRA rank."""
    alpha: int
    """LoRA alpha (scaling alpha/sqrt(r) with rsLoRA, EasyNLA's only choice, else alpha/r)."""
    use_rslora: bool
    """rsLoRA scaling."""
    targets: tuple[str, ...]
    """Adapted module names (families.lora_targets)."""
    base_model: str
    """The full LM the backbone is truncated from."""
    quant: str
    """How the backbone is loaded: none, 4bit or 8bit (nla_shell.quant)."""


class ARModel(nn.Module):
    """Activation reconstructor: explanation text -> predicted activation [D].

    pred = value_head(normalize(h_last, mse_scale)), h_last the truncated backbone's hidden
    state at the last real token (final norm bypassed: the AR reads the raw residual stream
    of the extraction layer, as the activations were captured).
    """

    def __init__(self, lm: nn.Module, value_head: nn.Linear, *, mse_scale: float | None) -> None:
        super().__init__()
        self.lm = lm
        self.value_head = value_head
        self.mse_scale = mse_scale
        self.lora: ARLora | None = None
        """Set by `add_lora`: the backbone is frozen and a LoRA on it trains (EasyNLA's AR-LoRA)."""
        self._final_norm = families.final_norm(lm)
        families.set_final_norm(lm, nn.Identity())
        self.requires_grad_(True)

    def requires_grad_(self, requires_grad: bool = True) -> "ARModel":
        """What the AR trains made trainable (or everything frozen); the rest never trainable.

        Trained: the backbone and value head, or with a LoRA the LoRA and value head only.
        The bypassed final norm and the lm_head (unless tied to the embeddings) are never in
        the forward: trainable, they would cost optimizer state and, under torchrun, an
        all-reduce of zeros every step. Quantised weights are never trainable.
        """
        if self.lora is None:
            trained = {id(p) for p in (*families.backbone(self.lm).parameters(), *self.value_head.parameters())}
        else:
            trained = {id(p) for name, p in self.lm.named_parameters() if "lora_" in name}
            trained |= {id(p) for p in self.value_head.parameters()}
        for p in self.parameters():
            p.requires_grad_(requires_grad and id(p) in trained and p.is_floating_point())
        return self

    def add_lora(self, *, r: int, alpha: int, use_rslora: bool, base_model: str | Path, quant: str = "none",
                 targets: Sequence[str] | None = None) -> "ARModel":
        """Freeze the backbone and put a fresh LoRA on it (B = 0: predictions unchanged), as EasyNLA's
        `train_sft.py --mode ar --use-lora` does (peft.inject_adapter_in_model on the backbone,
        no PeftModel wrapper, so `forward` is unchanged). The way to train a quantised AR.

        base_model: the full LM the backbone was truncated from (saved with the adapter);
        quant: how the backbone was loaded; targets: default families.lora_targets.
        """
        from peft import inject_adapter_in_model

        targets = list(targets or families.lora_targets(self.lm))
        inject_adapter_in_model(lora_config(r, alpha, use_rslora=use_rslora, targets=targets), self.lm)
        self.lora = ARLora(r=r, alpha=alpha, use_rslora=use_rslora, targets=tuple(targets),
                           base_model=str(Path(base_model).resolve()), quant=quant)
        return self.requires_grad_(True)

    def merge_lora(self) -> "ARModel":
        """Fold the LoRA into the backbone's weights (W + scale * B A) and drop it: a plain AR again."""
        from peft.tuners.lora import LoraLayer

        for name, module in list(self.lm.named_modules()):
            if isinstance(module, LoraLayer):
                module.merge()
                parent, _, attr = name.rpartition(".")
                setattr(self.lm.get_submodule(parent), attr, module.get_base_layer())
        self.lora = None
        return self.requires_grad_(True)

    @property
    def num_layers(self) -> int:
        return self.lm.config.num_hidden_layers

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        mse_scale: float | None,
        extraction_layer_index: int | None = None,
        create_head: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: str = "none",
        full_precision: bool = False,
    ) -> "ARModel":
        """Load an AR dir (backbone + value_head.safetensors), or an AR-LoRA dir (ar_meta.json + the LoRA
        and value head, rebuilt around its base as it was trained, whatever `quant` says).

        With create_head=True, `path` may be any causal-LM checkpoint: it is truncated after
        `extraction_layer_index` and given an identity value head (the AR warm start).
        quant ("4bit" / "8bit") loads the backbone quantised onto `device` (frozen: see nla_shell.quant).
        full_precision rebuilds an AR-LoRA trained on a quantised backbone on the full-precision base
        instead, so the LoRA can be merged (lossy; EasyNLA's scripts/merge_lora_to_hf.py does the same).
        """
        path = Path(path)
        if is_ar_lora_dir(path):
            return cls._from_ar_lora(path, mse_scale=mse_scale, dtype=dtype, device=device, full_precision=full_precision)
        head_file = path / VALUE_HEAD_FILE
        if not head_file.exists() and not create_head:
            what = "an AV adapter" if is_adapter_dir(path) else "not an AR checkpoint"
            raise FileNotFoundError(
                f"the AR dir {path} has no {VALUE_HEAD_FILE}: it is {what}. Give a checkpoint of "
                "`nla sft --mode ar` (its save_dir/step_NNNNNN) or a co-trained critic (an nla train run's step_NNNNNN/critic)"
            )
        lm = families.load_causal_lm(
            path, dtype=dtype, **quantization.load_kwargs(quant, dtype=dtype, device=torch.device(device))
        )
        families.family_of(lm)  # an unsupported architecture stops here, with the supported list
        if extraction_layer_index is not None:
            keep = extraction_layer_index + 1
            if keep > lm.config.num_hidden_layers:
                raise ValueError(
                    f"extraction_layer_index={extraction_layer_index} but {path} has only "
                    f"{lm.config.num_hidden_layers} layers"
                )
            families.truncate_blocks(lm, keep)
        d = lm.config.hidden_size
        head = nn.Linear(d, d, bias=False, dtype=torch.float32)
        if head_file.exists():
            weight = load_file(str(head_file))["weight"]
            if weight.shape != (d, d):
                raise ValueError(f"{head_file} holds weight {tuple(weight.shape)}, expected [{d}, {d}]")
            head.weight.data.copy_(weight)
        else:
            nn.init.eye_(head.weight)
        model = cls(lm, head, mse_scale=mse_scale)
        if quant != "none":  # the quantised backbone is already on its device
            head.to(device)
            return model
        return model.to(device)

    @classmethod
    def _from_ar_lora(cls, path: Path, *, mse_scale: float | None, dtype: torch.dtype, device: torch.device | str,
                      full_precision: bool) -> "ARModel":
        """An AR-LoRA dir: its base truncated and loaded as it was trained (ar_meta.json's quant:
        the LoRA compensates that backbone's quantisation error, which is why EasyNLA refuses a
        mismatch), the LoRA and value head from ar_lora_value_head.safetensors."""
        meta_file = path / AR_META_FILE
        meta = json.loads(meta_file.read_text())
        base = meta.get("base_model_name_or_path")
        if base is None:
            raise ValueError(f"{meta_file} names no base_model_name_or_path (EasyNLA passes it as --base-ckpt); add "
                             "that key: the full LM this AR's backbone was truncated from")
        if meta.get("final_norm_stripped") is False:
            raise ValueError(f"{meta_file}: final_norm_stripped is false, but nla's AR always reads the raw residual "
                             "(final norm stripped); retrain the AR with the final norm stripped")
        quant = "none" if full_precision else meta.get("quant", "none")
        if quant != "none":
            quantization.require_quant(quant, torch.device(device), what=f"{meta_file}'s 'quant'")
        model = cls.from_pretrained(base, mse_scale=mse_scale, extraction_layer_index=meta["ar_num_layers"] - 1,
                                    create_head=True, dtype=dtype, device=device, quant=quant)
        model.add_lora(r=meta["lora_r"], alpha=meta["lora_alpha"], use_rslora=meta.get("use_rslora", True),
                       base_model=base, quant=quant, targets=meta["target_modules"])
        tensors = load_file(str(path / AR_LORA_FILE))
        own = dict(model._ar_lora_tensors())
        if tensors.keys() != own.keys():
            missing, unexpected = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
            raise ValueError(f"{path / AR_LORA_FILE} does not fit the AR that {meta_file} describes: missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}; was it written for another base model?")
        with torch.no_grad():
            for name, tensor in own.items():
                if tensor.shape != tensors[name].shape:
                    raise ValueError(f"{path / AR_LORA_FILE}: {name} is {tuple(tensors[name].shape)}, expected "
                                     f"{tuple(tensor.shape)}")
                tensor.copy_(tensors[name])
        return model

    def _ar_lora_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of what an AR-LoRA trains, named as EasyNLA's NLACriticModel names them
        (its backbone attribute is `backbone`; PEFT's LoRA keys `...q_proj.lora_A.default.weight`)."""
        for name, p in self.lm.named_parameters():
            if "lora_" in name:
                yield f"backbone.{name}", p
        yield "value_head.weight", self.value_head.weight

    def save_pretrained(self, path: str | Path) -> None:
        """A plain HF causal-LM checkpoint of the truncated backbone + value_head.safetensors; with a
        LoRA, EasyNLA's AR-LoRA layout instead (the frozen backbone is not saved): AR_LORA_FILE and
        AR_META_FILE, whose base_model_name_or_path and use_rslora keys are nla's additions."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            save_file({name: t.detach().float().cpu().contiguous() for name, t in self._ar_lora_tensors()},
                      str(path / AR_LORA_FILE))
            meta = {"ar_num_layers": self.num_layers, "lora_r": self.lora.r, "lora_alpha": self.lora.alpha,
                    "quant": self.lora.quant, "target_modules": list(self.lora.targets), "final_norm_stripped": True,
                    "base_model_name_or_path": self.lora.base_model, "use_rslora": self.lora.use_rslora}
            (path / AR_META_FILE).write_text(json.dumps(meta, indent=2))
            return
        identity = families.final_norm(self.lm)
        families.set_final_norm(self.lm, self._final_norm)
        try:
            self.lm.save_pretrained(path)
        finally:
            families.set_final_norm(self.lm, identity)
        save_file({"weight": self.value_head.weight.detach().float().cpu().contiguous()}, str(path / VALUE_HEAD_FILE))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Args: input_ids, attention_mask: [B, S] (any padding side). Returns: [B, D] float32."""
        hidden = families.backbone(self.lm)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = torch.where(attention_mask.bool(), positions, -1).amax(dim=1)
        h_last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
        return self.value_head(nla_core.normalize_activation(h_last, self.mse_scale))


def pad_right(
    sequences: Sequence[Sequence[int] | torch.Tensor], pad_id: int, device: torch.device, *, min_width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists or 1-D id tensors -> ([n, S] ids, [n, S] attention mask), padded on the right
    to S = max(min_width, longest)."""
    width = max(min_width, max(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids.to(device), mask.to(device)


def ar_predict(
    ar: ARModel,
    token_lists: Sequence[Sequence[int]],
    *,
    pad_id: int,
    micro_batch: int,
    device: torch.device,
) -> torch.Tensor:
    """Batched AR predictions for many AR inputs. Returns [N, D] float32 (no grad)."""
    preds = []
    with torch.no_grad():
        for start in range(0, len(token_lists), micro_batch):
            ids, mask = pad_right(token_lists[start : start + micro_batch], pad_id, device)
            preds.append(ar(ids, mask))
    return torch.cat(preds) if preds else torch.zeros(0, ar.value_head.in_features)
