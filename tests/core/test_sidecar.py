"""parse_sidecar / NLAConfig, resolve_target_scale, canonical_neighbors (layout: docs/sidecar.md)."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nla_core import NLAConfig, actor_content, canonical_neighbors, parse_sidecar, resolve_target_scale, upstream_actor_template

FAST = settings(max_examples=50, deadline=None)


def dataset_sidecar():
    # the example of docs/sidecar.md
    return {
        "kind": "nla_dataset",
        "stage": "rl",
        "extraction": {"d_model": 64, "layer_index": 1, "mse_scale": "sqrt_d_model", "injection_scale": 1.0},
        "tokens": {
            "injection_char": "§",
            "injection_token_id": 300,
            "injection_left_neighbor_id": 12,
            "injection_right_neighbor_id": 45,
        },
        "prompt_templates": {"av": "Explain the activation at <INJECT>.", "ar": "Text: {explanation}"},
        "critic": {"extraction_layer_index": 1},
        "provenance": {"model": "tiny", "seed": 0},
    }


def model_sidecar():
    # nla's round-one model sidecar: geometry under `model:`, still read
    return {
        "kind": "nla_model",
        "model": {"d_model": 32},
        "tokens": {
            "injection_char": "¤",
            "injection_token_id": 99,
            "injection_left_neighbor_id": 7,
            "injection_right_neighbor_id": 8,
        },
        "prompt_templates": {"actor": "Say what <INJECT> means.", "critic": "Explanation: {explanation}"},
        "critic": {"extraction_layer_index": 2},
    }


def without(mapping, path):
    m = copy.deepcopy(mapping)
    node = m
    parts = path.split(".")
    for p in parts[:-1]:
        node = node[p]
    del node[parts[-1]]
    return m


def replaced(mapping, path, value):
    m = copy.deepcopy(mapping)
    node = m
    parts = path.split(".")
    for p in parts[:-1]:
        node = node[p]
    node[parts[-1]] = value
    return m


def names_key(msg, path):
    leaf = path.split(".")[-1]
    return re.search(rf"\b{re.escape(leaf)}\b", msg) is not None


# ---------------------------------------------------------------- valid mappings


def test_dataset_sidecar_full_mapping():
    cfg = parse_sidecar(dataset_sidecar())
    assert isinstance(cfg, NLAConfig)
    assert cfg.d_model == 64
    assert cfg.injection_char == "§"
    assert cfg.injection_token_id == 300
    assert cfg.injection_left_neighbor_id == 12
    assert cfg.injection_right_neighbor_id == 45
    assert cfg.actor_prompt_template == "Explain the activation at <INJECT>."
    assert cfg.critic_prompt_template == "Text: {explanation}"
    assert cfg.extraction_layer_index == 1
    assert resolve_target_scale(cfg.mse_scale, cfg.d_model) == 8.0
    assert cfg.injection_scale == 1.0


def test_model_sidecar_full_mapping_with_aliases():
    cfg = parse_sidecar(model_sidecar())
    assert cfg.d_model == 32
    assert (cfg.injection_char, cfg.injection_token_id) == ("¤", 99)
    assert (cfg.injection_left_neighbor_id, cfg.injection_right_neighbor_id) == (7, 8)
    assert cfg.actor_prompt_template == "Say what <INJECT> means."  # `actor` alias of `av`
    assert cfg.critic_prompt_template == "Explanation: {explanation}"  # `critic` alias of `ar`
    assert cfg.extraction_layer_index == 2
    # mse_scale defaults to sqrt_d_model
    assert resolve_target_scale(cfg.mse_scale, cfg.d_model) == pytest.approx(math.sqrt(32))


def test_av_ar_aliases_on_a_dataset():
    m = dataset_sidecar()
    m["prompt_templates"] = {"actor": "A <INJECT>", "critic": "C {explanation}"}
    cfg = parse_sidecar(m)
    assert cfg.actor_prompt_template == "A <INJECT>" and cfg.critic_prompt_template == "C {explanation}"


def test_defaults():
    m = without(without(dataset_sidecar(), "extraction.mse_scale"), "extraction.injection_scale")
    cfg = parse_sidecar(m)
    assert cfg.mse_scale == "sqrt_d_model"
    assert resolve_target_scale(cfg.mse_scale, cfg.d_model) == 8.0
    assert cfg.injection_scale is None  # upstream nla/config.py: no default for an absent injection_scale


def test_extraction_layer_index_falls_back_to_extraction_layer():
    m = without(dataset_sidecar(), "critic")
    m["extraction"]["layer_index"] = 3
    assert parse_sidecar(m).extraction_layer_index == 3
    # an explicit critic index wins
    m["critic"] = {"extraction_layer_index": 5}
    assert parse_sidecar(m).extraction_layer_index == 5


@pytest.mark.parametrize("raw, expected", [("none", None), (None, None), ("raw", None), (2.5, 2.5), ("sqrt_d_model", 8.0)])
def test_mse_scale_values_pass_through(raw, expected):
    cfg = parse_sidecar(replaced(dataset_sidecar(), "extraction.mse_scale", raw))
    assert resolve_target_scale(cfg.mse_scale, cfg.d_model) == expected


def test_injection_scale_read():
    cfg = parse_sidecar(replaced(dataset_sidecar(), "extraction.injection_scale", 0.5))
    assert cfg.injection_scale == 0.5


def test_config_is_frozen():
    cfg = parse_sidecar(dataset_sidecar())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3  # type: ignore[misc]


def test_mapping_not_modified():
    m = dataset_sidecar()
    before = copy.deepcopy(m)
    parse_sidecar(m)
    assert m == before


# ---------------------------------------------------------------- missing and mistyped keys


REQUIRED_DATASET = [
    "kind",
    "extraction.d_model",
    "tokens.injection_char",
    "tokens.injection_token_id",
    "tokens.injection_left_neighbor_id",
    "tokens.injection_right_neighbor_id",
]


@pytest.mark.parametrize("path", REQUIRED_DATASET)
def test_missing_key_raises_naming_it(path):
    with pytest.raises(ValueError) as ei:
        parse_sidecar(without(dataset_sidecar(), path))
    assert names_key(str(ei.value), path), str(ei.value)


def test_missing_model_d_model():
    with pytest.raises(ValueError) as ei:
        parse_sidecar(without(model_sidecar(), "model.d_model"))
    assert names_key(str(ei.value), "d_model")


def test_missing_whole_sections():
    for section, key in [("tokens", "injection_char"), ("extraction", "d_model"), ("prompt_templates", None)]:
        with pytest.raises(ValueError) as ei:
            parse_sidecar(without(dataset_sidecar(), section))
        msg = str(ei.value)
        assert section in msg or (key is not None and key in msg), msg


@pytest.mark.parametrize("side, names", [("av", ("av", "actor")), ("ar", ("ar", "critic"))])
def test_missing_template_names_it(side, names):
    with pytest.raises(ValueError) as ei:
        parse_sidecar(without(dataset_sidecar(), f"prompt_templates.{side}"))
    msg = str(ei.value)
    assert any(re.search(rf"\b{n}\b", msg) for n in names), msg


def test_missing_layer_index_everywhere_is_none():
    # kitft nla/config.py write_model_sidecar writes no layer for an actor: the AR or the data must say it
    m = without(without(dataset_sidecar(), "critic"), "extraction.layer_index")
    assert parse_sidecar(m).extraction_layer_index is None


@pytest.mark.parametrize(
    "path, bad",
    [
        ("extraction.d_model", "sixty-four"),
        ("extraction.d_model", [64]),
        ("extraction.d_model", 64.5),
        ("tokens.injection_char", 5),
        ("tokens.injection_token_id", "abc"),
        ("tokens.injection_token_id", 3.5),
        ("tokens.injection_left_neighbor_id", None),
        ("tokens.injection_right_neighbor_id", [1]),
        ("prompt_templates.av", 3),
        ("prompt_templates.ar", ["Text: {explanation}"]),
        ("critic.extraction_layer_index", "one"),
        ("extraction.mse_scale", "bogus"),
        ("extraction.mse_scale", [8]),
    ],
)
def test_mistyped_key_raises_naming_it(path, bad):
    with pytest.raises(ValueError) as ei:
        parse_sidecar(replaced(dataset_sidecar(), path, bad))
    msg = str(ei.value)
    leaf = path.split(".")[-1]
    aliases = {"av": ("av", "actor"), "ar": ("ar", "critic")}.get(leaf, (leaf,))
    assert any(re.search(rf"\b{a}\b", msg) for a in aliases), msg


def test_unknown_kind_named():
    with pytest.raises(ValueError) as ei:
        parse_sidecar(replaced(dataset_sidecar(), "kind", "nla_thing"))
    assert "kind" in str(ei.value)


def test_critic_template_needs_explanation_placeholder():
    with pytest.raises(ValueError) as ei:
        parse_sidecar(replaced(dataset_sidecar(), "prompt_templates.ar", "Text: {other}"))
    assert "explanation" in str(ei.value)


def test_not_a_mapping():
    with pytest.raises(ValueError):
        parse_sidecar(["kind", "nla_dataset"])  # type: ignore[arg-type]


# ---------------------------------------------------------------- resolve_target_scale


@pytest.mark.parametrize(
    "raw, d, expected",
    [
        (None, 64, None),
        ("none", 64, None),
        ("raw", 64, None),
        ("sqrt_d_model", 64, 8.0),
        ("sqrt_d_model", 4096, 64.0),
        (8, 64, 8.0),
        (2.5, 64, 2.5),
        ("3.5", 64, 3.5),
        ("10", 64, 10.0),
    ],
)
def test_resolve_target_scale_cases(raw, d, expected):
    out = resolve_target_scale(raw, d)
    assert out == expected
    if expected is not None:
        assert isinstance(out, float)


@pytest.mark.parametrize("raw", ["bogus", "sqrt", "", [8], {"x": 1}, object()])
def test_resolve_target_scale_rejects(raw):
    with pytest.raises(ValueError):
        resolve_target_scale(raw, 64)


@FAST
@given(st.integers(1, 10_000), st.floats(1e-3, 1e3))
def test_resolve_target_scale_properties(d, x):
    assert resolve_target_scale("sqrt_d_model", d) == pytest.approx(math.sqrt(d), rel=1e-15)
    assert resolve_target_scale(x, d) == x
    assert resolve_target_scale(repr(x), d) == x  # numeric strings round-trip


# ---------------------------------------------------------------- canonical_neighbors


def test_canonical_neighbors_cases():
    assert canonical_neighbors([5, 7, 300, 9], 300) == (7, 9)
    assert canonical_neighbors((1, 300, 2), 300) == (1, 2)


@pytest.mark.parametrize("ids", [[1, 2, 3], [300, 1, 2], [1, 2, 300], [1, 300, 2, 300, 4], [], [300]])
def test_canonical_neighbors_rejects(ids):
    with pytest.raises(ValueError):
        canonical_neighbors(ids, 300)


@FAST
@given(st.lists(st.integers(0, 50), max_size=10), st.integers(0, 20))
def test_canonical_neighbors_vs_definition(ids, insert_at):
    ids = [i for i in ids if i != 300]
    p = min(insert_at, len(ids))
    seq = ids[:p] + [300] + ids[p:]
    if 0 < p < len(seq) - 1:
        assert canonical_neighbors(seq, 300) == (seq[p - 1], seq[p + 1])
    else:
        with pytest.raises(ValueError):
            canonical_neighbors(seq, 300)


# ---------------------------------------------------------------- upstream's variants (tests/upstream.py)

import upstream  # noqa: E402

TOKENS = {"injection_char": "㈎", "injection_token_id": 149705, "injection_left_neighbor_id": 27,
          "injection_right_neighbor_id": 522, "critic_suffix_ids": [1318, 29, 366, 1708, 29]}


def test_kitft_dataset_sidecar_as_datagen_writes_it():
    m = upstream.dataset_sidecar(TOKENS, stage="rl", d_model=3584, layer_index=20, row_count=10)
    cfg = parse_sidecar(m)
    assert (cfg.kind, cfg.d_model, cfg.extraction_layer_index) == ("nla_dataset", 3584, 20)
    assert (cfg.injection_char, cfg.injection_token_id) == ("㈎", 149705)
    assert cfg.actor_prompt_template == upstream.ACTOR_TEMPLATE.format(injection_char="<INJECT>")
    assert cfg.critic_prompt_template == upstream.CRITIC_TEMPLATE
    assert cfg.critic_suffix_ids == (1318, 29, 366, 1708, 29)
    # no scale keys: mse_scale means sqrt_d_model, injection_scale none chosen (upstream nla/config.py)
    assert resolve_target_scale(cfg.mse_scale, cfg.d_model) == pytest.approx(math.sqrt(3584))
    assert cfg.injection_scale is None and cfg.injection_style == "residual_add"


@pytest.mark.parametrize("layer_key", ["extraction_layer_index", "num_hidden_layers"])
def test_kitft_model_sidecar_both_schema_spellings(layer_key):
    m = upstream.model_sidecar(TOKENS, role="actor", d_model=3584, injection_scale=150.0, mse_scale=59.866,
                               critic_layer=20, layer_key=layer_key)
    cfg = parse_sidecar(m)
    assert (cfg.kind, cfg.d_model, cfg.extraction_layer_index) == ("nla_model", 3584, 20)
    assert cfg.injection_scale == 150.0 and cfg.mse_scale == 59.866
    assert cfg.injection_style == "embedding_replace"  # a kitft AV injects at the embedding


def test_released_sidecar_top_level_layer_and_av_ar_keys():
    model = upstream.model_sidecar(TOKENS, role="actor", d_model=3840, injection_scale=80000.0, mse_scale=None,
                                   critic_layer=None)
    released = upstream.released_sidecar(model, layer_index=32)
    assert released["role"] == "av" and "av" in released["prompt_templates"] and "critic" not in released
    cfg = parse_sidecar(released)
    assert (cfg.extraction_layer_index, cfg.injection_scale, cfg.mse_scale) == (32, 80000.0, None)
    assert cfg.actor_prompt_template.count("<INJECT>") == 1 and cfg.injection_style == "embedding_replace"


def test_kitft_critic_sidecar_has_no_injection():
    m = upstream.model_sidecar(TOKENS, role="critic", d_model=64, injection_scale=None, mse_scale=8.0, critic_layer=1)
    cfg = parse_sidecar(m)
    assert cfg.injection_style == "residual_add" and cfg.injection_scale is None and cfg.extraction_layer_index == 1


def test_layer_spellings_are_read_in_upstream_order():
    m = upstream.model_sidecar(TOKENS, role="critic", d_model=64, injection_scale=None, mse_scale=None, critic_layer=3)
    m["extraction_layer_index"] = 9  # the released key; a critic.* key says the same thing where both exist
    assert parse_sidecar(m).extraction_layer_index == 3
    del m["critic"]
    assert parse_sidecar(m).extraction_layer_index == 9


@pytest.mark.parametrize("key", ["mse_scale", "injection_scale"])
@pytest.mark.parametrize("raw, resolved", [(None, None), ("sqrt_d_model", 8.0), ("raw", None), (150, 150.0), ("2.5", 2.5)])
def test_scale_variants(key, raw, resolved):
    m = upstream.dataset_sidecar(TOKENS, stage="rl", d_model=64, layer_index=1, row_count=1)
    m["extraction"][key] = raw
    cfg = parse_sidecar(m)
    assert resolve_target_scale(getattr(cfg, key), 64) == resolved


def test_nla_injection_style_key_wins_over_the_inference():
    m = upstream.model_sidecar(TOKENS, role="av", d_model=64, injection_scale=3.0, mse_scale=None, critic_layer=1)
    assert parse_sidecar({**m, "injection_style": "residual_add"}).injection_style == "residual_add"
    with pytest.raises(ValueError, match=r"injection_style.*'bogus'.*residual_add.*embedding_replace"):
        parse_sidecar({**m, "injection_style": "bogus"})


@pytest.mark.parametrize(
    "template, why",
    [("Explain {injection_char} and {other}", "format field"), ("Explain this", r"\{injection_char\}.*<INJECT>"),
     ("<INJECT> and <INJECT>", "exactly once")],
)
def test_bad_actor_templates_name_the_key(template, why):
    m = upstream.dataset_sidecar(TOKENS, stage="rl", d_model=64, layer_index=1, row_count=1, actor_template=template)
    with pytest.raises(ValueError, match=rf"prompt_templates\.actor.*{why}"):
        parse_sidecar(m)


def test_schema_version_outside_upstream_named():
    m = upstream.dataset_sidecar(TOKENS, stage="rl", d_model=64, layer_index=1, row_count=1)
    with pytest.raises(ValueError, match=r"schema_version.*3.*1.*2"):
        parse_sidecar({**m, "schema_version": 3})


@FAST
@given(st.text(alphabet=st.sampled_from("ab {}<>INJECT_x\n"), max_size=30), st.text(alphabet=st.sampled_from("cd {}<>\n"), max_size=30))
def test_upstream_template_round_trip(before, after):
    """upstream_actor_template(content).format(injection_char=c) is the content with <INJECT> -> c."""
    content = before.replace("<INJECT>", "") + "<INJECT>" + after
    template = upstream_actor_template(content)
    assert template.format(injection_char="§") == content.replace("<INJECT>", "§")
    assert actor_content(template) == content
