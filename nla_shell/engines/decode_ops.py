"""The decode steps' building blocks, shared by the native engine's two loops (native.py: a batch decoded to its
end; native_stream.py: slots that rows join and leave between steps): grouped decode attention, the per-layer
masks, the injected prompt prefill, the static cache, sampling with pre-drawn noise and the EOS test. Each runs on
the device without a host sync, so CUDA graphs can capture the steps built from them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from nla_core.logprobs import SampledTokens
from nla_shell import families
from nla_shell.models import Injector

DECODE_ATTENTION = "nla_native_decode"
"""Attention implementation the engine switches the actor to for the rollout (restored after)."""


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: grouped-query attention, without repeating KV heads.

    Prompts (query length Q > 1) go to transformers' SDPA function unchanged, unless the
    layer soft-caps its attention logits (Gemma 2), which SDPA cannot. Otherwise the
    arithmetic is the eager attention's: s = q.k * scaling in float32, s = c * tanh(s / c)
    with softcap = c, softmax over the keys the mask allows.

    Args:
      query: [N, H, Q, Dh]; key, value: [N, Hkv, L, Dh] (for decode, the whole static cache).
      attention_mask: [N, 1, Q, W] bool, True on keys to attend; only the first W <= L
        cache slots are read.
    Returns: ([N, Q, H, Dh], None).
    """
    if query.shape[2] != 1 and softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    n, heads, q_len, head_dim = query.shape
    kv_heads, window = key.shape[1], attention_mask.shape[-1]
    scale = head_dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(n, kv_heads, heads // kv_heads * q_len, head_dim)  # the g heads' queries stacked
    scores = torch.matmul(grouped, key[:, :, :window].transpose(-1, -2)).float() * scale  # [N, Hkv, g * Q, W]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(n, kv_heads, heads // kv_heads, q_len, window)
    scores = scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(n, kv_heads, -1, window)
    out = torch.matmul(probs, value[:, :, :window])  # [N, Hkv, g * Q, Dh]
    return out.view(n, heads, q_len, head_dim).transpose(1, 2), None


AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)


def final_logits(lm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's next-token logits from final hidden states [N, D] -> [N, V], soft-capped as
    the family's own forward does it (Gemma 2/3: c * tanh(z / c), in the model dtype)."""
    logits = lm.get_output_embeddings()(hidden)
    cap = families.final_logit_softcap(lm)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def layer_masks(lm: torch.nn.Module, allowed: torch.Tensor, query_slots: torch.Tensor, key_slots: torch.Tensor):
    """The attention masks to hand the backbone: `allowed` narrowed to each sliding window.

    A key at slot k is inside a query at slot q's window W iff k > q - W (slot differences
    equal position differences: a row's padding only shifts both).

    Args: allowed: [N, Q, K] bool (causal and padding); query_slots: [N, Q] or [Q]; key_slots: [K].
    Returns: {layer type: [N, 1, Q, K]} when the config names layer types, else the one [N, 1, Q, K].
    """
    def windowed(window: int | None) -> torch.Tensor:
        if window is None:
            return allowed[:, None]
        return (allowed & (key_slots > query_slots[..., None] - window))[:, None]

    windows = families.layer_windows(lm)
    layer_types = getattr(lm.config, "layer_types", None)
    if layer_types is None:
        return windowed(windows[0])  # Llama / Mistral: one kind of layer, a plain 4-D mask
    return {kind: windowed(window) for kind, window in dict(zip(layer_types, windows)).items()}


def prefill_prompts(
    lm: torch.nn.Module, injector: Injector, ids: torch.Tensor, attn: torch.Tensor, vectors: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """One injected forward over B left-padded prompts (the injection acts at each prompt's marker).

    Real tokens sit at positions 0, 1, ...; padding queries attend to themselves only, so no
    softmax row is empty and the cache holds finite values everywhere.

    Args: ids, attn: [B, W] left-padded; vectors: [B, D] float32.
    Returns: (the prompts' KV cache [B, Hkv, W, Dh] per layer, [B, V] logits of the first generated
    token, [B] slot of each prompt's first real token).
    """
    width = ids.shape[1]
    first_key = width - attn.sum(dim=1)  # [B] slot of the first real token
    slots = torch.arange(width, device=ids.device)
    causal = slots[None, :] <= slots[:, None]  # [W(q), W(k)]
    real_key = slots[None, :] >= first_key[:, None]  # [B, W(k)]
    mask = (causal[None] & real_key[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids.device)[None]
    positions = (slots[None, :] - first_key[:, None]).clamp_min(0)  # real tokens at 0, 1, ...
    prompt_cache = DynamicCache()  # no config: every layer keeps every position (no window eviction)
    with injector.inject(ids, vectors):
        hidden = families.backbone(lm)(
            input_ids=ids,
            attention_mask=layer_masks(lm, mask, slots, slots),
            position_ids=positions,
            past_key_values=prompt_cache,
            use_cache=True,
        ).last_hidden_state
    return prompt_cache, final_logits(lm, hidden[:, -1]), first_key


def static_cache(lm: torch.nn.Module, n_rows: int, length: int, layer: type[StaticLayer] = StaticLayer) -> Cache:
    """A cache of `layer`s (StaticLayer or a subclass), one per decoder block, allocated now:
    per layer [n_rows, Hkv, length, Dh] zeros in the model's dtype, on its device. Full-length
    layers for sliding-window blocks too: slots stay positions, masks apply windows."""
    config = lm.config
    cache = Cache(layers=[layer(max_cache_len=length) for _ in families.decoder_blocks(lm)])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device = next(lm.parameters()).device
    cache.early_initialization(
        batch_size=n_rows, num_heads=config.num_key_value_heads, head_dim=head_dim, dtype=lm.dtype, device=device
    )
    return cache


def sample_with_noise(logits: torch.Tensor, noise: torch.Tensor) -> SampledTokens:
    """Temperature-1 full-vocabulary sample given pre-drawn Exp(1) noise, with float32 log-probs.

    argmax(softmax(logits) / noise) is a draw from softmax(logits) (the exponential race);
    it is the arithmetic of `torch.multinomial(p, 1)`, so with noise drawn by the same
    generator the tokens equal `nla_core.sample_tokens`'s. No host sync: graph-capturable.

    Args: logits: [N, V]; noise: [N, V] float32, positive.
    Returns: SampledTokens(tokens [N] int64, logp [N] float32).
    """
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    tokens = (logp_all.exp() / noise).argmax(dim=-1)
    return SampledTokens(tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """[N] bool: tokens [N] that are any of eos [E] (a broadcast compare: no host sync, graph-capturable)."""
    return (tokens[:, None] == eos[None, :]).any(dim=-1)


def parameter_addresses(lm: torch.nn.Module) -> tuple[int, ...]:
    """The storage address of every parameter: CUDA graphs read parameters by address, so graphs captured under
    other addresses are stale."""
    return tuple(p.data_ptr() for p in lm.parameters())


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def capture_graph(step: Callable[[], None], *, pool: Any, before_capture: Callable[[], None] = lambda: None
                  ) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one decode `step`: two warm-up runs on a side stream first (lazy inits and autotuning happen
    outside the capture), then `before_capture` (e.g. counters back in range), then the capture into `pool`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph
