"""Sidecar files: find, read and write the `nla_meta.yaml` of datasets and checkpoints.

The one place that touches sidecar YAML. The layout is upstream's (kitft
natural_language_autoencoders nla/schema.py, nla/datagen/sidecar.py, nla/config.py;
docs/sidecar.md): a dataset's sidecar is `<parquet>.nla_meta.yaml`, a checkpoint's is
`<dir>/nla_meta.yaml`. Parsing every variant is `nla_core.parse_sidecar`; this module
resolves paths, reads YAML into an NLAConfig and writes mappings upstream readers accept.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import yaml

import nla_core
from nla_core import NLAConfig, canonical_neighbors, parse_sidecar, resolve_target_scale, upstream_actor_template
from nla_shell.io.data import DataError, av_prompt_messages, chat_prompt_ids
from nla_shell.io.files import write_text_atomically

__all__ = [
    "DEFAULT_AR_TEMPLATE",
    "DEFAULT_AV_TEMPLATE",
    "Injection",
    "MODEL_SIDECAR",
    "SIDECAR_SUFFIX",
    "critic_suffix_ids",
    "dataset_sidecar",
    "find_sidecar",
    "injection_settings",
    "load_sidecar",
    "model_sidecar",
    "read_sidecar",
    "token_meta",
    "write_sidecar",
]

DEFAULT_AV_TEMPLATE = "Explain the activation at <INJECT>."
"""nla's default AV user message (written to sidecars as upstream's {injection_char} template)."""
DEFAULT_AR_TEMPLATE = "Text: {explanation}"
"""nla's default AR template, filled with str.format(explanation=...)."""
MODEL_SIDECAR = "nla_meta.yaml"
"""A checkpoint dir's sidecar (upstream nla/schema.py SIDECAR_BASENAME)."""
SIDECAR_SUFFIX = ".nla_meta.yaml"
"""Appended to a parquet's file name (upstream nla/schema.py SIDECAR_SUFFIX)."""
DATASET_SCHEMA_VERSION = 1
"""upstream nla/datagen/sidecar.py SCHEMA_VERSION; its reader asserts equality."""
MODEL_SCHEMA_VERSION = 2
"""upstream nla/config.py write_model_sidecar."""


# --------------------------------------------------------------------------- find and read


def find_sidecar(source: str | Path) -> Path:
    """The sidecar YAML for a sidecar path, a parquet path or a checkpoint dir.

    A `.yaml`/`.yml` file is itself; a directory gives `<dir>/nla_meta.yaml`; a parquet
    (miles' `@[start:end]` slice suffix stripped, as upstream's sidecar_path_for does) gives
    `<parquet>.nla_meta.yaml`, else its directory's `nla_meta.yaml`. DataError naming the
    paths tried when none exists.
    """
    path = Path(str(source).split("@[")[0])
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    if path.is_dir():
        candidates: tuple[Path, ...] = (path / MODEL_SIDECAR,)
    else:
        candidates = (path.with_name(path.name + SIDECAR_SUFFIX), path.parent / MODEL_SIDECAR)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise DataError(
        f"sidecar: no sidecar for {source}; tried {' and '.join(str(c) for c in candidates)}. "
        "Write one (docs/sidecar.md) or pass `sidecar` explicitly"
    )


def read_sidecar(source: str | Path) -> tuple[Path, dict[str, Any]]:
    """(YAML path, mapping) for any source find_sidecar accepts; DataError when unreadable."""
    path = find_sidecar(source)
    try:
        mapping = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise DataError(f"sidecar: cannot read {path} as UTF-8 YAML: {err}") from None
    if not isinstance(mapping, dict):
        raise DataError(f"sidecar {path}: expected a YAML mapping, got {type(mapping).__name__}")
    return path, mapping


def load_sidecar(source: str | Path) -> NLAConfig:
    """Read and parse a sidecar (any source find_sidecar accepts); DataError naming the file and key."""
    path, mapping = read_sidecar(source)
    try:
        return parse_sidecar(mapping)
    except ValueError as err:
        raise DataError(f"sidecar {path}: {err}") from None


class Injection(NamedTuple):
    """How an AV takes its vector: the style (nla_core.INJECTION_STYLES), the L2 norm embedding_replace rescales to
    (None: residual_add, or "raw"), and the decoder block residual_add adds at."""

    style: str
    norm: float | None
    layer: int


