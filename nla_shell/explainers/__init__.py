"""Gold explanations for datagen's sites, behind one small interface.

An `Explainer` turns sampled sites (a document's text up to a token) into the text that
goes inside `<explanation>…</explanation>`:

    rule    the toy language's deterministic rule (toy corpora only)
    context a heuristic for real text: the document's topic, the speaker, the last words (context.py)
    jsonl   hand-written labels keyed by (doc_id, position); `write_sites` lists the sites
    api     an LLM behind an OpenAI-compatible or Anthropic HTTP API (api.py)
    local   a local HF instruct model (local.py)

`api` and `local` share llm.py: one versioned instruction prompt (prompt.py), a
content-addressed cache of replies (cache.py) so an interrupted run resumes without
paying twice, extraction with nla_core's regex, and a tally of what happened.
`make_explainer` builds the one a datagen config names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nla_shell.explainers.base import Explainer, ExplainerError, Site

__all__ = ["Site", "Explainer", "ExplainerError", "make_explainer", "default_cache_path"]


def default_cache_path(out_dir: str | Path) -> Path:
    """Where the api/local explainers keep their reply cache unless `explainer_cache` says otherwise."""
    return Path(out_dir) / "explainer_cache.jsonl"


def make_explainer(cfg: Any, tokenizer: Any) -> Explainer | None:
    """The explainer named by a DatagenConfig's `explainer` and `explainer_*` keys; None for "none"."""
    if cfg.explainer == "rule":
        from nla_shell.explainers.rule import RuleExplainer

        return RuleExplainer(tokenizer)
    if cfg.explainer == "context":
        from nla_shell.explainers.context import ContextExplainer

        return ContextExplainer(cfg.context_parts)
    if cfg.explainer == "jsonl":
        from nla_shell.explainers.jsonl import JsonlExplainer

        return JsonlExplainer(cfg.explanations)
    if cfg.explainer in ("api", "local"):
        from nla_shell.explainers.cache import ReplyCache
        from nla_shell.explainers.llm import LLMExplainer

        settings = dict(max_tokens=cfg.explainer_max_tokens, temperature=cfg.explainer_temperature)
        if cfg.explainer == "api":
            from nla_shell.explainers.api import ApiCompleter

            completer = ApiCompleter(
                provider=cfg.explainer_provider, model=cfg.explainer_model, base_url=cfg.explainer_base_url,
                api_key=cfg.explainer_api_key, concurrency=cfg.explainer_concurrency,
                max_retries=cfg.explainer_max_retries, timeout_s=cfg.explainer_timeout_s, **settings,
            )
        else:
            from nla_shell.explainers.local import LocalCompleter

            completer = LocalCompleter(model=cfg.explainer_model, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                                       **settings)
        cache = ReplyCache(cfg.explainer_cache or default_cache_path(cfg.out_dir))
        return LLMExplainer(completer, cache, failure_threshold=cfg.explainer_failure_threshold,
                            progress=cfg.progress)
    return None
