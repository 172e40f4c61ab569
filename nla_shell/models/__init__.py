"""The two networks of an NLA: the actor (AV + LoRA + injection hook) and the critic (AR).

The actor puts the activation at the prompt's marker (an `Injector` on its forwards) and
explains it; the critic (an `ARModel`, the LM truncated after the extraction layer with a
value head) reads the explanation back into an activation. One module per role:

    actor.py    loading the actor, its injection hook (`Injector`), the KL reference, log-probs
    critic.py   the AR (`ARModel`, `ARLora`) and batched AR predictions
    compile.py  `BackboneAutocast` and `CompiledBlockParts`: the compiled and autocast forwards
    fp8.py      `FP8Linears`, `fp8_matmuls`: FP8 copies of frozen Linear layers for no-grad forwards
    attention.py  `attention.lower_right_causal`: unmasked causal attention after a KV cache
    common.py   checkpoint layouts, the LoRA config, padding, the HF LM under PEFT

Every public name is re-exported here (`from nla_shell.models import ARModel`).
"""

from nla_shell.models.actor import (
    LOGPROB_CHUNK_TOKENS, REFERENCE_ADAPTER, Injector, eos_token_ids, hidden_logprobs, load_actor, load_base_lm,
    load_generation_config, reference_policy, require_injection_block, response_logprobs,
)
from nla_shell.models.common import (
    AR_LORA_FILE, AR_META_FILE, VALUE_HEAD_FILE, base_model_dir, inner_lm, is_adapter_dir, is_ar_lora_dir,
    lora_config, pad_right, trainable_parameters,
)
from nla_shell.models.compile import ROTARY_FUNCTION, BackboneAutocast, CompiledBlockParts
from nla_shell.models.critic import ARLora, ARModel, ar_predict
from nla_shell.models import attention
from nla_shell.models.fp8 import FP8Linears, fp8_matmuls, require_fp8

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
    "FP8Linears",
    "Injector",
    "ar_predict",
    "attention",
    "base_model_dir",
    "eos_token_ids",
    "fp8_matmuls",
    "hidden_logprobs",
    "inner_lm",
    "is_adapter_dir",
    "is_ar_lora_dir",
    "load_actor",
    "load_base_lm",
    "load_generation_config",
    "lora_config",
    "pad_right",
    "reference_policy",
    "require_fp8",
    "require_injection_block",
    "response_logprobs",
    "trainable_parameters",
]
