"""The two networks of an NLA: the actor (AV + LoRA + injection hook) and the critic (AR).

The actor is the AV checkpoint with a PEFT LoRA on its family's attention projections
(`families.lora_targets`: q, k, v, o; GPT-2's c_attn, c_proj). An `Injector` puts the
activation at the marker in every forward that sees the whole prompt (training, reference
and generation-prefill forwards), in one of the two upstream styles: the norm-matched add
at the output of decoder block 1, or kitft's embedding replacement; decode steps (one new
token) pass through untouched.

The critic is an `ARModel`: the LM truncated after the extraction layer, its final norm
bypassed, and a float32 `Linear(D, D)` value head on the normalised last-token hidden state.

    actor.py    loading the actor, its injection hook (`Injector`), the KL reference, log-probs
    critic.py   the AR (`ARModel`, `ARLora`) and batched AR predictions
    compile.py  `BackboneAutocast` and `CompiledBlockParts`: the compiled and autocast forwards
    common.py   checkpoint layouts, the LoRA config, padding, the HF LM under PEFT
"""

from nla_shell.models.actor import (
    LOGPROB_CHUNK_TOKENS, REFERENCE_ADAPTER, Injector, eos_token_ids, hidden_logprobs, load_actor,
    load_generation_config, reference_policy, response_logprobs,
)
from nla_shell.models.common import (
    AR_LORA_FILE, AR_META_FILE, VALUE_HEAD_FILE, base_model_dir, inner_lm, is_adapter_dir, is_ar_lora_dir,
    lora_config, pad_right, trainable_parameters,
)
from nla_shell.models.compile import ROTARY_FUNCTION, BackboneAutocast, CompiledBlockParts
from nla_shell.models.critic import ARLora, ARModel, ar_predict

__all__ = [
    "AR_LORA_FILE",
    "AR_META_FILE",
    "LOGPROB_CHUNK_TOKENS",
    "REFERENCE_ADAPTER",
    "ROTARY_FUNCTION",
    "VALUE_HEAD_FILE",
    "ARLora",
    "ARModel",
    "BackboneAutocast",
    "CompiledBlockParts",
    "Injector",
    "ar_predict",
    "base_model_dir",
    "eos_token_ids",
    "hidden_logprobs",
    "inner_lm",
    "is_adapter_dir",
    "is_ar_lora_dir",
    "load_actor",
    "load_generation_config",
    "lora_config",
    "pad_right",
    "reference_policy",
    "response_logprobs",
    "trainable_parameters",
]
