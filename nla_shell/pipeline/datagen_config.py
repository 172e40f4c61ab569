"""`nla datagen`'s settings: the DatagenConfig schema (one field per key, each with its docstring), the checks
the types cannot express, and mse_scale as the sidecars write it. How any config is read (YAML, flags, key=value
overrides, coercion, one-line errors) is nla_shell.io.config's; the run is nla_shell.pipeline.datagen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nla_core import actor_content, resolve_target_scale
from nla_shell.explainers import context as context_label
from nla_shell.io.config import ConfigError, normalize_fields, require
from nla_shell.io.sidecars import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE

__all__ = ["DatagenConfig"]


@dataclass(frozen=True, kw_only=True)
class DatagenConfig:
    """Settings of `nla datagen`."""

    model: str
    """Target LM: an HF causal-LM checkpoint dir with its tokenizer."""
    corpus: str
    """Documents: .jsonl (one object per line), .txt (documents separated by blank lines) or .parquet."""
    layer: int
    """K: activations are the residual stream at the output of block K (HF hidden_states[K+1])."""
    out_dir: str
    """Where the parquets and sidecars go."""
    text_column: str = "text"
    """JSONL key / parquet column holding a document's text."""
    id_column: str = "id"
    """JSONL key / parquet column holding a document's id; absent -> "doc{index:06d}"."""
    explainer: Literal["api", "local", "jsonl", "rule", "context", "none"] | None = None
    """Gold explanations (must be chosen): an LLM API, a local HF model, a JSONL file (`explanations`), the toy
    language's rule (toy corpora only), the context heuristic for real text (the document's `topic`, the
    speaker, the last words: nla_shell/explainers/context.py), or none (rl split only). Not needed with
    write_sites."""
    context_parts: tuple[str, ...] = context_label.PARTS
    """explainer=context: the label's parts in order, from topic, speaker and ending (the quoted last words); an
    nla addition (nla_shell/explainers/context.py says why the ending comes last)."""
    explanations: str | None = None
    """JSONL of {"doc_id", "position", "explanation"} objects (explainer=jsonl); write_sites lists the keys."""
    write_sites: str | None = None
    """Instead of datasets, write the sites that need an explanation (the av_sft/ar_sft/eval splits) to this JSONL:
    {"doc_id", "position", "split", "token", "context"} per line; add "explanation" and pass it as explanations=."""
    explainer_provider: Literal["openai", "anthropic"] = "openai"
    """explainer=api: an OpenAI-compatible chat-completions endpoint or the Anthropic messages API."""
    explainer_model: str | None = None
    """explainer=api: the model name; explainer=local: an HF instruct-model checkpoint dir."""
    explainer_base_url: str | None = None
    """explainer=api: API base URL; None reads OPENAI_BASE_URL / ANTHROPIC_BASE_URL, then the provider's own."""
    explainer_api_key: str | None = None
    """explainer=api: API key; None reads OPENAI_API_KEY / ANTHROPIC_API_KEY (never written to any file)."""
    explainer_max_tokens: int = 300
    """Longest explanation reply, in tokens (a reply cut off before </explanation> is dropped)."""
    explainer_temperature: float | None = 1.0
    """Sampling temperature of the explainer LLM (0: greedy; null: the model's default, for APIs that reject it)."""
    explainer_concurrency: int = 16
    """explainer=api: requests in flight at once."""
    explainer_max_retries: int = 6
    """explainer=api: retries of a request answered 408/409/429/5xx or lost, with backoff (Retry-After honoured)."""
    explainer_timeout_s: float = 120.0
    """explainer=api: seconds to wait for one answer."""
    explainer_failure_threshold: float = 0.2
    """Stop the run when more than this share of a batch's requests fail after retries (refusals do not count)."""
    explainer_batch_size: int = 64
    """Sites labelled per explainer call: the local model's generation batch, the API's unit of the failure check."""
    explainer_cache: str | None = None
    """explainer=api/local: the reply cache (JSONL); None uses out_dir/explainer_cache.jsonl. Reruns reuse it."""
    positions_per_doc: int = 4
    """Token positions sampled per document (fewer when the document has fewer eligible)."""
    min_context: int = 4
    """A sampled position has at least this many tokens before it; shorter documents are skipped."""
    max_seq_len: int = 512
    """Documents are cut to their first max_seq_len tokens."""
    max_docs: int | None = None
    """Read at most this many documents; None reads them all."""
    av_sft_fraction: float = 0.3
    """Share of documents whose rows go to av_sft.parquet."""
    ar_sft_fraction: float = 0.3
    """Share of documents whose rows go to ar_sft.parquet."""
    eval_fraction: float = 0.1
    """Share of documents whose rows go to eval.parquet; the rest go to rl.parquet."""
    av_template: str = DEFAULT_AV_TEMPLATE
    """AV user-message template holding {injection_char} (upstream's style; literal braces as {{ }}) or <INJECT>."""
    ar_template: str = DEFAULT_AR_TEMPLATE
    """AR input template; must hold {explanation}."""
    mse_scale: str = "sqrt_d_model"
    """Sidecar extraction.mse_scale: "sqrt_d_model", "none", or a number."""
    injection_char: str | None = None
    """The injection char (used as given, or a DataError says why it cannot be): one character, or a space and
    one for a token that carries its leading space (it then covers the space before <INJECT>); None lets
    datagen choose (`㈎` first for Qwen, see INJECTION_CHAR_CANDIDATES and nla_shell.pipeline.markers)."""
    batch_size: int = 16
    """Documents per forward pass."""
    row_group_size: int = 1024
    """Parquet row-group size."""
    seed: int = 0
    """Seed of the position sampling, of the document split, and of python's, numpy's and torch's global
    RNGs (which a sampling explainer draws from)."""
    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype for the forward ("auto": bf16 on cuda, fp32 on cpu); activations are stored as float32."""
    overwrite: bool = False
    """Replace datasets already in out_dir (or the write_sites file)."""
    progress: bool = True
    """Show a progress bar (on a terminal only; --no-progress hides it)."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for key in ("positions_per_doc", "max_seq_len", "batch_size", "row_group_size", "explainer_max_tokens",
                    "explainer_concurrency", "explainer_batch_size"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "use an integer >= 1")
        require(self.layer >= 0, "layer", self.layer, "use a block index >= 0")
        require(self.min_context >= 1, "min_context", self.min_context, "use an integer >= 1")
        require(self.max_docs is None or self.max_docs >= 1, "max_docs", self.max_docs, "use an integer >= 1 or null")
        fractions = [self.av_sft_fraction, self.ar_sft_fraction, self.eval_fraction]
        for key, value in zip(("av_sft_fraction", "ar_sft_fraction", "eval_fraction"), fractions):
            require(0 <= value <= 1, key, value, "use a fraction in [0, 1]")
        require(sum(fractions) < 1, "eval_fraction", self.eval_fraction,
                 f"the split fractions sum to {sum(fractions):g}; leave a share > 0 for rl")
        try:
            actor_content(self.av_template, key="av_template")
        except ValueError as err:
            raise ConfigError(f"config key 'av_template' = {self.av_template!r} is invalid: {err}") from None
        require("{explanation}" in self.ar_template, "ar_template", self.ar_template, "include {explanation}")
        try:
            resolve_target_scale(_sidecar_scale(self.mse_scale), 1)
        except ValueError as err:
            raise ConfigError(f"config key 'mse_scale' = {self.mse_scale!r} is invalid: {err}") from None
        require(self.explainer is not None or self.write_sites is not None, "explainer", None,
                 "choose api (an LLM API), local (a local HF model), jsonl (your labels), context (a heuristic for "
                 "real text), rule (the toy language only) or none (rl split only); or write_sites=FILE to list the sites to label")
        require(bool(self.context_parts) and len(set(self.context_parts)) == len(self.context_parts)
                and set(self.context_parts) <= set(context_label.PARTS), "context_parts", self.context_parts,
                "name each of topic, speaker, ending at most once, at least one (e.g. topic,speaker,ending)")
        if self.explainer == "jsonl":
            require(self.explanations is not None, "explanations", None, "give the JSONL path (explainer=jsonl)")
        if self.explainer in ("api", "local"):
            require(self.explainer_model is not None, "explainer_model", None,
                     "name the model (explainer=api) or give its checkpoint dir (explainer=local)")
        require(self.explainer_max_retries >= 0, "explainer_max_retries", self.explainer_max_retries, "use >= 0")
        require(self.explainer_temperature is None or self.explainer_temperature >= 0, "explainer_temperature",
                 self.explainer_temperature, "use >= 0, or null for the model's default")
        require(self.explainer_timeout_s > 0, "explainer_timeout_s", self.explainer_timeout_s, "use seconds > 0")
        require(0 <= self.explainer_failure_threshold < 1, "explainer_failure_threshold",
                 self.explainer_failure_threshold, "use a fraction in [0, 1)")
        if self.explainer == "none":
            require(sum(fractions) == 0, "explainer", "none",
                     "set av_sft_fraction, ar_sft_fraction and eval_fraction to 0 (they need explanations)")


def _sidecar_scale(raw: str) -> str | float | None:
    """The config's mse_scale string as the sidecar writes it (numbers as numbers, "none" as null)."""
    if raw.strip().lower() in ("none", "raw", "null"):
        return None
    try:
        return float(raw)
    except ValueError:
        return raw
