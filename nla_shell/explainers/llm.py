"""Explanations written by an LLM (API or local): prompt -> cache -> completer -> extraction -> tally.

For each batch of sites: build the instruction prompts, take every reply already in the
cache, send the rest (each distinct prompt once) to the completer, which hands back each
reply as it arrives so it is cached at once. Then a refusal, or a reply without a
non-empty <explanation>, leaves its site without a label (the row is dropped and counted).
A batch in which more than `failure_threshold` of the requests failed after their retries
is a systemic failure (network, key, quota): the run stops with the first error, and
everything answered so far stays cached for the rerun (EasyNLA's providers.py treats
>20 % retry-exhausted requests in a chunk the same way; refusals do not count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from nla_shell.explainers.base import ExplainerError, Site
from nla_shell.explainers.cache import Reply, ReplyCache, cache_key
from nla_shell.explainers.prompt import PROMPT_VERSION, api_summaries, instruction_prompt, parse_reply
from nla_shell.io.progress import say_line


class Completer(Protocol):
    """Sends prompts to a model; the api and local explainers differ only here."""

    model: str
    """The model's name (API) or checkpoint dir (local), as the sidecar records it."""
    max_tokens: int
    """Longest reply, in tokens."""
    temperature: float | None
    """Sampling temperature (0: greedy; None: the model's default)."""

    def settings(self) -> Mapping[str, Any]:
        """Everything besides the prompt that changes the reply (part of every cache key)."""
        ...

    def complete(self, prompts: Sequence[str], on_reply: Callable[[int, Reply], None]) -> dict[int, str]:
        """Ask for every prompt; call on_reply(i, reply) as each arrives. Returns {i: error} for the failed ones.

        Raises ExplainerError for errors that retrying cannot fix (bad key, unknown model).
        """
        ...


@dataclass
class Tally:
    """What happened to the sites so far (mutable counters)."""

    sites: int = 0
    """Sites asked for."""
    labelled: int = 0
    """Sites that got an explanation."""
    cached: int = 0
    """Sites answered from the cache (no request)."""
    answered: int = 0
    """Distinct uncached prompts the model answered in this run (refusals included)."""
    refused: int = 0
    """Sites whose model declined to answer."""
    failed: int = 0
    """Sites whose request failed after all retries."""
    unextractable: int = 0
    """Sites whose reply held no non-empty <explanation>…</explanation>."""
    input_tokens: int = 0
    """Prompt tokens of the replies received in this run (the API's usage)."""
    output_tokens: int = 0
    """Reply tokens of the replies received in this run."""

    def line(self) -> str:
        return (f"{self.sites} sites ({self.cached} from cache, {self.answered} answered now): {self.labelled} labelled, "
                f"{self.refused} refused, {self.failed} failed, {self.unextractable} unextractable; "
                f"tokens {self.input_tokens} in / {self.output_tokens} out")


class LLMExplainer:
    """An Explainer over a Completer, with the reply cache, the failure threshold and a tally."""

    def __init__(self, completer: Completer, cache: ReplyCache, *, failure_threshold: float = 0.2,
                 progress: bool = True) -> None:
        self.completer, self.cache = completer, cache
        self.failure_threshold = failure_threshold
        self.progress = progress
        self.settings = {"prompt_version": PROMPT_VERSION, **completer.settings()}
        self.tally = Tally()

    def explain(self, sites: Sequence[Site]) -> list[str | None]:
        # --- prompts and cache hits ------------------------------------------------------------
        prompts = [instruction_prompt(s.context, s.token) for s in sites]
        keys = [cache_key(p, self.settings) for p in prompts]
        replies: dict[str, Reply] = {k: r for k in keys if (r := self.cache.get(k)) is not None}
        self.tally.sites += len(sites)
        self.tally.cached += sum(k in replies for k in keys)
        missing = list(dict.fromkeys(k for k in keys if k not in replies))  # each distinct prompt once
        prompt_of = dict(zip(keys, prompts))

        # --- ask for the rest, caching each reply as it arrives ----------------------------------
        def on_reply(i: int, reply: Reply) -> None:
            self.cache.put(missing[i], reply)
            replies[missing[i]] = reply
            self.tally.input_tokens += reply.input_tokens
            self.tally.output_tokens += reply.output_tokens

        failures = self.completer.complete([prompt_of[k] for k in missing], on_reply) if missing else {}
        self.cache.sync()
        self.tally.answered += len(missing) - len(failures)
        if missing and len(failures) > self.failure_threshold * len(missing):
            first = failures[min(failures)]
            raise ExplainerError(
                f"explainer: {len(failures)} of {len(missing)} requests failed after retries (more than "
                f"explainer_failure_threshold = {self.failure_threshold:g}), e.g. {first}; this looks systemic "
                f"(network, key, quota). The {len(self.cache)} replies so far are cached in {self.cache.path}: "
                "fix the cause and run the same command to resume"
            )

        # --- extraction ---------------------------------------------------------------------
        out: list[str | None] = []
        for key in keys:
            reply = replies.get(key)
            explanation = None if reply is None or reply.text is None else parse_reply(reply.text)
            self.tally.failed += reply is None
            self.tally.refused += reply is not None and reply.refused
            self.tally.unextractable += reply is not None and not reply.refused and explanation is None
            self.tally.labelled += explanation is not None
            out.append(explanation)
        if self.progress:
            say_line(f"[explainer] {self.tally.line()}")
        return out

    def finish(self) -> None:
        hint = ""
        if self.tally.unextractable:
            hint = (f"; replies without <explanation>…</explanation> were dropped (raise explainer_max_tokens = "
                    f"{self.completer.max_tokens} if they were cut off)")
        print(f"[explainer] {self.tally.line()}{hint}; cache {self.cache.path}", flush=True)

    def sidecar_summary(self) -> dict[str, Any]:
        return api_summaries(model=self.completer.model, max_tokens=self.completer.max_tokens,
                             temperature=self.completer.temperature)
