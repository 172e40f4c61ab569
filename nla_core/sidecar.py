"""The sidecar: what a dataset or model says about its marker, prompts, layer and scale.

The schema is upstream's (kitft natural_language_autoencoders nla/schema.py, nla/config.py,
nla/datagen/sidecar.py; EasyNLA shares it): dataset sidecars (schema_version 1), model
sidecars (schema_version 2), released checkpoints, and nla's round-one files; every variant
is listed in docs/sidecar.md. Parsing takes an already-loaded mapping (the shell reads the
file), so this stays I/O-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from nla_core.injection import INJECTION_STYLES

__all__ = [
    "DEFAULT_INJECTION_LAYER",
    "INJECTION_CHAR_FIELD",
    "INJECT_PLACEHOLDER",
    "LAYER_KEYS",
    "SIDECAR_KINDS",
    "NLAConfig",
    "actor_content",
    "canonical_neighbors",
    "marker_char",
    "marker_content",
    "parse_sidecar",
    "resolve_target_scale",
    "upstream_actor_template",
]

SIDECAR_KINDS = ("nla_dataset", "nla_model")
INJECT_PLACEHOLDER = "<INJECT>"
"""The marker's placeholder inside parquet `prompt` messages (upstream nla/schema.py)."""
INJECTION_CHAR_FIELD = "{injection_char}"
"""The marker's slot in upstream actor templates, filled with str.format (upstream nla/schema.py)."""
LAYER_KEYS = (
    "critic.extraction_layer_index",  # kitft model sidecar, schema v2
    "critic.num_hidden_layers",  # kitft model sidecar, schema v1
    "extraction_layer_index",  # kitft released checkpoints (release/hf_stage_and_scrub.py)
    "extraction.layer_index",  # dataset sidecars
    "model.layer_index",  # nla's round-one model sidecars
)
"""Where the extraction layer K (AR = blocks 0..K) may be written, in the order read."""
DEFAULT_INJECTION_LAYER = 1
"""The block residual_add injects at when a sidecar names none: the reference trainer's (train_rl_vllm.py's
injection_layer=1), which EasyNLA shares."""


@dataclass(frozen=True)
class NLAConfig:
    """Everything the trainer needs from a sidecar."""

    kind: str
    """"nla_dataset" or "nla_model"."""
    d_model: int
    """Width D of the activation vectors (the model's hidden size)."""
    injection_char: str
    """Text that replaces <INJECT> in the AV prompt, encoding to one token: one character, or a
    space and one character (a token that carries its leading space; see marker_content)."""
    injection_token_id: int
    """Token id of injection_char."""
    injection_left_neighbor_id: int
    """Token id right before the marker in the chat-templated AV prompt."""
    injection_right_neighbor_id: int
    """Token id right after the marker in the chat-templated AV prompt."""
    actor_prompt_template: str
    """AV user-message content holding <INJECT> (upstream's template with {injection_char} filled by it)."""
    critic_prompt_template: str
    """AR input template holding {explanation}, filled with str.format."""
    extraction_layer_index: int | None
    """K: activations are the output of block K; the AR keeps blocks 0..K. None when the sidecar names none."""
    mse_scale: str | float | None
    """Raw scale spec for normalize_activation; resolve with resolve_target_scale."""
    injection_scale: str | float | None = None
    """Raw spec of the L2 norm the vector is rescaled to under embedding_replace (upstream's
    extraction.injection_scale; None = inject raw); residual_add ignores it."""
    injection_style: str = "residual_add"
    """One of INJECTION_STYLES."""
    injection_layer: int = DEFAULT_INJECTION_LAYER
    """nla addition: the decoder block at whose output residual_add adds the vector (absent: 1, the reference's and
    EasyNLA's); embedding_replace ignores it."""
    critic_suffix_ids: tuple[int, ...] | None = None
    """Expected last token ids of a filled AR prompt (upstream tokens.critic_suffix_ids), if given."""


