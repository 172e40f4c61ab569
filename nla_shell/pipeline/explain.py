"""`nla explain`: read a text's activations with the target LM, explain them with the AV, rebuild them with the AR.

For each position asked, the residual at the sidecar's extraction layer is captured
exactly as datagen does, the AV writes one explanation (temperature 1, seeded, or greedy),
and the AR's reconstruction from that explanation gives the MSE and the FVE against the
predict-the-mean baseline stored by `nla sft` in the AR's (or AV's) `nla_meta.yaml`.
A position with fewer tokens before it than datagen's `min_context` (from the provenance of
the datasets the AV was trained on) is flagged: the AV was never trained on one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

import nla_core
from nla_shell import families
from nla_shell.io.config import ConfigError, normalize_fields
from nla_shell.io.data import DataError, av_prompt_messages, build_prompt_ids, check_tokenizer
from nla_shell.io.sidecars import MODEL_SIDECAR, injection_settings, load_sidecar, read_sidecar
from nla_shell.io.paths import require_file, require_model
from nla_shell.pipeline.datagen import DatagenConfig, capture_activations
from nla_shell.engines.base import RolloutRequest
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.pipeline.evaluate import check_model_reads_training_data, load_av, tokenizer_dir
from nla_shell.models import ARModel, Injector
from nla_shell.training.scoring import score_explanations
from nla_shell.training.train import resolve_device


@dataclass(frozen=True, kw_only=True)
class ExplainConfig:
    """Settings of `nla explain`."""

    av: str
    """AV: an adapter dir (SFT or an RL checkpoint's adapter/) or a full checkpoint."""
    ar: str
    """AR dir."""
    model: str
    """Target LM whose activations are explained (HF checkpoint dir with tokenizer)."""
    text: str
    """The text to read."""
    position: int | None = None
    """Token index to explain (negative counts from the end); None with all=false explains the last token."""
    all: bool = False
    """Explain every position."""
    sidecar: str | None = None
    """Sidecar; None reads nla_meta.yaml from the AV dir, else from the AR dir."""
    max_new_tokens: int = 64
    """Longest explanation, in tokens."""
    greedy: bool = False
    """Argmax decoding instead of sampling at temperature 1 (then seed does not matter)."""
    seed: int = 0
    """Seed of the AV's sampling."""
    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype ("auto": bf16 on cuda, fp32 on cpu)."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        if self.all and self.position is not None:
            raise ConfigError("config keys 'position' and 'all' exclude each other; give one")


def _model_sidecar_path(cfg: ExplainConfig) -> Path:
    if cfg.sidecar is not None:
        return Path(cfg.sidecar)
    for directory in (cfg.av, cfg.ar):
        if (Path(directory) / MODEL_SIDECAR).is_file():
            return Path(directory) / MODEL_SIDECAR
    raise DataError(f"sidecar: no {MODEL_SIDECAR} in {cfg.av} or {cfg.ar}; pass sidecar= the dataset's sidecar")


def trained_min_context(sidecar: Mapping[str, Any]) -> tuple[int, bool]:
    """(min_context, recorded): datagen's value from the provenance of this sidecar (a dataset's) or of
    the datasets a model sidecar lists under `trained_on`; else datagen's default with recorded=False."""
    sources = [sidecar]
    for parquet in sidecar.get("trained_on") or []:
        try:
            sources.append(read_sidecar(parquet)[1])
        except DataError:  # the training data moved or is gone: fall back to the default
            continue
    for source in sources:
        min_context = (source.get("provenance") or {}).get("min_context")
        if isinstance(min_context, int):
            return min_context, True
    return DatagenConfig.min_context, False


def explain(cfg: ExplainConfig) -> list[dict[str, Any]]:
    """Explain the asked positions of cfg.text; prints one block per position and returns them as dicts."""
    for key, hub_ok in (("av", True), ("ar", False), ("model", True)):
        require_model(key, getattr(cfg, key), hub_ok=hub_ok)
    require_file("sidecar", cfg.sidecar)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    sidecar_path = _model_sidecar_path(cfg)
    nla = load_sidecar(sidecar_path)
    meta = read_sidecar(sidecar_path)[1]
    rawvar = (meta.get("baselines") or {}).get("rawvar")
    min_context, recorded = trained_min_context(meta)
    target_tokenizer = families.load_tokenizer(cfg.model)
    tokenizer = families.load_tokenizer(tokenizer_dir(cfg.av, cfg.ar))
    check_tokenizer(nla, tokenizer)
    ids = target_tokenizer.encode(cfg.text, add_special_tokens=False)
    if not ids:
        raise ValueError("text encodes to no tokens; give some text")
    if cfg.all:
        positions = list(range(len(ids)))
    else:
        position = -1 if cfg.position is None else cfg.position
        if not -len(ids) <= position < len(ids):
            raise ValueError(f"position {position} is outside the text's {len(ids)} tokens (0..{len(ids) - 1})")
        positions = [position % len(ids)]

    # --- capture, explain, reconstruct ---------------------------------------------------------
    target = families.load_causal_lm(cfg.model, dtype=dtype).to(device).eval()
    if target.config.hidden_size != nla.d_model:
        raise ValueError(f"model {cfg.model} has hidden size {target.config.hidden_size}, the sidecar's d_model is {nla.d_model}")
    if nla.extraction_layer_index is None:
        raise DataError(f"sidecar {sidecar_path}: names no extraction layer ({', '.join(nla_core.sidecar.LAYER_KEYS)}); "
                        "pass sidecar= the AR's or the dataset's sidecar")
    if check_model_reads_training_data(target, target_tokenizer, meta, nla, model_name=cfg.model, device=device) is None:
        print(f"[explain] note: no training parquet in the sidecar's trained_on is left to check that {cfg.model} is "
              "the LM this NLA was trained on", flush=True)
    acts = capture_activations(target, torch.tensor([ids], device=device), torch.ones(1, len(ids), dtype=torch.long,
                               device=device), nla.extraction_layer_index)[0, positions].cpu()
    actor = load_av(cfg.av, dtype=dtype, device=device)
    style, injection_norm = injection_settings(nla, av_dir=cfg.av)
    injector = Injector(actor, marker_id=nla.injection_token_id, left_id=nla.injection_left_neighbor_id,
                        right_id=nla.injection_right_neighbor_id, style=style, injection_norm=injection_norm)
    prompt = tuple(build_prompt_ids(av_prompt_messages(nla.actor_prompt_template), nla, tokenizer))
    torch.manual_seed(cfg.seed)
    rollouts = HFRolloutEngine(actor, injector, tokenizer, greedy=cfg.greedy).generate(
        [RolloutRequest(prompt, a) for a in acts], group_size=1, max_new_tokens=cfg.max_new_tokens
    )
    explanations = [nla_core.extract_explanation(r.text) for r in rollouts]
    mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
    critic = ARModel.from_pretrained(cfg.ar, mse_scale=mse_scale, dtype=dtype, device=device).eval()
    scores = score_explanations(critic, tokenizer, explanations, acts, template=nla.critic_prompt_template,
                                mse_scale=mse_scale, reward_kind="neg_log", max_tokens=1024, micro_batch=64)

    # --- report ------------------------------------------------------------------------------
    results = []
    for i, p in enumerate(positions):
        mse = float(scores.mse[i])
        fve = nla_core.fve(mse, rawvar) if rawvar is not None and math.isfinite(mse) else None
        result = {"position": p, "token": target_tokenizer.decode([ids[p]]), "context": target_tokenizer.decode(ids[: p + 1]),
                  "explanation": explanations[i], "raw": rollouts[i].text, "mse": mse if math.isfinite(mse) else None,
                  "fve": fve, "short_context": p < min_context}
        results.append(result)
        shown = explanations[i] if explanations[i] is not None else f"<no explanation extracted from {rollouts[i].text!r}>"
        if not math.isfinite(mse):
            score = "no reconstruction: nothing extracted for the AR"
        else:
            score = f"mse {mse:.4f} | " + (f"FVE {fve:.1%}" if fve is not None else "FVE n/a (no baselines in the sidecar)")
        print(f"[{p}] token {result['token']!r} | context …{result['context'][-60:]!r}\n    {shown}\n    {score}", flush=True)
        if result["short_context"]:
            print(f"    note: only {p} token(s) before this position; datagen sampled positions with >= {min_context}"
                  f"{'' if recorded else ' (its default; the sidecar records none)'}, so the AV never trained on one "
                  "this short", flush=True)
    return results
