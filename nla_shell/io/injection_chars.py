"""Per-model cache of proven injection characters: upstream's injection_token_cache.yaml.

Upstream (kitft/natural_language_autoencoders and asherps/EasyNLA,
nla/datagen/injection_tokens.py `find_injection_token`) keys a YAML file by the tokenizer's
`name_or_path`, each entry `{char, token_id}`; it writes an entry the first time it picks a
character for a tokenizer, re-checks the entry on every later read (the character must still
encode to that one token id, else it stops: a drifted id would inject at the wrong place), and
commits the file, so every run on a model injects with the same token.

nla reads that format from two files and tries the cached character first (nla_shell.pipeline.markers) (it must still pass
datagen's checks: one token in the chat-templated prompt, absent from the corpus):
- SHIPPED_CACHE, upstream's entries, in this package (read-only);
- the user cache (nla's addition, since an installed package is no place to write):
  `$NLA_INJECTION_CACHE`, default `$XDG_CACHE_HOME/nla/injection_token_cache.yaml`
  (~/.cache/...), to which datagen adds its choice after a successful run.
Also nla's: a local model dir is keyed by its absolute path (upstream keys the name as given).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from nla_shell.io.data import DataError
from nla_shell.io.files import write_text_atomically

__all__ = ["SHIPPED_CACHE", "cached_injection_char", "remember_injection_char", "user_cache_path"]

SHIPPED_CACHE = Path(__file__).resolve().parent.parent / "assets" / "injection_token_cache.yaml"
"""Upstream's entries (kitft and EasyNLA nla/datagen/injection_token_cache.yaml)."""


def user_cache_path() -> Path:
    """Where datagen records proven characters: $NLA_INJECTION_CACHE, else the XDG cache dir."""
    if os.environ.get("NLA_INJECTION_CACHE"):
        return Path(os.environ["NLA_INJECTION_CACHE"])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "nla" / "injection_token_cache.yaml"


def _read(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise DataError(f"injection-char cache {path} is not valid YAML ({err}); fix or delete it") from None
    return loaded if isinstance(loaded, dict) else {}


def _key(tokenizer: Any) -> str | None:
    name = getattr(tokenizer, "name_or_path", None) or None
    if name is not None and Path(name).is_dir():
        return str(Path(name).resolve())
    return name


def cached_injection_char(tokenizer: Any) -> str | None:
    """The cached character of this tokenizer (the user cache's, else upstream's), or None.

    DataError when the entry no longer holds: its character does not encode to its token id
    with this tokenizer (upstream stops there too).
    """
    key = _key(tokenizer)
    if key is None:
        return None
    for path in (user_cache_path(), SHIPPED_CACHE):
        entry = _read(path).get(key)
        if entry is None:
            continue
        char, token_id = entry.get("char"), entry.get("token_id")
        ids = tokenizer.encode(char, add_special_tokens=False) if isinstance(char, str) else None
        if ids != [token_id]:
            raise DataError(f"injection-char cache {path}: {key!r} maps {char!r} to token {token_id}, but this "
                            f"tokenizer encodes it as {ids}; delete that entry (the tokenizer changed) or pin the "
                            "tokenizer version")
        return char
    return None


def remember_injection_char(tokenizer: Any, char: str) -> None:
    """Record `char` (proven by datagen) for this tokenizer in the user cache, unless it has an entry.

    An existing entry stays (as upstream's does): a run whose corpus holds the cached character
    picks another for itself only. The file is replaced atomically; a tokenizer without a
    name (built in memory) is not cached.
    """
    key = _key(tokenizer)
    if key is None:
        return
    path = user_cache_path()
    cache = _read(path)
    if key in cache or key in _read(SHIPPED_CACHE):
        return
    (token_id,) = tokenizer.encode(char, add_special_tokens=False)
    cache[key] = {"char": char, "token_id": int(token_id)}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, yaml.safe_dump(cache, allow_unicode=True, sort_keys=True))