def injection_settings(
    nla: NLAConfig,
    *,
    style: str | None = None,
    scale: str | float | None = None,
    layer: int | None = None,
    av_dir: str | Path | None = None,
) -> Injection:
    """The Injection the AV uses.

    Config values where given; else those of the AV checkpoint's own sidecar (`av_dir`'s
    nla_meta.yaml, authoritative for what that model was trained with, as upstream
    nla/config.py resolve_sidecar_source ranks it); else `nla`'s. embedding_replace needs a
    norm (kitft nla/train_actor.py asserts one): a number or "sqrt_d_model", or "raw" given
    in the config to inject the vector as it is; residual_add has none, and adds at block
    `layer` (a sidecar without nla's `injection_layer` key: block 1, the reference's). DataError otherwise.
    """
    source = nla
    if av_dir is not None and (Path(av_dir) / MODEL_SIDECAR).is_file():
        source = load_sidecar(av_dir)
    style = style or source.injection_style
    if style not in nla_core.INJECTION_STYLES:
        raise DataError(f"injection_style: {style!r} is not one of {nla_core.INJECTION_STYLES}")
    layer = source.injection_layer if layer is None else layer
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise DataError(f"injection_layer: {layer!r} is not a decoder block index (an integer >= 0)")
    if style == "residual_add":
        return Injection(style, None, layer)
    raw = source.injection_scale if scale is None else scale
    try:
        norm = resolve_target_scale(raw, nla.d_model)
    except ValueError as err:
        raise DataError(f"injection_scale: {err}") from None
    if norm is None and not (isinstance(scale, str) and scale.strip().lower() in ("raw", "none")):
        raise DataError(
            "injection_scale: the embedding_replace style needs the L2 norm to inject at, and neither the config "
            "nor the sidecar's extraction.injection_scale gives one; set injection_scale= a number, 'sqrt_d_model' or 'raw'"
        )
    return Injection(style, norm, layer)


# --------------------------------------------------------------------------- write


def write_sidecar(mapping: Mapping[str, Any], path: str | Path) -> Path:
    """Write a sidecar mapping as UTF-8 YAML, keys in the order given, atomically (tmp + rename)."""
    return write_text_atomically(path, yaml.safe_dump(dict(mapping), sort_keys=False, allow_unicode=True))


def critic_suffix_ids(tokenizer: Any, ar_template: str) -> list[int] | None:
    """The stable tail of the AR template's text after {explanation}: its token ids but the
    first, which can merge with the explanation's last characters (upstream
    nla/datagen/injection_tokens.py compute_critic_suffix_ids). None when the suffix has
    fewer than 2 tokens (upstream then refuses the template; nla extracts at the last token anyway)."""
    suffix = ar_template.split("{explanation}")[-1]
    ids = list(tokenizer(suffix, add_special_tokens=False)["input_ids"]) if suffix else []
    return ids[1:] if len(ids) >= 2 else None


def token_meta(tokenizer: Any, av_content: str, injection_char: str, *, ar_template: str | None = None) -> dict[str, Any]:
    """`tokens:` of a sidecar (upstream NLATokenMeta): the marker's id and its neighbours in the
    chat-templated AV prompt, and the AR template's suffix ids when ar_template is given."""
    ids = tokenizer.encode(injection_char, add_special_tokens=False)
    if len(ids) != 1:
        raise DataError(f"injection_char: {injection_char!r} encodes to {len(ids)} tokens {ids}; choose another")
    prompt_ids = chat_prompt_ids(av_prompt_messages(av_content), injection_char, tokenizer)
    try:
        left, right = canonical_neighbors(prompt_ids, ids[0])
    except ValueError as err:
        raise DataError(f"injection_char: in the chat-templated AV prompt, {err}") from None
    return {
        "injection_char": injection_char,
        "injection_token_id": ids[0],
        "injection_left_neighbor_id": left,
        "injection_right_neighbor_id": right,
        "critic_suffix_ids": None if ar_template is None else critic_suffix_ids(tokenizer, ar_template),
    }


def _now() -> str:
    return datetime.datetime.now(tz=datetime.timezone.utc).isoformat()


