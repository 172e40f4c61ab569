"""`nla export`: a trained NLA as the files plain transformers, vLLM and the upstream code load.

    out_dir/av/   the AV with its LoRA merged: config.json, model.safetensors, tokenizer,
                  nla_meta.yaml (kind nla_model, role av)
    out_dir/ar/   the AR as upstream lays it out (kitft nla/models.py NLACriticModel):
                  the truncated causal LM (config.json num_hidden_layers = K + 1),
                  value_head.safetensors (key `weight`), tokenizer (right padding),
                  nla_meta.yaml (role ar, critic.extraction_layer_index = K)

Each sidecar is upstream's model layout (docs/sidecar.md) and records the injection style
the AV was trained with. Written into `out_dir/.export_tmp` and moved into place at the end.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

import nla_core
from nla_shell.io.config import ConfigError, normalize_fields
from nla_shell.io.data import DataError
from nla_shell.io.sidecars import (
    MODEL_SIDECAR, Injection, find_sidecar, injection_settings, load_sidecar, model_sidecar, read_sidecar, write_sidecar,
)
from nla_shell.models import ARModel, base_model_dir, load_actor
from nla_shell.pipeline.evaluate import tokenizer_dir


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Settings of `nla export`."""

    out_dir: str
    """Where av/ and ar/ are written."""
    av: str | None = None
    """AV checkpoint: an `nla sft --mode av` step dir, an `nla train` step dir's adapter/, or a full model dir."""
    ar: str | None = None
    """AR checkpoint (backbone + value_head.safetensors), e.g. an `nla sft --mode ar` step dir."""
    sidecar: str | None = None
    """Sidecar (or the parquet / checkpoint dir it belongs to); None takes the AV's nla_meta.yaml, else the AR's."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Weight dtype of the exported models (the value head stays float32, as upstream's)."""
    overwrite: bool = False
    """Replace out_dir/av and out_dir/ar if they exist."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        if self.av is None and self.ar is None:
            raise ConfigError("config keys 'av' and 'ar' are both unset; give at least one checkpoint to export")


def _sidecar_source(cfg: ExportConfig) -> str | Path:
    if cfg.sidecar is not None:
        return cfg.sidecar
    for checkpoint in (cfg.av, cfg.ar):
        if checkpoint is not None and (Path(checkpoint) / MODEL_SIDECAR).is_file():
            return checkpoint
    raise DataError(f"sidecar: no {MODEL_SIDECAR} next to av={cfg.av} or ar={cfg.ar}; pass sidecar= the dataset's sidecar")


def export(cfg: ExportConfig) -> dict[str, Path]:
    """Write the configured exports; returns {"av": dir, "ar": dir} for those written."""
    from transformers import AutoTokenizer

    # --- validate before anything is written ---------------------------------------------
    source = _sidecar_source(cfg)
    nla = load_sidecar(source)
    provenance = dict(read_sidecar(source)[1].get("provenance") or {})
    dtype = getattr(torch, cfg.dtype)
    out_dir = Path(cfg.out_dir)
    parts = [name for name in ("av", "ar") if getattr(cfg, name) is not None]
    existing = [out_dir / name for name in parts if (out_dir / name).exists()]
    if existing and not cfg.overwrite:
        raise ConfigError(
            f"config key 'out_dir' = {str(out_dir)!r} already holds {', '.join(p.name for p in existing)}; "
            "choose another out_dir or set overwrite=true (--overwrite)"
        )
    if cfg.ar is not None and nla.extraction_layer_index is None:
        raise DataError(f"sidecar {find_sidecar(source)}: names no extraction layer; pass sidecar= the AR's or the dataset's")
    tmp = out_dir / ".export_tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    # --- the AV: LoRA merged into the base weights ------------------------------------------
    if cfg.av is not None:
        injection = injection_settings(nla, av_dir=cfg.av)
        actor = load_actor(cfg.av, lora_r=1, lora_alpha=1, use_rslora=True, resume_adapter=None, dtype=torch.float32,
                           device=torch.device("cpu"))
        merged = actor.merge_and_unload().to(dtype)
        merged.save_pretrained(tmp / "av")
        # An RL checkpoint's adapter/ holds no tokenizer: take its base model's.
        AutoTokenizer.from_pretrained(tokenizer_dir(cfg.av)).save_pretrained(tmp / "av")
        write_sidecar(model_sidecar(nla, role="av", stage="export", base_checkpoint=str(base_model_dir(cfg.av)),
                                    injection=injection, trained_on=[],
                                    provenance={**provenance, "export": {"av": str(Path(cfg.av).resolve())}}),
                      tmp / "av" / MODEL_SIDECAR)

    # --- the AR: upstream's critic layout ----------------------------------------------------
    if cfg.ar is not None:
        critic = ARModel.from_pretrained(cfg.ar, mse_scale=nla_core.resolve_target_scale(nla.mse_scale, nla.d_model),
                                         dtype=dtype, full_precision=True)
        if critic.lora is not None:  # an AR-LoRA: upstream's critic is one plain checkpoint
            critic.merge_lora()
        if critic.num_layers != nla.extraction_layer_index + 1:
            raise DataError(
                f"ar: {cfg.ar} keeps {critic.num_layers} blocks but the sidecar's extraction layer is "
                f"{nla.extraction_layer_index} (upstream expects K + 1 = {nla.extraction_layer_index + 1}); "
                "pass the sidecar the AR was trained with"
            )
        critic.save_pretrained(tmp / "ar")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg.ar, cfg.av))
        tokenizer.padding_side = "right"  # kitft nla/scripts/prepare_critic_checkpoint.py
        tokenizer.save_pretrained(tmp / "ar")
        write_sidecar(model_sidecar(nla, role="ar", stage="export", base_checkpoint=str(Path(cfg.ar).resolve()),
                                    injection=Injection(nla.injection_style, None, nla.injection_layer), trained_on=[],
                                    provenance={**provenance, "export": {"ar": str(Path(cfg.ar).resolve())}}),
                      tmp / "ar" / MODEL_SIDECAR)

    # --- move into place ----------------------------------------------------------------------
    written = {}
    for name in parts:
        if (out_dir / name).exists():
            shutil.rmtree(out_dir / name)
        os.replace(tmp / name, out_dir / name)
        written[name] = out_dir / name
    shutil.rmtree(tmp)
    return written

