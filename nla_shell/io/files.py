"""Small files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_text_atomically"]


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` (UTF-8) to `path` through a temp file renamed over it, so a crash never
    leaves a truncated file. The temp name is hidden and holds the process id: two processes
    writing the same file never share one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
