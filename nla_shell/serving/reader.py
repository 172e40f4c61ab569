"""The activation reader: a trained NLA loaded once, explaining activations in batches.

`load_reader` loads the sidecar, both tokenizers, the target LM (when a text or corpus is to be
read), the AV behind a rollout engine (hf, native or vllm) and the AR. `NLAReader.capture`
reads the residual at the sidecar's extraction layer exactly as datagen does;
`NLAReader.explain` samples `samples` explanations per vector in one engine call, scores every
one with the AR, and keeps the best (lowest reconstruction MSE; best-of-k) beside all k, with
the AR's reconstruction from it (the scoring pass's own; no second AR forward).
`nla explain` (one text or a corpus) and `nla serve` are both built on it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import torch

import nla_core
from nla_shell import families
from nla_shell.engines.base import Rollout, RolloutEngine, RolloutRequest
from nla_shell.training.config import VLLMQuantization
from nla_shell.io.data import DataError, av_prompt_messages, build_prompt_ids, check_tokenizer
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.sidecars import MODEL_SIDECAR, injection_settings, load_sidecar, read_sidecar
from nla_shell.models import ARModel, Injector, base_model_dir, pad_right
from nla_shell.pipeline.datagen import capture_activations
from nla_shell.pipeline.datagen_config import DatagenConfig
from nla_shell.pipeline.evaluate import load_av, tokenizer_dir
from nla_shell.pipeline.splice import check_model_reads_training_data
from nla_shell.training.scoring import ar_predictions, ar_token_ids, reconstruct_explanations
from nla_shell.training.runtime import resolve_device

EngineName = Literal["hf", "native", "vllm"]

AR_MAX_TOKENS = 1024
"""Longest AR input scored; a longer explanation counts as failed (as in `nla eval`)."""


@dataclass(frozen=True, kw_only=True)
class ReaderSettings:
    """What loads an NLA for reading: the keys `nla explain` and `nla serve` share."""

    av: str
    """AV: an adapter dir (SFT or an RL checkpoint's adapter/) or a full checkpoint."""
    ar: str
    """AR dir."""
    sidecar: str | None = None
    """Sidecar; None reads nla_meta.yaml from the AV dir, else from the AR dir."""
    engine: EngineName = "hf"
    """Rollout engine: HF generate, the native engine (CUDA graphs on GPU), or vLLM (pip install 'nla[vllm]')."""
    vllm_gpu_mem: float = 0.85
    """engine=vllm: share of the GPU's memory vLLM may take."""
    vllm_max_len: int = 1024
    """engine=vllm: longest sequence (prompt + explanation)."""
    vllm_quantization: VLLMQuantization = "none"
    """engine=vllm: vLLM's online FP8 of the AV's linear layers (as `nla train`'s vllm_quantization: the merged
    weights are quantised as they are pushed); "none" reads in bf16. An nla addition; measured in training rollouts only (docs/engines.md)."""
    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype ("auto": bf16 on cuda, fp32 on cpu)."""


@dataclass(frozen=True)
class SiteExplanation:
    """What the NLA says about one activation vector."""

    explanations: list[str | None]
    """All k sampled explanations (None where no <explanation> could be extracted)."""
    raw: list[str]
    """The k generated texts as decoded."""
    mses: list[float | None]
    """Normalised reconstruction MSE of each explanation (None where it could not be scored)."""
    best: int
    """Index of the kept explanation: the lowest MSE (the first sample when none scored)."""
    fve: float | None
    """FVE of the kept explanation against the AR's predict-the-mean baseline (None without one)."""
    reconstruction: torch.Tensor | None
    """[D] float32 AR reconstruction from the kept explanation (None where it could not be scored)."""
    generated_tokens: int
    """Tokens generated for the k samples together."""

    @property
    def explanation(self) -> str | None:
        return self.explanations[self.best]

    @property
    def mse(self) -> float | None:
        return self.mses[self.best]


def baseline_rawvar(sidecar_paths: Sequence[Path]) -> float | None:
    """The predict-the-mean baseline (`baselines.rawvar`) of the first sidecar that records one.

    `nla sft` writes it into every checkpoint it saves; an RL adapter's sidecar has none, so the
    AR's (listed first by the callers) is where it is found.
    """
    for path in sidecar_paths:
        if path.is_file():
            rawvar = (read_sidecar(path)[1].get("baselines") or {}).get("rawvar")
            if isinstance(rawvar, (int, float)):
                return float(rawvar)
    return None


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


def model_sidecar_path(av: str, ar: str, sidecar: str | None) -> Path:
    """The sidecar that defines the prompt and marker: `sidecar` when given, else the AV's, else the AR's."""
    if sidecar is not None:
        return Path(sidecar)
    for directory in (av, ar):
        if (Path(directory) / MODEL_SIDECAR).is_file():
            return Path(directory) / MODEL_SIDECAR
    raise DataError(f"sidecar: no {MODEL_SIDECAR} in {av} or {ar}; pass sidecar= the dataset's sidecar")


class NLAReader:
    """An AV behind a rollout engine and an AR, with the sidecar and tokenizers that tie them together."""

    def __init__(self, *, nla: nla_core.NLAConfig, sidecar_path: Path, meta: Mapping[str, Any], rawvar: float | None,
                 tokenizer, target_tokenizer, target: torch.nn.Module | None, engine: RolloutEngine,
                 critic: ARModel, prompt: tuple[int, ...], engine_name: str, model: str | None) -> None:
        self.nla, self.sidecar_path, self.meta, self.rawvar = nla, sidecar_path, meta, rawvar
        self.tokenizer, self.target_tokenizer, self.target = tokenizer, target_tokenizer, target
        self.engine, self.critic, self.prompt = engine, critic, prompt
        self.engine_name, self.model = engine_name, model
        self.mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
        self.min_context, self.min_context_recorded = trained_min_context(meta)

    @property
    def d_model(self) -> int:
        return self.nla.d_model

    @property
    def device(self) -> torch.device:
        return self.critic.value_head.weight.device

    def capture(self, token_lists: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The residuals at the extraction layer: per text, [len(positions[i]), D] float32 on CPU.

        Each text is cut after its last asked position (later tokens cannot change a causal
        model's earlier residuals), and the cut texts run as one right-padded batch.
        """
        if self.target is None:
            raise ValueError("this reader was loaded without a target model (model=); it reads vectors only")
        cut = [list(ids[: max(p) + 1]) for ids, p in zip(token_lists, positions, strict=True)]
        ids, mask = pad_right(cut, self.target_tokenizer.pad_token_id, self.device)
        acts = capture_activations(self.target, ids, mask, self.nla.extraction_layer_index).cpu()
        return [acts[row, list(p)] for row, p in enumerate(positions)]

    def explain(self, vectors: torch.Tensor, *, samples: int, greedy: bool, max_new_tokens: int,
                pad_to: int | None = None) -> list[SiteExplanation]:
        """Explain each of vectors [N, D]: `samples` explanations each, from one engine call, scored by the AR.

        The AR runs once over all N x samples explanations (micro-batched): its predictions give
        each MSE, and the kept explanation's prediction is returned as the site's reconstruction.
        pad_to: the engine generates for at least this many prompts (the extra ones repeat the
        first and are dropped unscored), so that an engine with CUDA graphs per batch shape (the
        native one) decodes one shape however many sites come (`nla serve`'s batches vary).
        """
        self.engine.greedy = greedy  # every engine make_engine builds decodes by argmax while this is set
        requests = [RolloutRequest(self.prompt, v) for v in vectors.float()]
        padding = requests[:1] * max((pad_to or 0) - len(requests), 0)
        rollouts = self.engine.generate(requests + padding, group_size=samples,
                                        max_new_tokens=max_new_tokens)[: len(requests) * samples]
        return self.site_results(vectors, rollouts, samples=samples)

    def site_results(self, vectors: torch.Tensor, rollouts: Sequence[Rollout], *,
                     samples: int) -> list[SiteExplanation]:
        """The sites' explanations from their rollouts (site-major: vectors[i]'s `samples` first), scored by one AR
        pass; each site keeps its best. `explain` ends here, and `nla serve`'s continuous batching calls it per
        request as its rows finish."""
        texts = [nla_core.extract_explanation(r.text) for r in rollouts]
        golds = vectors.float().repeat_interleave(samples, dim=0)
        preds, mses = self._score(texts, golds)
        results = []
        for i in range(len(vectors)):
            rows = range(i * samples, (i + 1) * samples)
            scored = [r for r in rows if mses[r] is not None]
            best = min(scored, key=lambda r: mses[r]) if scored else rows[0]
            results.append(SiteExplanation(
                explanations=[texts[r] for r in rows], raw=[rollouts[r].text for r in rows],
                mses=[mses[r] for r in rows], best=best - rows[0],
                fve=nla_core.fve(mses[best], self.rawvar) if mses[best] is not None and self.rawvar else None,
                reconstruction=preds[best].clone() if best in preds else None,
                generated_tokens=sum(rollouts[r].response_len for r in rows)))
        return results

    def _score(self, texts: Sequence[str | None], golds: torch.Tensor) -> tuple[dict[int, torch.Tensor], list[float | None]]:
        """One AR pass over the explanations (the trainer's scoring pass, `reconstruct_explanations`): {row: [D]
        float32 prediction on CPU} of the scored rows, and each row's normalised MSE (None where unscored)."""
        read = reconstruct_explanations(self.critic, self.tokenizer, texts, golds,
                                        template=self.nla.critic_prompt_template, mse_scale=self.mse_scale,
                                        max_tokens=AR_MAX_TOKENS, micro_batch=64)
        mses = [float(m) if math.isfinite(float(m)) else None for m in read.mse]
        return {i: read.predictions[i] for i, m in enumerate(mses) if m is not None}, mses

    def _predict(self, texts: Sequence[str | None]) -> torch.Tensor:
        """[N, D] AR predictions from N explanations; NaN rows where one is absent or does not fit the AR."""
        inputs = [ar_token_ids(t, self.nla.critic_prompt_template, self.tokenizer, max_tokens=AR_MAX_TOKENS)
                  for t in texts]
        return ar_predictions(self.critic, inputs, pad_id=self.tokenizer.pad_token_id, micro_batch=64)

    def reconstruct(self, results: Sequence[SiteExplanation]) -> list[SiteExplanation]:
        """The AR's reconstruction from each kept explanation, by a separate AR pass.

        `explain` already returns it (from the scoring pass); this recomputes it, for results
        built elsewhere and for checking that the two agree.
        """
        pred = self._predict([r.explanation if r.mse is not None else None for r in results])
        return [replace(r, reconstruction=None if r.mse is None or pred[i].isnan().any() else pred[i])
                for i, r in enumerate(results)]

    def info(self) -> dict[str, Any]:
        """What this reader is: model, layer, width, marker, engine (the server's /v1/info)."""
        return {"model": self.model, "av_base_model": self.meta.get("base_checkpoint"),
                "layer": self.nla.extraction_layer_index, "d_model": self.d_model,
                "marker": self.nla.injection_char, "marker_token_id": self.nla.injection_token_id,
                "engine": self.engine_name, "fve_baseline": self.rawvar}


def make_engine(name: EngineName, actor, injector: Injector, tokenizer, *, av: str, max_batch: int, vllm_gpu_mem: float,
                vllm_max_len: int, vllm_quantization: VLLMQuantization) -> RolloutEngine:
    """The rollout engine `name` on the loaded AV; vLLM gets the LoRA-merged weights pushed once."""
    if name == "hf":
        from nla_shell.engines.hf import HFRolloutEngine

        return HFRolloutEngine(actor, injector, tokenizer, max_batch=max_batch)
    if name == "native":
        from nla_shell.engines.native import NativeRolloutEngine

        return NativeRolloutEngine(actor, injector, tokenizer, max_batch=max_batch)
    from nla_shell.engines.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine(base_model_dir(av), tokenizer, **injector.vllm_kwargs(),
                               gpu_memory_utilization=vllm_gpu_mem, max_model_len=vllm_max_len, max_num_seqs=max_batch,
                               quantization=None if vllm_quantization == "none" else vllm_quantization)
    engine.sync_weights(actor)
    return engine


def load_reader(settings: ReaderSettings, *, model: str | None, max_batch: int = 256) -> NLAReader:
    """Check the paths, then load the NLA (and the target LM when `model` is given) for reading.

    max_batch: most sequences (sites x samples) the engine decodes at once.
    """
    av, ar, sidecar, engine = settings.av, settings.ar, settings.sidecar, settings.engine
    for key, value, hub_ok in (("av", av, True), ("ar", ar, False), ("model", model, True)):
        require_model(key, value, hub_ok=hub_ok)
    require_file("sidecar", sidecar)
    device_, dtype_ = resolve_device(settings.device, settings.dtype)
    sidecar_path = model_sidecar_path(av, ar, sidecar)
    nla = load_sidecar(sidecar_path)
    if nla.extraction_layer_index is None:
        raise DataError(f"sidecar {sidecar_path}: names no extraction layer ({', '.join(nla_core.sidecar.LAYER_KEYS)}); "
                        "pass sidecar= the AR's or the dataset's sidecar")
    rawvar = baseline_rawvar([Path(ar) / MODEL_SIDECAR, sidecar_path, Path(av) / MODEL_SIDECAR])
    tokenizer = families.load_tokenizer(tokenizer_dir(av, ar))
    check_tokenizer(nla, tokenizer)
    target = target_tokenizer = None
    if model is not None:
        target_tokenizer = families.load_tokenizer(model)
        target = families.load_causal_lm(model, dtype=dtype_).to(device_).eval()
        if target.config.hidden_size != nla.d_model:
            raise ValueError(f"model {model} has hidden size {target.config.hidden_size}, the sidecar's d_model is "
                             f"{nla.d_model}")
        if check_model_reads_training_data(target, target_tokenizer, read_sidecar(sidecar_path)[1], nla,
                                           model_name=model, device=device_) is None:
            # stderr: `nla serve`'s first stdout line is its address, which clients read
            print(f"[explain] note: no training parquet in the sidecar's trained_on is left to check that {model} is "
                  "the LM this NLA was trained on", file=sys.stderr, flush=True)
    actor = load_av(av, dtype=dtype_, device=device_)
    injector = Injector.for_sidecar(actor, nla, injection_settings(nla, av_dir=av))
    prompt = tuple(build_prompt_ids(av_prompt_messages(nla.actor_prompt_template), nla, tokenizer))
    rollout_engine = make_engine(engine, actor, injector, tokenizer, av=av, max_batch=max_batch,
                                 vllm_gpu_mem=settings.vllm_gpu_mem, vllm_max_len=settings.vllm_max_len,
                                 vllm_quantization=settings.vllm_quantization)
    critic = ARModel.from_pretrained(ar, mse_scale=nla_core.resolve_target_scale(nla.mse_scale, nla.d_model),
                                     dtype=dtype_, device=device_).eval()
    return NLAReader(nla=nla, sidecar_path=sidecar_path, meta=read_sidecar(sidecar_path)[1], rawvar=rawvar,
                     tokenizer=tokenizer, target_tokenizer=target_tokenizer, target=target, engine=rollout_engine,
                     critic=critic, prompt=prompt, engine_name=engine, model=model)
