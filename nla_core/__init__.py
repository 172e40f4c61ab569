"""nla_core: pure tensor functions for NLA training (torch + standard library only).

Advantages, KL estimators, token log-probs, the GRPO/TIS loss, marker injection, weight
renaming and LoRA merge, reconstruction/reward/FVE math, splice vectors, sidecar parsing and
splits.
No I/O, no logging, no device synchronisation: usable from any RL loop.
"""

from nla_core.advantages import ADVANTAGE_SCALES, group_advantages
from nla_core.injection import (
    INJECTION_STYLES,
    find_injection_sites,
    inject_norm_matched,
    karvonen_inject,
    marker_well_formed,
    replace_at_sites,
)
from nla_core.kl import kl_categorical, kl_k1, kl_k2, kl_k3
from nla_core.logprobs import (
    ChunkKernels,
    SampledTokens,
    chunk_logit_grads,
    chunk_logprobs,
    sample_tokens,
    token_logprobs,
    token_logprobs_from_hidden,
)
from nla_core.losses import AGGREGATIONS, TIS_MODES, GRPOLossOutput, aggregate_loss, grpo_loss
from nla_core.reconstruction import (
    FAILED_EXTRACTION_REWARD,
    REWARD_KINDS,
    Baselines,
    extract_explanation,
    fve,
    hinged_length_penalty,
    normalize_activation,
    predict_mean_baselines,
    reconstruction_mse,
    reward_from_mse,
)
from nla_core.sidecar import (
    INJECT_PLACEHOLDER,
    NLAConfig,
    actor_content,
    canonical_neighbors,
    parse_sidecar,
    resolve_target_scale,
    upstream_actor_template,
)
from nla_core.splice import denormalize_activation, random_at_same_error
from nla_core.splits import doc_disjoint_rows
from nla_core.weights import hf_param_name, layer_buckets, merge_lora_weight

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "Baselines",
    "ChunkKernels",
    "FAILED_EXTRACTION_REWARD",
    "GRPOLossOutput",
    "INJECTION_STYLES",
    "INJECT_PLACEHOLDER",
    "NLAConfig",
    "REWARD_KINDS",
    "SampledTokens",
    "TIS_MODES",
    "actor_content",
    "aggregate_loss",
    "canonical_neighbors",
    "chunk_logit_grads",
    "chunk_logprobs",
    "denormalize_activation",
    "doc_disjoint_rows",
    "extract_explanation",
    "find_injection_sites",
    "fve",
    "group_advantages",
    "grpo_loss",
    "hf_param_name",
    "hinged_length_penalty",
    "inject_norm_matched",
    "karvonen_inject",
    "kl_categorical",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "layer_buckets",
    "marker_well_formed",
    "merge_lora_weight",
    "normalize_activation",
    "parse_sidecar",
    "predict_mean_baselines",
    "random_at_same_error",
    "reconstruction_mse",
    "replace_at_sites",
    "resolve_target_scale",
    "reward_from_mse",
    "sample_tokens",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "upstream_actor_template",
]
