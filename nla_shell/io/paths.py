"""Input paths checked before any model hub call: a mistyped local path is one clear line.

`transformers.from_pretrained` treats any string that is not an existing directory as a
hub repo id: a typo such as `av/step_999` retries the hub for about a minute and ends in
a long OSError. Every command therefore checks its inputs here first. A value counts as
a hub id only in the hub's own `owner/name` form with an `owner` that is not a local
directory (`Qwen/Qwen3-8B`); anything else (`av/step_999` next to a run dir `av/`,
`./lm`, `/abs/path`, a bare `nomodel`) must exist on disk; and even a hub id must be in the
local hub cache or the hub must answer, else it is a mistyped path (`models/qwen3-tiny` with no
`models/`) and one line says so at once. A directory must hold a model (its config.json).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
import urllib.parse
from pathlib import Path

from nla_shell.io.config import ConfigError
from nla_shell.models.common import AR_META_FILE

__all__ = ["looks_like_hub_id", "require_file", "require_model"]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_STEP_DIR = re.compile(r"step_\d+")


MODEL_FILES = ("config.json", "adapter_config.json", AR_META_FILE)
"""A model directory holds one of these: an HF model, a PEFT adapter, an AR-LoRA."""
_OFF = {"1", "true", "yes", "on"}


def _hub_unreachable() -> str | None:
    """Why the model hub cannot be asked (offline mode, or no answer to a TCP connect in 3 s), or None."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _OFF:
            return f"offline ({name} is set)"
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # reached through a proxy, which a direct connect cannot try
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=3).close()
    except OSError:
        return f"unreachable ({endpoint.hostname}:{port} does not answer)"
    return None


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    # A hub repo holds a model (config.json) or an adapter (adapter_config.json).
    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in ("config.json", "adapter_config.json"))


def looks_like_hub_id(value: str) -> bool:
    """`owner/name` whose owner is not a local directory (so the user cannot have meant a path)."""
    return _HUB_ID.fullmatch(value) is not None and not Path(value.split("/")[0]).is_dir()


def _missing(key: str, path: Path, what: str) -> ConfigError:
    """'no such ...' naming the key, with the closest existing sibling when there is one."""
    parent = path.parent if str(path.parent) else Path(".")
    hint = ""
    if parent.is_dir():
        siblings = sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))
        close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.5)
        if close:
            hint = f"; did you mean {str(parent / close[0])!r}?"
    else:
        hint = f" (its directory {str(parent)!r} does not exist either)"
    return ConfigError(f"config key '{key}' = {str(path)!r}: no such {what}{hint}")


def require_file(key: str, value: str | None) -> None:
    """An existing file (a parquet, corpus, sidecar, labels file); None passes."""
    if value is None:
        return
    path = Path(value).expanduser()
    if path.is_dir():
        raise ConfigError(f"config key '{key}' = {value!r} is a directory; give the file itself")
    if not path.exists():
        raise _missing(key, path, "file")


def require_model(key: str, value: str | None, *, hub_ok: bool = True, files: tuple[str, ...] = MODEL_FILES) -> None:
    """A model/checkpoint directory that exists and holds one of `files` (or, when hub_ok, a hub id
    `owner/name` that the hub cache holds or the hub can be asked for); None passes.

    A run directory of `nla sft` / `nla train` (config.yaml and step_NNNNNN/ checkpoints)
    is refused with the checkpoint to pass instead.
    """
    if value is None:
        return
    if hub_ok and looks_like_hub_id(value):
        if _in_hub_cache(value) or (why := _hub_unreachable()) is None:
            return
        raise ConfigError(f"config key '{key}' = {value!r}: no such directory, and the model hub is {why}, so it "
                          "cannot be fetched as a hub id either; give the path of a local model directory")
    path = Path(value).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        raise ConfigError(f"config key '{key}' = {value!r} is a GGUF file; convert it once with `nla convert {value} "
                          "OUT_DIR` and pass OUT_DIR")
    if path.is_file():
        raise ConfigError(f"config key '{key}' = {value!r} is a file; give the checkpoint directory")
    if not path.is_dir():
        raise _missing(key, path, "directory")
    adapter_config = path / "adapter_config.json"
    if adapter_config.is_file():
        base = json.loads(adapter_config.read_text(encoding="utf-8")).get("base_model_name_or_path")
        if isinstance(base, str) and not looks_like_hub_id(base) and not Path(base).is_dir():
            raise ConfigError(
                f"config key '{key}' = {value!r} is a LoRA adapter whose base model {base!r} (base_model_name_or_path "
                "in its adapter_config.json) does not exist; restore that model or point the field at its new place"
            )
    steps = sorted(p for p in path.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name))
    if steps and (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        raise ConfigError(
            f"config key '{key}' = {value!r} is an nla run directory, not a checkpoint; pass one of its "
            f"checkpoints, e.g. the newest: {str(steps[-1])!r} (an `nla train` run's adapter/ or critic/ inside it)"
        )
    if not any((path / name).is_file() for name in files):
        raise ConfigError(f"config key '{key}' = {value!r} is not a model directory (no {' or '.join(files)})")
