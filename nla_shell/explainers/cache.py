"""A content-addressed, append-only cache of LLM replies (one JSON object per line).

key = sha256(canonical JSON of {prompt, prompt_version, the completer's settings}), so a
reply is reused only for the same prompt sent to the same model with the same sampling
settings. Each reply is appended and flushed the moment it arrives: a run killed at any
point (kill -9 included) loses at most the line being written, which the next open cuts
off, and the rerun asks only for what is not cached. Refusals are cached too (they are the
model's answer); transport failures are not (a rerun tries them again).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from nla_shell.io.data import DataError


@dataclass(frozen=True)
class Reply:
    """What a model answered to one prompt."""

    text: str | None
    """The reply's text; None when the model refused."""
    refused: bool = False
    """The provider said the model declined (Anthropic stop_reason "refusal", OpenAI refusal / content_filter)."""
    input_tokens: int = 0
    """Prompt tokens billed (the API's usage field; the local model's prompt length)."""
    output_tokens: int = 0
    """Reply tokens billed."""


def cache_key(prompt: str, settings: Mapping[str, Any]) -> str:
    """sha256 hex digest of the prompt and the settings that change the reply (sorted-key JSON)."""
    blob = json.dumps({"prompt": prompt, "settings": dict(settings)}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ReplyCache:
    """key -> Reply, loaded from and appended to a JSONL file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.replies: dict[str, Reply] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):  # a line torn by a kill: drop it before appending after it
            with self.path.open("r+b") as f:
                f.truncate(len(complete))
        for line_no, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
            try:
                entry = json.loads(line)
                key = entry.pop("key")
                self.replies[key] = Reply(**entry)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise DataError(
                    f"explainer_cache: {self.path} line {line_no} is not a cache entry; point explainer_cache at "
                    "another file or delete this one"
                ) from None

    def get(self, key: str) -> Reply | None:
        return self.replies.get(key)

    def put(self, key: str, reply: Reply) -> None:
        """Record a reply: in memory, and appended to the file at once (opened per line, so nothing is left open).

        The file is created by the first put: a run refused before it labels anything writes nothing.
        """
        self.replies[key] = reply
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, **asdict(reply)}, ensure_ascii=False) + "\n")

    def sync(self) -> None:
        """fsync the file (after a batch), so the replies also survive a machine crash."""
        if self.path.exists():
            with self.path.open("rb") as f:
                os.fsync(f.fileno())

    def __len__(self) -> int:
        return len(self.replies)