def dataset_sidecar(
    tokenizer: Any,
    *,
    stage: str,
    row_count: int,
    base_model: str,
    d_model: int,
    layer_index: int,
    corpus: str,
    positions_per_doc: int,
    av_content: str,
    ar_template: str,
    injection_char: str,
    mse_scale: str | float | None = "sqrt_d_model",
    provenance: Mapping[str, Any] | None = None,
    api_summaries: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A kind nla_dataset sidecar in upstream's layout (kitft nla/datagen/sidecar.py NLADatasetMeta).

    `api_summaries` (model, max_tokens, temperature, instruction_prompt: the LLM that wrote the
    explanations, as EasyNLA's stage 2 records it) is written only when given.

    `extraction` holds exactly upstream's NLAExtractionMeta fields (its reader builds the
    dataclass from them), plus `mse_scale` only when it is not the default sqrt_d_model
    (upstream's training reader, nla/config.py, honours it there). `provenance` is nla's
    addition; upstream's reader drops unknown top-level keys.
    """
    extraction: dict[str, Any] = {
        "base_model": base_model,
        "d_model": d_model,
        "layer_index": layer_index,
        "norm": "none",  # activations are stored raw; training normalises
        "corpus": corpus,
        "corpus_slice": {"start": 0, "length": row_count},
        "positions_per_doc": positions_per_doc,
    }
    if mse_scale != "sqrt_d_model":
        extraction["mse_scale"] = mse_scale
    return {
        "dataset_id": f"{stage}_{Path(corpus).stem}_L{layer_index}",
        "stage": stage,
        "row_count": row_count,
        "extraction": extraction,
        "kind": "nla_dataset",
        "schema_version": DATASET_SCHEMA_VERSION,
        "keep_debug_metadata": True,
        "tokens": token_meta(tokenizer, av_content, injection_char, ar_template=ar_template),
        "prompt_templates": {"actor": upstream_actor_template(av_content), "critic": ar_template},
        **({"api_summaries": dict(api_summaries)} if api_summaries else {}),
        "parent_datasets": [],
        "created_at": _now(),
        "created_by": "nla datagen",
        "git_commit": "",
        "provenance": dict(provenance or {}),
    }


def model_sidecar(
    nla: NLAConfig,
    *,
    role: str,
    stage: str,
    base_checkpoint: str,
    injection: Injection,
    trained_on: list[str],
    baselines: nla_core.Baselines | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A kind nla_model sidecar in upstream's layout (kitft nla/config.py write_model_sidecar).

    Top-level d_model, resolved scales under extraction.* (a number or null),
    critic.extraction_layer_index, {injection_char} actor template. `role` is "av" or "ar"
    (upstream's released names). nla's additions: `injection_style`, `injection_layer` (under
    residual_add), `baselines` (predict-the-mean MSEs for FVE) and `provenance`. Under residual_add,
    extraction.injection_scale is null: that style has no norm, and kitft's inference then
    refuses the checkpoint rather than inject it the wrong way.
    """
    mse = resolve_target_scale(nla.mse_scale, nla.d_model)
    mapping: dict[str, Any] = {
        "kind": "nla_model",
        "schema_version": MODEL_SCHEMA_VERSION,
        "role": role,
        "stage": stage,
        "base_checkpoint": base_checkpoint,
        "d_model": nla.d_model,
        "extraction": {"injection_scale": injection.norm, "mse_scale": mse},
        "tokens": {
            "injection_char": nla.injection_char,
            "injection_token_id": nla.injection_token_id,
            "injection_left_neighbor_id": nla.injection_left_neighbor_id,
            "injection_right_neighbor_id": nla.injection_right_neighbor_id,
            "critic_suffix_ids": None if nla.critic_suffix_ids is None else list(nla.critic_suffix_ids),
        },
        "prompt_templates": {
            "actor": upstream_actor_template(nla.actor_prompt_template),
            "critic": nla.critic_prompt_template,
        },
        "trained_on": list(trained_on),
        "parent_checkpoints": [base_checkpoint],
        "created_at": _now(),
        "created_by": "nla",
    }
    if nla.extraction_layer_index is not None:
        mapping["critic"] = {"extraction_layer_index": nla.extraction_layer_index}
    mapping["injection_style"] = injection.style
    if injection.style == "residual_add":
        mapping["injection_layer"] = injection.layer
    if baselines is not None:
        mapping["baselines"] = {"rawvar": float(baselines.rawvar), "meannorm": float(baselines.meannorm)}
    mapping["provenance"] = dict(provenance or {})
    return mapping

