"""Files laid out exactly as the public NLA code writes them, and readers shaped like theirs.

Upstream: kitft/natural_language_autoencoders (commit 047eb8e, "kitft" below) and
asherps/EasyNLA (commit 4d72847, "EasyNLA"), whose nla/schema.py, nla/config.py and
nla/datagen/sidecar.py agree on the sidecar. Every fact below cites the upstream file it
comes from. Builders write into a directory the caller gives (a pytest tmp_path) and return
paths; the readers re-state upstream's checks, so a round trip through them shows that what
nla writes is what upstream reads. Nothing here imports nla code except where a test hands
an nla artefact in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

# --------------------------------------------------------------------------- constants

SIDECAR_SUFFIX = ".nla_meta.yaml"  # kitft nla/schema.py SIDECAR_SUFFIX
SIDECAR_BASENAME = "nla_meta.yaml"  # kitft nla/schema.py SIDECAR_BASENAME
INJECT_PLACEHOLDER = "<INJECT>"  # kitft nla/schema.py INJECT_PLACEHOLDER
VALUE_HEAD_FILE = "value_head.safetensors"  # kitft nla/models.py NLACriticModel.save_pretrained

# The shape of kitft nla/datagen/stage3_build.py _DEFAULT_ACTOR_TEMPLATE (shortened): the
# marker slot {injection_char} tight inside <concept> tags, filled with str.format.
ACTOR_TEMPLATE = (
    "We will pass a vector enclosed in <concept> tags. Explain it within <explanation> tags.\n\n"
    "<concept>{injection_char}</concept>\n\nPlease provide an explanation."
)
# kitft nla/datagen/stage3_build.py _DEFAULT_CRITIC_TEMPLATE, verbatim: a fixed suffix after
# {explanation} so the AR extracts at the last token.
CRITIC_TEMPLATE = "Summary of the following text: <text>{explanation}</text> <summary>"

# kitft nla/arch_adapters.py _SCALED_EMBED_MODEL_TYPES: model types whose embedding forward
# multiplies by sqrt(hidden_size); every other model type uses 1.0.
SCALED_EMBED_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "t5"})

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])  # stage3_build.py _PROMPT_STRUCT


# --------------------------------------------------------------------------- token facts


def canonical_ids(tokenizer: Any, actor_template: str, injection_char: str) -> list[int]:
    """kitft nla/schema.py compute_canonical_neighbors: the template filled with str.format,
    one user message, apply_chat_template(tokenize=True, add_generation_prompt=True)
    (EasyNLA's copy unwraps a BatchEncoding, as transformers 5 returns one)."""
    content = actor_template.format(injection_char=injection_char)
    enc = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def token_meta(tokenizer: Any, injection_char: str, *, actor_template: str = ACTOR_TEMPLATE,
               critic_template: str | None = None) -> dict[str, Any]:
    """kitft nla/datagen/injection_tokens.py build_token_meta, as the `tokens:` mapping
    (fields of nla/schema.py NLATokenMeta, in order)."""
    (inj,) = tokenizer(injection_char, add_special_tokens=False)["input_ids"]  # injection_tokens.py _tokenize_one
    ids = canonical_ids(tokenizer, actor_template, injection_char)
    (p,) = [i for i, t in enumerate(ids) if t == inj]
    suffix = None
    if critic_template is not None:  # injection_tokens.py compute_critic_suffix_ids: tail minus the boundary token
        suffix = tokenizer(critic_template.split("{explanation}")[-1], add_special_tokens=False)["input_ids"][1:]
    return {"injection_char": injection_char, "injection_token_id": inj, "injection_left_neighbor_id": ids[p - 1],
            "injection_right_neighbor_id": ids[p + 1], "critic_suffix_ids": suffix}


# --------------------------------------------------------------------------- sidecars


def dataset_sidecar(
    tokens: Mapping[str, Any],
    *,
    stage: str,
    d_model: int,
    layer_index: int,
    row_count: int,
    actor_template: str = ACTOR_TEMPLATE,
    critic_template: str = CRITIC_TEMPLATE,
) -> dict[str, Any]:
    """What kitft nla/datagen/stage3_build.py writes: asdict(NLADatasetMeta) with None-valued
    top-level keys dropped (nla/datagen/sidecar.py serialize_sidecar), fields in dataclass order.
    No scale keys: datagen leaves them to training (nla/config.py then uses sqrt_d_model for
    mse_scale and None for injection_scale)."""
    return {
        "dataset_id": f"{stage}_abcd1234",
        "stage": stage,
        "row_count": row_count,
        "extraction": {  # sidecar.py NLAExtractionMeta
            "base_model": "Qwen/Qwen2.5-7B-Instruct",
            "d_model": d_model,
            "layer_index": layer_index,
            "norm": "none",
            "corpus": "HuggingFaceFW/fineweb",
            "corpus_slice": {"start": 0, "length": row_count},  # stage0_extract.py
            "positions_per_doc": 4,
        },
        "kind": "nla_dataset",
        "schema_version": 1,
        "keep_debug_metadata": True,
        "tokens": dict(tokens),
        "prompt_templates": {"actor": actor_template, "critic": critic_template},
        "parent_datasets": ["base_abcd1234"],
        "created_at": "2026-01-01T00:00:00+00:00",
        "created_by": "nla.datagen.stage3_build",
        "git_commit": "047eb8e",
    }


def model_sidecar(
    tokens: Mapping[str, Any],
    *,
    role: str,
    d_model: int,
    injection_scale: float | None,
    mse_scale: float | None,
    critic_layer: int | None,
    layer_key: str = "extraction_layer_index",
    actor_template: str = ACTOR_TEMPLATE,
    critic_template: str = CRITIC_TEMPLATE,
) -> dict[str, Any]:
    """kitft nla/config.py write_model_sidecar (schema_version 2): top-level d_model, resolved
    scales under extraction.*, critic.extraction_layer_index only when set. layer_key
    "num_hidden_layers" gives the schema-v1 spelling config.py still reads."""
    meta: dict[str, Any] = {
        "kind": "nla_model",
        "schema_version": 2,
        "role": role,
        "stage": "sft",
        "base_checkpoint": "Qwen/Qwen2.5-7B-Instruct",
        "d_model": d_model,
        "extraction": {"injection_scale": injection_scale, "mse_scale": mse_scale},
        "tokens": dict(tokens),
        "prompt_templates": {"actor": actor_template, "critic": critic_template},
        "trained_on": ["gs://bucket/av_sft.parquet"],
        "parent_checkpoints": ["Qwen/Qwen2.5-7B-Instruct"],
        "created_at": "2026-01-01T00:00:00+00:00",
        "created_by": "nla.train_actor",
    }
    if critic_layer is not None:
        meta["critic"] = {layer_key: critic_layer}
    return meta


def released_sidecar(model_meta: Mapping[str, Any], *, layer_index: int) -> dict[str, Any]:
    """kitft release/hf_stage_and_scrub.py stage_and_scrub: role actor->av / critic->ar,
    prompt_templates actor->av / critic->ar, a top-level extraction_layer_index."""
    d = json.loads(json.dumps(model_meta))
    d["role"] = {"actor": "av", "critic": "ar"}.get(d.get("role"), d.get("role"))
    d["extraction_layer_index"] = layer_index
    pt = d.get("prompt_templates", {})
    if "actor" in pt:
        pt["av"] = pt.pop("actor")
    if "critic" in pt:
        pt["ar"] = pt.pop("critic")
    return d


def write_sidecar(mapping: Mapping[str, Any], path: Path) -> Path:
    """kitft nla/datagen/sidecar.py serialize_sidecar: yaml.safe_dump(d, sort_keys=False)
    (non-ASCII characters such as the injection char come out escaped)."""
    path.write_text(yaml.safe_dump(dict(mapping), sort_keys=False))
    return path


# --------------------------------------------------------------------------- parquets


def write_parquet(path: Path, *, stage: str, prompts: Sequence[Any], activations: np.ndarray,
                  doc_ids: Sequence[str], responses: Sequence[str] | None = None, layer_index: int = 1) -> Path:
    """kitft nla/datagen/stage3_build.py _schema_for: prompt (chat messages; AR-SFT: the filled
    critic template as a string), response (AV-SFT), activation_vector as
    fixed_size_list<float32>[d_model], then n_raw_tokens, activation_layer, doc_id."""
    n, d = activations.shape
    columns: dict[str, pa.Array] = {
        "prompt": pa.array(list(prompts), type=pa.string() if stage == "ar_sft" else pa.list_(_MESSAGE)),
    }
    if stage == "av_sft":
        columns["response"] = pa.array(list(responses or ()), type=pa.string())
    columns["activation_vector"] = pa.FixedSizeListArray.from_arrays(pa.array(activations.astype(np.float32).reshape(-1)), d)
    columns["n_raw_tokens"] = pa.array(np.arange(n) % 50 + 5, type=pa.int64())
    columns["activation_layer"] = pa.array([layer_index] * n, type=pa.int64())
    columns["doc_id"] = pa.array(list(doc_ids), type=pa.string())
    pq.write_table(pa.table(columns), path, row_group_size=16)
    return path


def wrap_explanation(text: str) -> str:
    """kitft nla/schema.py wrap_explanation: the AV-SFT response column."""
    return f"<explanation>\n{text}\n</explanation>"


def write_dataset(directory: Path, tokenizer: Any, *, stage: str, n_rows: int, d_model: int, layer_index: int,
                  injection_char: str, seed: int = 0, critic_template: str = CRITIC_TEMPLATE) -> Path:
    """`<stage>.parquet` + `<stage>.parquet.nla_meta.yaml` as kitft stage3_build writes them; returns the parquet."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((n_rows, d_model)).astype(np.float32)
    docs = [f"doc{i % max(n_rows // 2, 1):04d}" for i in range(n_rows)]
    explanations = [f"a sentence about item {i} and the word cat" for i in range(n_rows)]
    message = [{"role": "user", "content": ACTOR_TEMPLATE.format(injection_char=INJECT_PLACEHOLDER)}]
    prompts: list[Any] = (
        [critic_template.format(explanation=e) for e in explanations] if stage == "ar_sft" else [message] * n_rows
    )
    path = directory / f"{stage}.parquet"
    write_parquet(path, stage=stage, prompts=prompts, activations=acts, doc_ids=docs,
                  responses=[wrap_explanation(e) for e in explanations], layer_index=layer_index)
    tokens = token_meta(tokenizer, injection_char, critic_template=critic_template if stage == "ar_sft" else None)
    write_sidecar(dataset_sidecar(tokens, stage=stage, d_model=d_model, layer_index=layer_index, row_count=n_rows,
                                  critic_template=critic_template), path.with_name(path.name + SIDECAR_SUFFIX))
    return path


def easynla_checkpoint_sidecar(directory: Path, dataset_parquet: Path) -> Path:
    """EasyNLA nla/train_rl_vllm.py: an RL save dir gets a copy of the dataset sidecar (kind
    nla_dataset) as nla_meta.yaml, next to its LoRA checkpoints; returns the dir."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy2(dataset_parquet.with_name(dataset_parquet.name + SIDECAR_SUFFIX), directory / SIDECAR_BASENAME)
    return directory


# --------------------------------------------------------------------------- upstream-shaped readers


def sidecar_path_for(path: str | Path) -> Path:
    """kitft nla/schema.py sidecar_path_for: strip `@[...]`; a dir (or extension-less path) gets
    nla_meta.yaml inside, a file gets the .nla_meta.yaml suffix."""
    p = Path(str(path).split("@[")[0])
    if p.is_dir() or (not p.exists() and p.suffix == ""):
        return p / SIDECAR_BASENAME
    return p.with_name(p.name + SIDECAR_SUFFIX)


def resolve_target_scale(raw: Any, d_model: int) -> float | None:
    """kitft nla/schema.py resolve_target_scale."""
    if raw is None or raw in ("raw", "none"):
        return None
    if raw == "sqrt_d_model":
        return math.sqrt(d_model)
    if isinstance(raw, str):
        return float(raw)
    assert isinstance(raw, (int, float)), raw
    return float(raw)


@dataclasses.dataclass(frozen=True)
class UpstreamConfig:
    """The fields of kitft nla/config.py NLAConfig that nla must agree on."""

    d_model: int
    injection_char: str
    injection_token_id: int
    injection_left_neighbor_id: int
    injection_right_neighbor_id: int
    actor_prompt_template: str
    critic_prompt_template: str | None
    critic_num_layers: int | None
    injection_scale: float | None
    mse_scale: float | None


def load_config(source: str | Path, tokenizer: Any) -> UpstreamConfig:
    """kitft nla/config.py load_nla_config, its asserts included (tokenizer drift, one marker,
    neighbours)."""
    meta = yaml.safe_load(sidecar_path_for(source).read_text())
    kind = meta["kind"]
    assert kind in ("nla_model", "nla_dataset"), kind
    if kind == "nla_dataset":
        extraction = meta["extraction"]
        d_model = extraction["d_model"]
    else:
        d_model = meta["d_model"]
        extraction = meta.get("extraction", {})
    t = meta["tokens"]
    templates = meta.get("prompt_templates", {})
    critic_meta = meta.get("critic") or {}
    cfg = UpstreamConfig(
        d_model=d_model,
        injection_char=t["injection_char"],
        injection_token_id=t["injection_token_id"],
        injection_left_neighbor_id=t["injection_left_neighbor_id"],
        injection_right_neighbor_id=t["injection_right_neighbor_id"],
        actor_prompt_template=templates.get("av") or templates["actor"],
        critic_prompt_template=templates.get("ar") or templates.get("critic"),
        critic_num_layers=critic_meta.get("extraction_layer_index", critic_meta.get("num_hidden_layers")),
        injection_scale=resolve_target_scale(extraction.get("injection_scale"), d_model),
        mse_scale=resolve_target_scale(extraction.get("mse_scale", "sqrt_d_model"), d_model),
    )
    assert tokenizer.encode(cfg.injection_char, add_special_tokens=False) == [cfg.injection_token_id]
    ids = canonical_ids(tokenizer, cfg.actor_prompt_template, cfg.injection_char)
    matches = [i for i, tid in enumerate(ids) if tid == cfg.injection_token_id]
    assert len(matches) == 1 and 0 < matches[0] < len(ids) - 1, matches
    p = matches[0]
    assert (ids[p - 1], ids[p + 1]) == (cfg.injection_left_neighbor_id, cfg.injection_right_neighbor_id)
    return cfg


_EXTRACTION_FIELDS = ("base_model", "d_model", "layer_index", "norm", "corpus", "corpus_slice", "positions_per_doc")
_TOKEN_FIELDS = ("injection_char", "injection_token_id", "injection_left_neighbor_id", "injection_right_neighbor_id",
                 "critic_suffix_ids")
_DATASET_REQUIRED = ("dataset_id", "stage", "row_count", "extraction")
_API_SUMMARY_FIELDS = ("model", "max_tokens", "temperature", "instruction_prompt")


def deserialize_dataset_sidecar(text: str) -> dict[str, Any]:
    """kitft nla/datagen/sidecar.py deserialize_sidecar: kind and schema_version 1 asserted;
    extraction, tokens and api_summaries built as dataclasses, so a missing or unknown field
    raises TypeError; unknown top-level keys are dropped."""
    d = yaml.safe_load(text)
    assert d["kind"] == "nla_dataset", d["kind"]
    assert d["schema_version"] == 1, d["schema_version"]
    missing = [k for k in _EXTRACTION_FIELDS if k not in d["extraction"]]
    unknown = [k for k in d["extraction"] if k not in _EXTRACTION_FIELDS]
    if missing or unknown:
        raise TypeError(f"NLAExtractionMeta: missing {missing}, unexpected {unknown}")
    if d.get("tokens") is not None:
        unknown = [k for k in d["tokens"] if k not in _TOKEN_FIELDS]
        missing = [k for k in _TOKEN_FIELDS[:4] if k not in d["tokens"]]
        if missing or unknown:
            raise TypeError(f"NLATokenMeta: missing {missing}, unexpected {unknown}")
    if d.get("api_summaries") is not None:  # NLAApiSummaryMeta(**d["api_summaries"])
        keys = sorted(d["api_summaries"])
        if keys != sorted(_API_SUMMARY_FIELDS):
            raise TypeError(f"NLAApiSummaryMeta: fields {keys}, expected {sorted(_API_SUMMARY_FIELDS)}")
    missing = [k for k in _DATASET_REQUIRED if k not in d]
    if missing:
        raise TypeError(f"NLADatasetMeta: missing {missing}")
    return d


def read_rows(path: Path) -> list[dict[str, Any]]:
    """kitft nla/data_source.py: activation_vector must be there; a list prompt must hold
    <INJECT> in a message content, otherwise the prompt must be a string."""
    pf = pq.ParquetFile(path)
    assert "activation_vector" in pf.schema_arrow.names
    rows = pq.read_table(path).to_pylist()
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            assert any(INJECT_PLACEHOLDER in m.get("content", "") for m in prompt)
        else:
            assert isinstance(prompt, str)
    return rows


def extract_explanation(response: str) -> str | None:
    """kitft nla/schema.py extract_explanation: first tagged payload, stripped."""
    m = re.search(r"<explanation>(.*?)</explanation>", response, re.DOTALL)
    return m.group(1).strip() if m else None


# --------------------------------------------------------------------------- kitft's AV, by hand


def embed_scale(config: Any) -> float:
    """kitft nla/arch_adapters.py resolve_embed_scale (text_config when nested)."""
    text_config = getattr(config, "text_config", config)
    return math.sqrt(text_config.hidden_size) if text_config.model_type in SCALED_EMBED_MODEL_TYPES else 1.0


def normalize_activation(v: torch.Tensor, target_scale: float | None) -> torch.Tensor:
    """kitft nla/schema.py normalize_activation."""
    if target_scale is None:
        return v
    norm_fp32 = v.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return v / (norm_fp32 / target_scale).to(v.dtype)


def kitft_logits(model: torch.nn.Module, checkpoint_dir: Path, tokenizer: Any, activation: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """What kitft's nla_inference.py NLAClient._build_embeds feeds the AV, run through `model`:
    the canonical prompt's ids, the raw embedding rows times the model type's embedding scale,
    the marker row (neighbours checked) overwritten by the activation at L2 norm
    extraction.injection_scale; returns (ids, [T, V] float32 logits)."""
    meta = yaml.safe_load((checkpoint_dir / SIDECAR_BASENAME).read_text())
    t = meta["tokens"]
    template = meta["prompt_templates"].get("av") or meta["prompt_templates"]["actor"]
    ids = canonical_ids(tokenizer, template, t["injection_char"])
    weight = model.get_input_embeddings().weight.detach()
    embeds = (weight[torch.tensor(ids)] * embed_scale(model.config)).float().unsqueeze(0)
    v = normalize_activation(activation.float().view(1, -1), float(meta["extraction"]["injection_scale"]))
    sites = [p for p in range(1, len(ids) - 1) if ids[p] == t["injection_token_id"]
             and ids[p - 1] == t["injection_left_neighbor_id"] and ids[p + 1] == t["injection_right_neighbor_id"]]
    assert len(sites) == 1, sites
    embeds[0, sites[0]] = v[0]
    with torch.no_grad():
        logits = model(inputs_embeds=embeds.to(weight.dtype)).logits[0].float()
    return ids, logits
