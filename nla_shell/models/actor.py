"""The actor: the AV checkpoint with a PEFT LoRA, its injection hook, and its log-probs.

The actor is the AV checkpoint with a PEFT LoRA on its family's attention projections
(`families.lora_targets`: q, k, v, o; GPT-2's c_attn, c_proj). An `Injector` puts the
activation at the marker in every forward that sees the whole prompt (training, reference
and generation-prefill forwards), in one of the two upstream styles: the norm-matched add
at the output of decoder block 1, or kitft's embedding replacement; decode steps (one new
token) pass through untouched.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

import nla_core
from nla_shell import families, quant as quantization
from nla_shell.io.sidecars import Injection
from nla_shell.models.common import base_model_dir, inner_lm, is_adapter_dir, lora_config
from nla_shell.models.compile import _compiled_heads

REFERENCE_ADAPTER = "reference"
LOGPROB_CHUNK_TOKENS = 1024
"""Tokens per chunk of the fused lm_head + log-prob: [1024, V] float32 logits (0.6 GB at
V = 152k) keep the lm_head product compute-bound, where the core's default (~27 tokens at
V = 152k) re-reads the 1.2 GB lm_head weight for every 27 tokens."""


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
        self.style, self.injection_norm, self.layer_index = style, injection_norm, layer_index
        self.echo_rows = 0
        self._batch: _Batch | None = None
        if style == "embedding_replace":
            # HF applies embedding scales (Gemma's sqrt(D)) inside the embedding module, so its
            # output is what kitft's hook on get_input_embeddings() overwrites.
            module = inner_lm(model).get_input_embeddings()
            self._apply = functools.partial(nla_core.replace_at_sites, norm=injection_norm)
        else:
            blocks = families.decoder_blocks(model)
            check_injection_block(layer_index, len(blocks))
            module = blocks[layer_index]
            self._apply = nla_core.inject_norm_matched
        self._handle = module.register_forward_hook(self._hook)

    @classmethod
    def for_sidecar(cls, model: nn.Module, nla: nla_core.NLAConfig, injection: Injection) -> "Injector":
        """The injector of an AV described by sidecar `nla` (its marker and neighbour ids), injecting as `injection`
        (nla_shell.io.sidecars.injection_settings) says."""
        return cls(model, marker_id=nla.injection_token_id, left_id=nla.injection_left_neighbor_id,
                   right_id=nla.injection_right_neighbor_id, style=injection.style, injection_norm=injection.norm,
                   layer_index=injection.layer)

    @property
    def injection(self) -> Injection:
        return Injection(self.style, self.injection_norm, self.layer_index)

    def vllm_kwargs(self) -> dict[str, object]:
        """This injection as VLLMRolloutEngine's keywords: the marker and its neighbours, the block, style and norm
        (the engine's steering plugin applies them in vLLM's graph)."""
        return {"marker_id": self.marker_id, "left_id": self.left_id, "right_id": self.right_id,
                "injection_layer": self.layer_index, "injection_style": self.style, "injection_norm": self.injection_norm}

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


def check_injection_block(layer: int, blocks: int, *, model: str | Path = "the AV") -> None:
    """residual_add's block index within the model's `blocks` decoder blocks; ValueError naming the key otherwise."""
    if not 0 <= layer < blocks:
        raise ValueError(f"injection_layer={layer}: {model} has {blocks} decoder blocks; give a block index in "
                         f"0..{blocks - 1}")


def require_injection_block(model_dir: str | Path, injection: Injection) -> None:
    """An Injection's block checked against the model's config (nothing loaded), before a run writes."""
    if injection.style == "residual_add":
        check_injection_block(injection.layer, families.block_count(model_dir), model=model_dir)


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


def load_base_lm(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device,
                 quant: str = "none") -> nn.Module:
    """The HF causal LM of `model_dir` on `device` (quant "4bit" / "8bit": loaded quantised there, nla_shell.quant),
    its family checked: an unsupported architecture stops here, with the supported list."""
    lm = families.load_causal_lm(model_dir, dtype=dtype, **quantization.load_kwargs(quant, dtype=dtype, device=device))
    if quant == "none":  # a quantised load is already on its device
        lm = lm.to(device)
    families.family_of(lm)
    return lm


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
    lora_targets: Sequence[str] = (),
) -> nn.Module:
    """The trainable actor: a PEFT model whose "default" adapter is trained.

    av_ckpt is either a full HF checkpoint (a fresh rsLoRA is attached; the reference policy
    is the adapter disabled) or a LoRA adapter dir from `nla sft --mode av`: that adapter is
    continued, and a frozen copy named "reference" is the KL reference, so the reference is
    the SFT'd policy; with merge_sft_adapter it is instead merged into the base weights and a
    fresh LoRA trained on top (the reference policy: the merged SFT model, adapter disabled).
    resume_adapter, when given, replaces the trained adapter's weights.
    quant ("4bit" / "8bit") loads the frozen base quantised onto `device` (nla_shell.quant).
    lora_targets: the modules a fresh LoRA adapts (families.lora_targets; none: the family's attention).
    """
    from peft import PeftModel, get_peft_model

    av_ckpt = Path(av_ckpt)
    base = load_base_lm(base_model_dir(av_ckpt), dtype=dtype, device=device, quant=quant)
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
            base, lora_config(lora_r, lora_alpha, use_rslora=use_rslora,
                              targets=families.lora_targets(base, lora_targets))
        )
    if gradient_checkpointing:
        lm = inner_lm(actor)
        # transformers 5.2x renamed it (the old name warns of its removal in v6); older releases have the old name only.
        if hasattr(lm, "activation_checkpointing_enable"):
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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


def response_logprobs(
    actor: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: bool = False,
) -> torch.Tensor | nla_core.LogprobsAndEntropy:
    """log pi(targets[i, t] | input_ids[i, :positions[i, t] + 1]) without full-vocab logits.

    Runs the decoder to its last hidden states and applies the fused lm_head + log-prob
    (`nla_core.token_logprobs_from_hidden`) at the requested positions only, with the
    family's final-logit soft-capping (Gemma 2/3), as the model's own forward applies it.

    Args: input_ids, attention_mask: [n, S]; positions, targets: [n, T] (positions index S);
      with_entropy: also each position's policy entropy, from the same pass (`hidden_logprobs`).
    Returns: [n, T] float32; with_entropy: LogprobsAndEntropy of two [n, T] (the entropy detached).
    """
    lm = inner_lm(actor)
    hidden = families.backbone(lm)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    picked = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return hidden_logprobs(lm, picked, targets, with_entropy=with_entropy)


def hidden_logprobs(
    lm: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False
) -> torch.Tensor | nla_core.LogprobsAndEntropy:
    """log softmax(lm_head(hidden))[targets] through the fused, chunked head, with the family's
    final-logit soft-capping; each chunk's arithmetic compiled while a CompiledBlockParts holds `lm`.
    with_entropy: also the entropy of each position's softmax, from the same chunk's logits (no second
    lm_head product). Args: hidden: [n, T, D] final hidden states; targets: [n, T]. Returns [n, T] float32,
    or with_entropy LogprobsAndEntropy(logp, entropy) of two [n, T] (entropy detached)."""
    return nla_core.token_logprobs_from_hidden(
        hidden, lm.get_output_embeddings().weight, targets, softcap=families.final_logit_softcap(lm),
        chunk_size=LOGPROB_CHUNK_TOKENS, kernels=_compiled_heads.get(lm, nla_core.ChunkKernels()),
        with_entropy=with_entropy,
    )