def resolve_target_scale(raw: object, d_model: int) -> float | None:
    """None / "none" / "raw" -> None (no normalisation); "sqrt_d_model" -> sqrt(d_model);
    numbers and numeric strings -> float; anything else -> ValueError."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "raw")):
        return None
    if isinstance(raw, str) and raw.strip().lower() == "sqrt_d_model":
        return math.sqrt(d_model)
    if isinstance(raw, bool):
        raise ValueError(f"scale={raw!r}: expected 'sqrt_d_model', 'none', 'raw', null or a number")
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"scale={raw!r}: expected 'sqrt_d_model', 'none', 'raw', null or a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale={raw!r}: a numeric scale must be finite and > 0")
    return value


def actor_content(template: str, *, key: str = "prompt_templates.actor") -> str:
    """The AV user-message content with <INJECT> at the marker, from either template style.

    Upstream templates hold {injection_char} and are filled with str.format (so literal
    braces are written {{ }}); nla's round-one templates hold <INJECT> itself.
    Raises ValueError naming `key` when neither placeholder is there or the format fails.
    """
    if INJECTION_CHAR_FIELD in template:
        try:
            return template.format(injection_char=INJECT_PLACEHOLDER)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"sidecar key `{key}` holds a format field other than {{injection_char}} ({err!r}); "
                "write literal braces as {{ and }}"
            ) from None
    if INJECT_PLACEHOLDER in template:
        return template
    raise ValueError(f"sidecar key `{key}` must contain the placeholder {{injection_char}} (upstream) or <INJECT>")


def marker_char(injection_char: str) -> str | None:
    """The visible character of a marker text: `X` for "X" and for " X" (a token that carries its
    leading space), None when the text is neither one non-space character nor a space and one."""
    char = injection_char[1:] if len(injection_char) == 2 and injection_char[0] == " " else injection_char
    return char if len(char) == 1 and not char.isspace() else None


def marker_content(content: str, injection_char: str) -> str:
    """The AV content as stored for this marker: `content` itself, or, for a marker that carries
    its leading space (" X"), `content` with the space before <INJECT> taken into the marker.

    Upstream fills the placeholder with tokens.injection_char by plain replacement (nla/schema.py,
    nla/data_source.py), so a stored "...:<INJECT>" with injection_char " X" gives every reader
    the text "...: X" that the template was written as. ValueError when the marker carries a
    space and `content` has none before <INJECT>.
    """
    if not injection_char.startswith(" "):
        return content
    spaced = " " + INJECT_PLACEHOLDER
    if spaced not in content:
        raise ValueError(f"injection_char {injection_char!r} carries a leading space, but the AV template has no space "
                         f"before {INJECT_PLACEHOLDER}; write one there, or choose a marker without the space")
    return content.replace(spaced, INJECT_PLACEHOLDER)


def upstream_actor_template(content: str) -> str:
    """Inverse of actor_content: braces escaped, <INJECT> -> {injection_char}."""
    return content.replace("{", "{{").replace("}", "}}").replace(INJECT_PLACEHOLDER, INJECTION_CHAR_FIELD)


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


def _first_present(mapping: Mapping[str, Any], paths: Sequence[str], *, required: bool = True) -> tuple[str, Any]:
    for path in paths:
        value = _get(mapping, path, None)
        if value is not None:
            return path, value
    if required:
        raise ValueError(f"sidecar is missing key `{paths[0]}` (also accepted: {', '.join(paths[1:])})")
    return paths[0], None


def _scale(mapping: Mapping[str, Any], path: str, default: object, d_model: int) -> Any:
    raw = _get(mapping, path, default)
    try:
        resolve_target_scale(raw, d_model)
    except ValueError as err:
        raise ValueError(f"sidecar key `{path}`: {err}") from None
    return raw


def _injection_style(mapping: Mapping[str, Any], kind: str, injection_scale: Any) -> str:
    """nla's `injection_style` when written; else a kitft AV's (a model sidecar whose
    extraction.injection_scale is set: upstream nla_inference.py injects at the embedding);
    else the reference trainer's."""
    style = mapping.get("injection_style")
    if style is None:
        return "embedding_replace" if kind == "nla_model" and injection_scale is not None else "residual_add"
    if style not in INJECTION_STYLES:
        raise ValueError(f"sidecar key `injection_style` is {style!r}; expected one of {INJECTION_STYLES}")
    return style


def _injection_layer(mapping: Mapping[str, Any]) -> int:
    """nla's `injection_layer` when written (a block index >= 0); absent or null, DEFAULT_INJECTION_LAYER."""
    layer = mapping.get("injection_layer")
    if layer is None:
        return DEFAULT_INJECTION_LAYER
    _typed("injection_layer", layer, int, "a non-negative integer")
    if layer < 0:
        raise ValueError(f"sidecar key `injection_layer` must be >= 0, got {layer}")
    return layer


