"""The sidecar: what a dataset or model says about its marker, prompts, layer and scale.

See docs/sidecar.md for the YAML layout. Parsing takes an already-loaded mapping (the
shell reads the file), so this stays I/O-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

SIDECAR_KINDS = ("nla_dataset", "nla_model")


@dataclass(frozen=True)
class NLAConfig:
    """Everything the trainer needs from a sidecar."""

    kind: str
    """"nla_dataset" or "nla_model"."""
    d_model: int
    """Width D of the activation vectors (the model's hidden size)."""
    injection_char: str
    """Character that replaces <INJECT> in the AV prompt; encodes to one token."""
    injection_token_id: int
    """Token id of injection_char."""
    injection_left_neighbor_id: int
    """Token id right before the marker in the chat-templated AV prompt."""
    injection_right_neighbor_id: int
    """Token id right after the marker in the chat-templated AV prompt."""
    actor_prompt_template: str
    """AV user-message template holding <INJECT>."""
    critic_prompt_template: str
    """AR input template holding {explanation}."""
    extraction_layer_index: int
    """k: activations are the output of block k; the AR keeps blocks 0..k."""
    mse_scale: str | float | None
    """Raw scale spec for normalize_activation; resolve with resolve_target_scale."""
    injection_scale: float = 1.0
    """s in h' = h + s * ||h|| * v / ||v||."""


def resolve_target_scale(raw: object, d_model: int) -> float | None:
    """None / "none" / "raw" -> None (no normalisation); "sqrt_d_model" -> sqrt(d_model);
    numbers and numeric strings -> float; anything else -> ValueError."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "raw")):
        return None
    if isinstance(raw, str) and raw.strip().lower() == "sqrt_d_model":
        return math.sqrt(d_model)
    if isinstance(raw, bool):
        raise ValueError(f"mse_scale={raw!r}: expected 'sqrt_d_model', 'none', 'raw' or a number")
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"mse_scale={raw!r}: expected 'sqrt_d_model', 'none', 'raw' or a number"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"mse_scale={raw!r}: a numeric scale must be finite and > 0")
    return value


_MISSING = object()


def _get(mapping: Mapping[str, Any], path: str, default: object = _MISSING) -> Any:
    node: Any = mapping
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is _MISSING:
                raise ValueError(f"sidecar is missing key `{path}` (see docs/sidecar.md)")
            return default
        node = node[part]
    return node


def _typed(path: str, value: Any, kind: type, what: str) -> Any:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise ValueError(f"sidecar key `{path}` must be {what}, got {value!r} ({type(value).__name__})")
    return value


def _first_present(mapping: Mapping[str, Any], paths: Sequence[str]) -> tuple[str, Any]:
    for path in paths:
        value = _get(mapping, path, None)
        if value is not None:
            return path, value
    raise ValueError(f"sidecar is missing key `{paths[0]}` (also accepted: {', '.join(paths[1:])})")


def parse_sidecar(mapping: Mapping[str, Any]) -> NLAConfig:
    """Validate a sidecar mapping (kind nla_dataset or nla_model) into an NLAConfig.

    Raises ValueError naming the missing or mistyped key.
    """
    if not isinstance(mapping, Mapping):
        raise ValueError(f"sidecar must be a mapping, got {type(mapping).__name__}")
    kind = _typed("kind", _get(mapping, "kind"), str, "a string")
    if kind not in SIDECAR_KINDS:
        raise ValueError(f"sidecar key `kind` is {kind!r}; expected one of {SIDECAR_KINDS}")
    d_path = "extraction.d_model" if kind == "nla_dataset" else "model.d_model"
    d_model = _typed(d_path, _get(mapping, d_path), int, "a positive integer")
    if d_model <= 0:
        raise ValueError(f"sidecar key `{d_path}` must be a positive integer, got {d_model}")

    char = _typed("tokens.injection_char", _get(mapping, "tokens.injection_char"), str, "a string")
    if len(char) != 1:
        raise ValueError(f"sidecar key `tokens.injection_char` must be one character, got {char!r}")
    ids = {
        key: _typed(f"tokens.{key}", _get(mapping, f"tokens.{key}"), int, "an integer token id")
        for key in ("injection_token_id", "injection_left_neighbor_id", "injection_right_neighbor_id")
    }

    av_path, av = _first_present(mapping, ("prompt_templates.av", "prompt_templates.actor"))
    _typed(av_path, av, str, "a string")
    if "<INJECT>" not in av:
        raise ValueError(f"sidecar key `{av_path}` must contain the placeholder <INJECT>")
    ar_path, ar = _first_present(mapping, ("prompt_templates.ar", "prompt_templates.critic"))
    _typed(ar_path, ar, str, "a string")
    if "{explanation}" not in ar:
        raise ValueError(f"sidecar key `{ar_path}` must contain the placeholder {{explanation}}")

    layer_path, layer = "critic.extraction_layer_index", _get(mapping, "critic.extraction_layer_index", None)
    if layer is None:
        layer_path = "extraction.layer_index" if kind == "nla_dataset" else "model.layer_index"
        layer = _get(mapping, layer_path)
    _typed(layer_path, layer, int, "a non-negative integer")
    if layer < 0:
        raise ValueError(f"sidecar key `{layer_path}` must be >= 0, got {layer}")

    scale_path = "extraction.mse_scale" if kind == "nla_dataset" else "model.mse_scale"
    mse_scale = _get(mapping, scale_path, "sqrt_d_model")
    try:
        resolve_target_scale(mse_scale, d_model)
    except ValueError as err:
        raise ValueError(f"sidecar key `{scale_path}`: {err}") from None

    inj_path = "extraction.injection_scale" if kind == "nla_dataset" else "model.injection_scale"
    injection_scale = _get(mapping, inj_path, 1.0)
    if isinstance(injection_scale, bool) or not isinstance(injection_scale, (int, float)):
        raise ValueError(f"sidecar key `{inj_path}` must be a number, got {injection_scale!r}")

    return NLAConfig(
        kind=kind,
        d_model=d_model,
        injection_char=char,
        injection_token_id=ids["injection_token_id"],
        injection_left_neighbor_id=ids["injection_left_neighbor_id"],
        injection_right_neighbor_id=ids["injection_right_neighbor_id"],
        actor_prompt_template=av,
        critic_prompt_template=ar,
        extraction_layer_index=layer,
        mse_scale=mse_scale,
        injection_scale=float(injection_scale),
    )


def canonical_neighbors(token_ids: Sequence[int], marker_id: int) -> tuple[int, int]:
    """(left, right) token ids around the single marker in token_ids.

    Raises ValueError unless exactly one marker sits strictly inside the sequence.
    """
    ids = [int(t) for t in token_ids]
    positions = [i for i, t in enumerate(ids) if t == marker_id]
    if len(positions) != 1:
        raise ValueError(f"expected exactly one marker token {marker_id}, found {len(positions)}")
    p = positions[0]
    if not 0 < p < len(ids) - 1:
        raise ValueError(f"marker token {marker_id} sits at position {p} of {len(ids)}: it needs neighbours on both sides")
    return ids[p - 1], ids[p + 1]
