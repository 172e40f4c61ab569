"""The settings of `nla explain` (ExplainConfig) and `nla serve` (ServeConfig), apart from the code that runs them.

Both extend the reader's settings (nla_shell.serving.reader.ReaderSettings). They live here so
that the modules that read them (explain.py and corpus.py; server.py and app.py) import this one
module rather than each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from nla_shell.io.config import ConfigError, normalize_fields, require
from nla_shell.serving.reader import ReaderSettings

API_KEY_ENV = "NLA_API_KEY"
"""Environment variable read for the bearer token when api_key is not given."""


@dataclass(frozen=True, kw_only=True)
class ExplainConfig(ReaderSettings):
    """Settings of `nla explain`."""

    model: str | None = None
    """Target LM whose activations are explained (HF checkpoint dir with tokenizer); not needed with parquet."""
    text: str | None = None
    """One text to read (give one of text, corpus, parquet)."""
    corpus: str | None = None
    """Documents to read, in datagen's formats (.jsonl, .txt, .parquet with a text column); needs out."""
    parquet: str | None = None
    """Rows with an `activation_vector` column (an eval split, or activations captured elsewhere); needs out."""
    out: str | None = None
    """corpus/parquet: the output parquet; OUT.parts/ holds a running (or killed) run's batches."""
    jsonl: str | None = None
    """corpus/parquet: also write the rows as JSON lines to this file, as they are explained."""
    sites: Literal["all", "sample"] = "all"
    """corpus: every position of each document, or datagen's seeded sample (with datagen's seed, positions_per_doc
    and min_context: exactly the sites datagen wrote)."""
    positions_per_doc: int = 4
    """sites=sample: positions sampled per document."""
    min_context: int | None = None
    """sites=sample: tokens before a sampled position (and the short_context flag's bound); None: the AV's training
    data's value (its sidecar provenance), else datagen's default."""
    max_seq_len: int = 512
    """corpus: documents are cut to their first max_seq_len tokens (as datagen cuts them)."""
    max_docs: int | None = None
    """corpus: read at most this many documents; None reads them all."""
    text_column: str = "text"
    """corpus: JSONL key / parquet column holding a document's text."""
    id_column: str = "id"
    """corpus: JSONL key / parquet column holding a document's id; absent -> "doc{index:06d}"."""
    position: int | None = None
    """text: token index to explain (negative counts from the end); None with all=false explains the last token."""
    all: bool = False
    """text: explain every position."""
    samples: int = 1
    """Explanations sampled per site; the one the AR reconstructs best is kept (best-of-k), all k are written."""
    batch_size: int = 64
    """corpus/parquet: sites per engine call (and per part file)."""
    max_new_tokens: int = 64
    """Longest explanation, in tokens."""
    greedy: bool = False
    """Argmax decoding instead of sampling at temperature 1 (then seed does not matter)."""
    seed: int = 0
    """Seed of the AV's sampling (and of sites=sample)."""
    overwrite: bool = False
    """corpus/parquet: start over, deleting a finished out or a killed run's OUT.parts/."""
    progress_every_s: float = 10.0
    """corpus/parquet: seconds between progress lines (sites, rate, ETA)."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        sources = [key for key in ("text", "corpus", "parquet") if getattr(self, key) is not None]
        if len(sources) != 1:
            raise ConfigError(f"config keys text, corpus and parquet: give exactly one (got {sources or 'none'})")
        if self.all and self.position is not None:
            raise ConfigError("config keys 'position' and 'all' exclude each other; give one")
        if self.text is None:
            require(self.out is not None, "out", None, f"give the output parquet path ({sources[0]} mode)")
            require(self.position is None and not self.all, "position", self.position,
                    "position and all apply to text= only; corpus/parquet explain every site")
        if self.parquet is None:
            require(self.model is not None, "model", None, "give the target LM whose activations are read")
        for key in ("samples", "batch_size", "max_new_tokens", "positions_per_doc", "max_seq_len"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "use an integer >= 1")
        require(not (self.greedy and self.samples > 1), "samples", self.samples,
                "greedy decoding gives the same explanation every time; use samples=1 or drop greedy")
        require(self.min_context is None or self.min_context >= 0, "min_context", self.min_context, "use >= 0 or null")
        require(self.max_docs is None or self.max_docs >= 1, "max_docs", self.max_docs, "use an integer >= 1 or null")



@dataclass(frozen=True, kw_only=True)
class ServeConfig(ReaderSettings):
    """Settings of `nla serve`."""

    model: str
    """Target LM whose activations /v1/explain reads (HF checkpoint dir with tokenizer)."""
    host: str = "127.0.0.1"
    """Address to bind: 127.0.0.1 serves this machine only; anything wider exposes the models (set api_key)."""
    port: int = 8000
    """TCP port; 0 picks a free one (printed at start-up)."""
    api_key: str | None = None
    """Bearer token every request but GET /v1/health must send (Authorization: Bearer KEY); None reads
    $NLA_API_KEY; unset there too: no token asked."""
    max_batch: int = 64
    """Most sites (positions or vectors, before samples) explained in one engine call."""
    batch_wait_ms: float = 5.0
    """Gathering a batch ends when no request has arrived for this long (or at max_batch sites, or at
    batch_max_wait_ms), so that under load the engine gets full batches and alone a request waits this long."""
    batch_max_wait_ms: float = 50.0
    """Longest a batch gathers after its first request, while requests keep arriving."""
    max_sites: int = 256
    """Most sites one request may ask for (positions of a text, or vectors)."""
    max_text_chars: int = 20000
    """Longest text /v1/explain accepts, in characters."""
    max_text_tokens: int = 2048
    """Longest text /v1/explain accepts, in target-LM tokens."""
    max_new_tokens: int = 64
    """Explanation length when a request gives none, in tokens."""
    max_new_tokens_limit: int = 256
    """Largest max_new_tokens a request may ask for."""
    max_samples: int = 8
    """Largest samples (explanations per site, best-of-k) a request may ask for."""
    max_body_mb: float = 32.0
    """Largest request body, in MB (10^6 bytes): a larger Content-Length, or a streamed body that grows past it,
    is answered 413 before the rest is read. 32 MB holds max_sites=256 vectors of d_model 4096 as JSON numbers;
    encoding_format=base64 needs about a fifth of that."""
    max_queue: int = 256
    """Most requests waiting for the engine (not yet started); one more is answered 503 with Retry-After at once."""
    request_timeout_s: float = 120.0
    """A request not answered within this many seconds gets 504 (its sites are dropped if not yet started); the
    server goes on."""
    continuous_batching: bool = False
    """engine=native or vllm: keep max_batch slots (sites x samples) busy, admitting waiting requests' sites between
    steps as others finish (nla_shell.serving.continuous), instead of one engine call per gathered batch
    (batch_wait_ms and batch_max_wait_ms then do not apply). native: its own decode loop, which holds its own decode
    cache and CUDA graphs (at the Qwen3-8B shape and max_batch 256, 10-21 GiB more at peak), so it is off by default;
    under load it read 19-41 % more sites/s than the batched path on one H200 (docs/serving.md, Throughput). vllm:
    the sites go to vLLM's own scheduler as slots free up; tested against a stand-in of vLLM 0.24's LLMEngine API
    only, not yet run on vLLM."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for key in ("max_batch", "max_sites", "max_text_chars", "max_text_tokens", "max_new_tokens",
                    "max_new_tokens_limit", "max_samples"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "use an integer >= 1")
        require(0 <= self.port <= 65535, "port", self.port, "use a TCP port 0..65535 (0: a free one)")
        for key in ("batch_wait_ms", "batch_max_wait_ms"):
            require(getattr(self, key) >= 0, key, getattr(self, key), "use milliseconds >= 0")
        for key in ("max_body_mb", "request_timeout_s"):
            require(getattr(self, key) > 0, key, getattr(self, key), "use a number > 0")
        require(self.max_queue >= 1, "max_queue", self.max_queue, "use an integer >= 1")
        require(self.max_new_tokens <= self.max_new_tokens_limit, "max_new_tokens", self.max_new_tokens,
                f"use at most max_new_tokens_limit = {self.max_new_tokens_limit}")
        if self.continuous_batching:
            require(self.engine in ("native", "vllm"), "continuous_batching", True,
                    f"applies to engine=native or engine=vllm (engine is {self.engine}); set one of them or drop it")
            require(self.max_samples <= self.max_batch, "max_samples", self.max_samples,
                    f"with continuous_batching a site's samples take one slot each: use at most max_batch = "
                    f"{self.max_batch}")
        require(self.api_key is None or self.api_key.strip() != "", "api_key", self.api_key,
                "give a non-empty token, or leave it unset")

    def resolved_api_key(self) -> str | None:
        """The bearer token: api_key, else $NLA_API_KEY, else None (no token asked)."""
        return self.api_key if self.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
