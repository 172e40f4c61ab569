"""nla_core: pure tensor functions for NLA training (torch + standard library only).

Advantages and group selection, KL estimators, token log-probs and entropies, the policy losses
(GRPO, GSPO, CISPO, on-policy) with TIS and ratio masks, and
the pieces they are composed of (surrogates, TIS weights, aggregation), marker injection, weight
renaming and LoRA merge, reconstruction/reward/FVE math, splice vectors, sidecar parsing,
splits, and rowwise-scaled FP8 matrix products.
No I/O, no logging, no device synchronisation: usable from any RL loop.
"""

from nla_core.advantages import ADVANTAGE_SCALES, best_in_group, group_advantages, group_has_variance
from nla_core.entropy import token_entropy, top_entropy_mask
from nla_core.fp8 import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, fp8_linear, fp8_linear_ste, quantize_rowwise
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
    LogprobsAndEntropy,
    SampledTokens,
    chunk_entropy,
    chunk_logit_grads,
    chunk_logprobs,
    sample_tokens,
    token_logprobs,
    token_logprobs_from_hidden,
)
from nla_core.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    TIS_MODES,
    GRPOLossOutput,
    PolicyLossOutput,
    aggregate_loss,
    grpo_loss,
    policy_loss,
)
from nla_core.ratios import gspo_token_log_ratio, ratio_band_mask, sequence_log_ratio
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
    DEFAULT_INJECTION_LAYER,
    INJECTION_CHAR_FIELD,
    INJECT_PLACEHOLDER,
    LAYER_KEYS,
    SIDECAR_KINDS,
    NLAConfig,
    actor_content,
    canonical_neighbors,
    marker_char,
    marker_content,
    parse_sidecar,
    resolve_target_scale,
    upstream_actor_template,
)
from nla_core.surrogates import Surrogate, cispo_surrogate, clip_range, onpolicy_surrogate, ppo_clip_surrogate
from nla_core.tis import CappedRatio, ISWeights, capped_ratio, tis_weights
from nla_core.splice import denormalize_activation, random_at_same_error
from nla_core.splits import HELDOUT_DOCS, HeldoutDocs, doc_disjoint_rows, spread_rows
from nla_core.weights import hf_param_name, layer_buckets, merge_lora_weight

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "AMAX_FLOOR",
    "Baselines",
    "CappedRatio",
    "ChunkKernels",
    "DEFAULT_INJECTION_LAYER",
    "E4M3_MAX",
    "FAILED_EXTRACTION_REWARD",
    "FP8_DTYPE",
    "GRPOLossOutput",
    "HELDOUT_DOCS",
    "HeldoutDocs",
    "INJECTION_CHAR_FIELD",
    "INJECTION_STYLES",
    "INJECT_PLACEHOLDER",
    "ISWeights",
    "LAYER_KEYS",
    "LogprobsAndEntropy",
    "NLAConfig",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "REWARD_KINDS",
    "SIDECAR_KINDS",
    "SampledTokens",
    "Surrogate",
    "TIS_MODES",
    "actor_content",
    "aggregate_loss",
    "best_in_group",
    "canonical_neighbors",
    "capped_ratio",
    "chunk_entropy",
    "chunk_logit_grads",
    "chunk_logprobs",
    "cispo_surrogate",
    "clip_range",
    "denormalize_activation",
    "doc_disjoint_rows",
    "extract_explanation",
    "find_injection_sites",
    "fp8_linear",
    "fp8_linear_ste",
    "fve",
    "group_advantages",
    "group_has_variance",
    "grpo_loss",
    "gspo_token_log_ratio",
    "hf_param_name",
    "hinged_length_penalty",
    "inject_norm_matched",
    "karvonen_inject",
    "kl_categorical",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "layer_buckets",
    "marker_char",
    "marker_content",
    "marker_well_formed",
    "merge_lora_weight",
    "normalize_activation",
    "onpolicy_surrogate",
    "parse_sidecar",
    "policy_loss",
    "ppo_clip_surrogate",
    "predict_mean_baselines",
    "quantize_rowwise",
    "random_at_same_error",
    "ratio_band_mask",
    "reconstruction_mse",
    "replace_at_sites",
    "resolve_target_scale",
    "reward_from_mse",
    "sample_tokens",
    "sequence_log_ratio",
    "spread_rows",
    "tis_weights",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "top_entropy_mask",
    "upstream_actor_template",
]
