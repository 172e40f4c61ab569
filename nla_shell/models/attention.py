"""Causal attention after a KV cache without a materialised mask, for the shared-prefix response forward.

training/prefix.py runs each sample's R response queries after its prompt's P cached keys: query t sees
keys 0 .. P + t, causal attention aligned at the bottom right. Handed that forward's padding mask,
transformers' SDPA path materialises it as a boolean [n, 1, R, P + R] mask and, since a mask is given,
repeats every key and value head to each query head (`repeat_kv`: two copies per layer), so SDPA runs a
masked kernel on the repeated heads. Where no prompt is padded (right-padded responses are harmless:
a real query never sees a later key), the same arithmetic is `causal_lower_right(R, P + R)` on the
grouped heads as they are, which needs neither mask nor copies (run AH in bench/RESULTS.md timed both).

`lower_right_causal(lm)` turns that on for a `with` block: the model's attention implementation is
ATTENTION, registered with transformers' attention and mask interfaces, which is plain SDPA (its mask
and its function, unchanged) outside the block and for any forward that is not a cached continuation
with no padding mask. The implementation is switched once per model (`set_attn_implementation` walks
every module) and stays: outside the block it is SDPA's arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ATTENTION = "nla_lower_right_sdpa"
"""The attention implementation `lower_right_causal` switches an SDPA model to (SDPA outside its blocks)."""

_active = False
"""Inside a `lower_right_causal` block: a cached continuation without a padding mask runs lower-right causal."""


def _registered() -> None:
    """ATTENTION in transformers' attention and mask interfaces (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return

    def mask(*args, attention_mask=None, allow_is_causal_skip=True, local_size=None, q_length=None,
             kv_length=None, **kwargs):
        """No mask for a cached continuation without padding inside the block (the attention makes it
        lower-right causal); SDPA's mask otherwise."""
        if (_active and attention_mask is None and allow_is_causal_skip and local_size is None
                and q_length is not None and kv_length is not None and q_length < kv_length):
            return None
        return sdpa_mask(*args, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
                         local_size=local_size, q_length=q_length, kv_length=kv_length, **kwargs)

    AttentionInterface.register(ATTENTION, lower_right_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, mask)


def lower_right_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: inside a `lower_right_causal` block, a query block shorter than its
    keys with no mask attends lower-right causal (query t of Q sees keys 0 .. L - Q + t) on the grouped heads;
    anything else is transformers' SDPA function.

    Args: query [N, H, Q, Dh]; key, value [N, Hkv, L, Dh] with H a multiple of Hkv.
    Returns: ([N, Q, H, Dh], None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    if not (_active and attention_mask is None and 1 < q_len < kv_len and getattr(module, "is_causal", True)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, kv_len),
                                         dropout_p=dropout, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def available(lm: torch.nn.Module) -> bool:
    """Whether `lm` attends through SDPA (or already through ATTENTION): the models this block serves."""
    return lm.config._attn_implementation in ("sdpa", ATTENTION)


@contextlib.contextmanager
def lower_right_causal(lm: torch.nn.Module) -> Iterator[None]:
    """For the block, `lm`'s cached continuations with no padding mask attend lower-right causal, unmasked.

    Raises ValueError for a model that does not attend through SDPA (`available`)."""
    global _active
    if not available(lm):
        raise ValueError(f"lower-right causal attention serves SDPA models; this one runs "
                         f"{lm.config._attn_implementation!r}")
    _registered()
    if lm.config._attn_implementation != ATTENTION:
        lm.set_attn_implementation(ATTENTION)
    _active = True
    try:
        yield
    finally:
        _active = False