def parse_sidecar(mapping: Mapping[str, Any]) -> NLAConfig:
    """Validate a sidecar mapping (kind nla_dataset or nla_model, any upstream variant) into an NLAConfig.

    Layout and variants: docs/sidecar.md. Raises ValueError naming the missing or mistyped key.
    """
    if not isinstance(mapping, Mapping):
        raise ValueError(f"sidecar must be a mapping, got {type(mapping).__name__}")
    kind = _typed("kind", _get(mapping, "kind"), str, "a string")
    if kind not in SIDECAR_KINDS:
        raise ValueError(f"sidecar key `kind` is {kind!r}; expected one of {SIDECAR_KINDS}")
    version = mapping.get("schema_version")
    if version is not None and version not in (1, 2):
        raise ValueError(f"sidecar key `schema_version` is {version!r}; expected 1 (datasets) or 2 (models)")
    d_paths = ("extraction.d_model",) if kind == "nla_dataset" else ("d_model", "model.d_model")
    d_path, d_model = _first_present(mapping, d_paths)
    _typed(d_path, d_model, int, "a positive integer")
    if d_model <= 0:
        raise ValueError(f"sidecar key `{d_path}` must be a positive integer, got {d_model}")

    char = _typed("tokens.injection_char", _get(mapping, "tokens.injection_char"), str, "a string")
    if marker_char(char) is None:
        raise ValueError(f"sidecar key `tokens.injection_char` must be one non-space character, or a space and one "
                         f"(a token that carries its leading space), got {char!r}")
    ids = {
        key: _typed(f"tokens.{key}", _get(mapping, f"tokens.{key}"), int, "an integer token id")
        for key in ("injection_token_id", "injection_left_neighbor_id", "injection_right_neighbor_id")
    }
    suffix = _get(mapping, "tokens.critic_suffix_ids", None)
    if suffix is not None and not (
        isinstance(suffix, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in suffix)
    ):
        raise ValueError(f"sidecar key `tokens.critic_suffix_ids` must be a list of token ids or null, got {suffix!r}")

    av_path, av = _first_present(mapping, ("prompt_templates.av", "prompt_templates.actor"))
    content = actor_content(_typed(av_path, av, str, "a string"), key=av_path)
    if content.count(INJECT_PLACEHOLDER) != 1:
        raise ValueError(f"sidecar key `{av_path}` must hold the marker placeholder exactly once")
    ar_path, ar = _first_present(mapping, ("prompt_templates.ar", "prompt_templates.critic"))
    _typed(ar_path, ar, str, "a string")
    if "{explanation}" not in ar:
        raise ValueError(f"sidecar key `{ar_path}` must contain the placeholder {{explanation}}")

    layer_path, layer = _first_present(mapping, LAYER_KEYS, required=False)
    if layer is not None:
        _typed(layer_path, layer, int, "a non-negative integer")
        if layer < 0:
            raise ValueError(f"sidecar key `{layer_path}` must be >= 0, got {layer}")

    # Scales live under extraction.* in both kinds (upstream nla/config.py load_nla_config):
    # mse_scale absent means sqrt_d_model, injection_scale absent means none chosen. nla's
    # round-one model sidecars kept mse_scale under model.* (their injection_scale meant
    # the residual add's factor, always 1, so it is not read).
    legacy = kind == "nla_model" and "extraction" not in mapping and isinstance(mapping.get("model"), Mapping)
    mse_scale = _scale(mapping, "model.mse_scale" if legacy else "extraction.mse_scale", "sqrt_d_model", d_model)
    injection_scale = _scale(mapping, "extraction.injection_scale", None, d_model)
    return NLAConfig(
        kind=kind,
        d_model=d_model,
        injection_char=char,
        injection_token_id=ids["injection_token_id"],
        injection_left_neighbor_id=ids["injection_left_neighbor_id"],
        injection_right_neighbor_id=ids["injection_right_neighbor_id"],
        actor_prompt_template=content,
        critic_prompt_template=ar,
        extraction_layer_index=layer,
        mse_scale=mse_scale,
        injection_scale=injection_scale,
        injection_style=_injection_style(mapping, kind, injection_scale),
        injection_layer=_injection_layer(mapping),
        critic_suffix_ids=None if suffix is None else tuple(suffix),
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
