"""Learning parity across rollout engines: short RL runs from one SFT checkpoint, then held-out FVE;
and the statistics that check an engine samples its policy at all.

Used by tests/gpu/test_learning_parity.py (the toy NLA of `nla demo`, three engines, many
seeds, on one or more GPUs) and, with tiny settings, by CPU tests of the same logic. Each leg
is `nla train` with the demo's RL settings and one engine, followed by `nla eval` of its final
adapter on the held-out rows, each in a process of its own; legs run concurrently in lanes.
Every step's record carries the engine's behaviour log-probs against the trainer's
(`logp_diff_mean`, `logp_diff_max`), kept per step. `parity_failures` is the verdict, by the rule
of nla_shell.stats (FVE_MARGIN, PairedShortfall).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from nla_shell.stats import FVE_MARGIN, MeanSE, PairedShortfall, mean_se
from nla_shell.stats import paired_shortfall as stats_paired_shortfall


@dataclass(frozen=True)
class ParityInputs:
    """One SFT starting point: AV adapter, AR, RL and held-out parquets."""

    av: Path
    ar: Path
    rl_parquet: Path
    eval_parquet: Path
    rl_rows: int


@dataclass(frozen=True)
class ParityRun:
    """One leg: `nla train` with one engine and seed, then `nla eval` of its final adapter."""

    engine: str
    seed: int
    fve: float
    """Held-out FVE (rawvar baseline) of the final adapter, scored by `nla eval`."""
    logp_diff_mean: tuple[float, ...]
    """Per RL step: mean |behaviour - trainer| log-prob over the step's generated tokens."""
    logp_diff_max: tuple[float, ...]
    """Per RL step: the largest |behaviour - trainer| log-prob of one token."""
    gpu: str | None = None
    """CUDA_VISIBLE_DEVICES of the leg's processes (None: inherited)."""
    wall_s: float = 0.0
    attempts: int = 1
    """2 when a vLLM leg was rerun after vLLM's start-up memory profiling tripped over a co-tenant."""

    @property
    def step0_logp_diff_mean(self) -> float:
        return self.logp_diff_mean[0]

    @property
    def worst_logp_diff_mean(self) -> float:
        """The largest per-step mean gap (NaN if any step's is): an engine that goes off-policy
        after some update shows here."""
        return _worst(self.logp_diff_mean)

    @property
    def worst_logp_diff_max(self) -> float:
        return _worst(self.logp_diff_max)


def _worst(values: Sequence[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def demo_inputs(run_dir: Path, *, seed: int = 0) -> ParityInputs:
    """The toy NLA's SFT checkpoints, built by `nla demo` with a one-step RL stage (its RL is not used).

    A run_dir that already holds them (a previous call's) is reused, so legs split over several
    commands start from the same checkpoints.
    """
    import pyarrow.parquet as pq

    from nla_shell.pipeline.demo import demo
    from nla_shell.pipeline.demo_config import DemoConfig

    cfg = DemoConfig(run_dir=str(run_dir), seed=seed, rl_steps=1, eval_rows=64)
    data = run_dir / "data"
    inputs = ParityInputs(av=run_dir / "av_sft" / f"step_{cfg.av_steps:06d}", ar=run_dir / "ar_sft" / f"step_{cfg.ar_steps:06d}",
                          rl_parquet=data / "rl.parquet", eval_parquet=data / "eval.parquet", rl_rows=0)
    if not (inputs.av.is_dir() and inputs.ar.is_dir() and inputs.eval_parquet.exists()):
        demo(cfg)
    return dataclasses.replace(inputs, rl_rows=pq.ParquetFile(inputs.rl_parquet).metadata.num_rows)


VLLM_PROFILING_CLASH = ("Error in memory profiling", "No available memory for the cache blocks")
"""vLLM's start-up memory profiling reads the whole GPU's free memory, so another process that
allocates or frees memory meanwhile breaks it (vllm-project/vllm#55827, #56830): such a leg is
rerun, up to VLLM_STARTUP_ATTEMPTS starts in all."""
VLLM_STARTUP_ATTEMPTS = 3
"""Starts a leg gets when vLLM's profiling clashes. One retry was not enough with six vLLM legs on
one GPU (seventh session: seed 5 clashed twice, as other legs ended during its profiling)."""
VLLM_PROFILED = ("Available KV cache memory", "[sync] initial weight push")
"""Log lines after which a vLLM leg's start-up profiling is over: vLLM's own (V1 workers log the
KV cache size it profiled) or, whatever vLLM prints, the trainer's once the engine is synced."""


def run_one(inputs: ParityInputs, out_dir: Path, *, engine: str, seed: int, steps: int, device: str, dtype: str,
            batch_prompts: int = 16, group_size: int = 8, max_new_tokens: int = 16, lr: float = 1e-3,
            eval_rows: int = 1024, gpu: str | None = None, startup_lock: threading.Lock | None = None,
            engine_settings: dict[str, object] | None = None) -> ParityRun:
    """`nla train` (the demo's RL settings, this engine and seed), then `nla eval` of the final adapter.

    Each command runs in a process of its own (an in-process vLLM engine does not hand all of its
    GPU memory back when closed), with CUDA_VISIBLE_DEVICES=gpu when given, its output in
    `<leg>/train.log` and `<leg>/eval.log`. A vLLM leg holds `startup_lock` (one per GPU) until
    its engine has started, so two vLLM start-ups never profile the same GPU at once.
    """
    run = out_dir / f"{engine}_seed{seed}"
    shutil.rmtree(run, ignore_errors=True)  # a rerun in the same NLA_PARITY_DIR starts clean
    train_rows = max(batch_prompts, int(0.8 * inputs.rl_rows))
    # Unbuffered: `_nla` watches the log for a line while the process runs.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu})}
    t0 = time.perf_counter()
    train = dict(av_ckpt=inputs.av, ar_ckpt=inputs.ar, rl_parquet=inputs.rl_parquet, num_steps=steps,
                 batch_prompts=batch_prompts, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr,
                 logp_micro_batch=256, critic_micro_batch=256, max_rows=train_rows, eval_every=0, save_every=steps,
                 logger="jsonl", seed=seed, device=device, dtype=dtype, engine=engine, **(engine_settings or {}))
    attempts = 0
    while True:
        attempts += 1
        save_dir = run / f"rl{attempts}"
        lock = startup_lock if engine == "vllm" and startup_lock is not None else contextlib.nullcontext()
        try:
            _nla("train", run / ("train.log" if attempts == 1 else f"train{attempts}.log"), env=env, hold_until=(lock, VLLM_PROFILED), save_dir=save_dir, **train)
            break
        except LegFailed as failed:
            if attempts >= VLLM_STARTUP_ATTEMPTS or not any(clash in failed.log_tail for clash in VLLM_PROFILING_CLASH):
                raise
    records = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    _nla("eval", run / "eval.log", env=env, av=save_dir / f"step_{steps:06d}" / "adapter", ar=inputs.ar,
         parquet=inputs.eval_parquet, out_dir=run / "eval", n_rows=eval_rows, max_new_tokens=max_new_tokens, seed=0,
         device=device, dtype="float32")
    summary = json.loads((run / "eval" / "eval_summary.json").read_text())
    fve = summary["av/fve"]  # null in the summary when not finite (e.g. nothing extracted)
    return ParityRun(engine=engine, seed=seed, fve=float("nan") if fve is None else float(fve),
                     logp_diff_mean=tuple(float(r["logp_diff_mean"]) for r in records),
                     logp_diff_max=tuple(float(r["logp_diff_max"]) for r in records),
                     gpu=gpu, wall_s=time.perf_counter() - t0, attempts=attempts)


class LegFailed(RuntimeError):
    def __init__(self, command: str, log: Path, tail: str) -> None:
        super().__init__(f"`nla {command}` failed; the end of {log}:\n{tail}")
        self.log_tail = tail


def _nla(command: str, log: Path, *, env: dict[str, str], hold_until: tuple | None = None,
         **settings: object) -> None:
    """One `nla` command as `key=value` overrides, in a fresh Python process, its output in `log`.

    hold_until = (lock, lines): the lock is held from before the start until one of `lines`
    appears in the log (or the process ends).
    """
    argv = [sys.executable, "-m", "nla_shell.cli", command, *(f"{k}={v}" for k, v in settings.items())]
    log.parent.mkdir(parents=True, exist_ok=True)
    lock, lines = hold_until or (contextlib.nullcontext(), ())
    with open(log, "w") as out:
        with lock:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            while lines and process.poll() is None and not any(line in log.read_text(errors="replace") for line in lines):
                time.sleep(0.5)
        process.wait()
    if process.returncode != 0:
        raise LegFailed(command, log, "\n".join(log.read_text(errors="replace").splitlines()[-40:]))


def run_legs(inputs: ParityInputs, out_dir: Path, legs: Sequence[tuple[str, int]], *, lanes: Sequence[str | None],
             vllm_lanes: Sequence[str | None] | None = None, dtypes: dict[str, str],
             engine_settings: dict[str, dict[str, object]] | None = None,
             progress: Callable[[list[ParityRun]], None] | None = None, **settings: object) -> list[ParityRun]:
    """Every (engine, seed) leg, concurrently: one worker per lane entry, each running legs one
    after another on that GPU (lanes ["0", "0", "1"]: two concurrent legs on GPU 0, one on GPU 1;
    [None]: one leg at a time on the inherited devices). With vllm_lanes, vLLM legs run only in
    those lanes and the others only in `lanes` (vLLM's start-up profiling dislikes co-tenants
    that come and go); vLLM legs on one GPU start one after the other (see `run_one`). Each
    engine trains in dtypes[engine], with engine_settings[engine] as extra `nla train`
    overrides; `settings` go to every leg. `progress` gets the legs finished so far after each
    one (so a run cut short still leaves its record). Returns the runs in leg order.
    """
    indexed = list(enumerate(legs))
    queues = ([([leg for leg in indexed if leg[1][0] != "vllm"], lanes), ([leg for leg in indexed if leg[1][0] == "vllm"], vllm_lanes)]
              if vllm_lanes is not None else [(indexed, lanes)])
    results: dict[int, ParityRun] = {}
    guard = threading.Lock()
    startup_locks = {gpu: threading.Lock() for _, group_lanes in queues for gpu in group_lanes}

    def worker(pending: list[tuple[int, tuple[str, int]]], gpu: str | None) -> None:
        while True:
            with guard:
                if not pending:
                    return
                index, (engine, seed) = pending.pop(0)
            try:
                run = run_one(inputs, out_dir, engine=engine, seed=seed, gpu=gpu, startup_lock=startup_locks[gpu],
                              dtype=dtypes[engine], engine_settings=(engine_settings or {}).get(engine), **settings)
            except BaseException:
                with guard:  # no lane starts another leg: the run has failed
                    for queue, _ in queues:
                        queue.clear()
                raise
            print(f"[parity] {engine} seed {seed} (gpu {gpu}): FVE {run.fve:.4f}, worst per-step logp diff mean "
                  f"{run.worst_logp_diff_mean:.2g}, {run.wall_s:.0f}s", flush=True)
            with guard:
                results[index] = run
                if progress is not None:
                    progress([results[i] for i in sorted(results)])

    workers = [(pending, gpu) for pending, group_lanes in queues if pending for gpu in group_lanes]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
        for future in [pool.submit(worker, pending, gpu) for pending, gpu in workers]:
            future.result()  # a failed leg raises here (the other lanes finish their current leg)
    return [results[i] for i in range(len(legs))]


def format_table(runs: Sequence[ParityRun]) -> str:
    """Markdown: held-out FVE per engine and seed, mean ± standard error, and the log-prob gaps."""
    seeds = sorted({r.seed for r in runs})
    lines = ["| engine | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± se | step-0 / worst-step mean "
             "\\|behaviour − trainer\\| logp | worst token |", "|---" * (len(seeds) + 4) + "|"]
    for engine in dict.fromkeys(r.engine for r in runs):
        mine = {r.seed: r for r in runs if r.engine == engine}
        cells = [f"{mine[s].fve:.3f}" if s in mine else "—" for s in seeds]
        stats = engine_stats(runs, engine)
        step0 = max(r.step0_logp_diff_mean for r in mine.values())
        worst = max(r.worst_logp_diff_mean for r in mine.values())
        worst_token = max(r.worst_logp_diff_max for r in mine.values())
        lines.append(f"| {engine} | " + " | ".join(cells) + f" | {stats.mean:.3f} ± {stats.se:.3f} | "
                     f"{step0:.2g} / {worst:.2g} | {worst_token:.2g} |")
    return "\n".join(lines)


def engine_stats(runs: Sequence[ParityRun], engine: str) -> MeanSE:
    return mean_se([r.fve for r in runs if r.engine == engine])


def paired_shortfall(runs: Sequence[ParityRun], engine: str, baseline: str) -> PairedShortfall:
    """The paired differences over the seeds that both `engine` and `baseline` ran (nla_shell.stats' rule)."""
    return stats_paired_shortfall({r.seed: r.fve for r in runs if r.engine == engine},
                                  {r.seed: r.fve for r in runs if r.engine == baseline})


def parity_failures(runs: Sequence[ParityRun], *, baseline: str | None = "hf", logp_tolerance: dict[str, float],
                    margin: float = FVE_MARGIN) -> list[str]:
    """What breaks parity, one line each:
    - an engine with fewer than 2 seeds shared with the baseline, or a non-finite FVE;
    - an engine that is not shown to learn within `margin` of the baseline: the one-sided 95 % lower
      bound of its mean paired difference (`PairedShortfall`) is below -margin. A true loss of
      margin fails 19 times in 20 whatever the seed count; equal engines pass once the seeds are as
      many as `seeds_needed` says, which the line names (not judged with baseline None: legs run
      apart from the baseline's, to be judged with them later);
    - a run whose mean |behaviour - trainer| log-prob exceeds its engine's tolerance at ANY step
      (an engine that samples a stale policy after some update shows there, not at step 0).
    """
    failures = []
    engines = list(dict.fromkeys(r.engine for r in runs))
    for engine in engines:
        fves = [r.fve for r in runs if r.engine == engine]
        if not all(math.isfinite(f) for f in fves):
            failures.append(f"{engine}: a non-finite held-out FVE among its {len(fves)} seed(s)")
    if baseline is not None:
        for engine in sorted(set(engines) - {baseline}):
            paired = paired_shortfall(runs, engine, baseline)
            if paired.n < 2 or not math.isfinite(paired.sd):
                failures.append(f"{engine}: {paired.n} seed(s) shared with {baseline}: need >= 2 paired seeds with a "
                                "finite FVE")
            elif paired.lower_bound < -margin:
                failures.append(
                    f"{engine}: paired by seed, mean held-out FVE {paired.mean:+.4f} against {baseline} (sd {paired.sd:.4f}, "
                    f"{paired.n} seeds); its 95 % lower bound {paired.lower_bound:+.4f} is below -{margin:g}; at this "
                    f"spread {paired.seeds_needed(margin)} seeds would resolve a difference of 0 from a {margin:g} loss"
                )
    for r in runs:
        if not r.worst_logp_diff_mean <= logp_tolerance[r.engine]:
            step = next(i for i, v in enumerate(r.logp_diff_mean) if not v <= logp_tolerance[r.engine])
            failures.append(f"{r.engine} seed {r.seed}: mean |behaviour - trainer| log-prob over "
                            f"{logp_tolerance[r.engine]:g} first at step {step} (worst {r.worst_logp_diff_mean:.3g})")
    return failures


def write_json(path: Path, runs: Sequence[ParityRun], *, settings: dict[str, object],
               failures: Sequence[str] | None) -> None:
    """Every leg (per-step log-prob gaps included), each engine's mean/sd/se and the verdict
    (failures None: the legs are not all done yet), as JSON."""
    engines = dict.fromkeys(r.engine for r in runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "settings": settings,
        "legs": [{**dataclasses.asdict(r), "worst_logp_diff_mean": r.worst_logp_diff_mean,
                  "worst_logp_diff_max": r.worst_logp_diff_max} for r in runs],
        "engines": {e: {**engine_stats(runs, e)._asdict(), "se": engine_stats(runs, e).se}
                    for e in engines},
        "complete": failures is not None,
        "failures": None if failures is None else list(failures),
    }, indent=1, default=str, allow_nan=True))


def read_json(path: Path) -> list[ParityRun]:
    """The legs a `write_json` file holds: legs run by several commands can be judged together."""
    fields = {f.name for f in dataclasses.fields(ParityRun)}
    return [ParityRun(**{k: tuple(v) if isinstance(v, list) else v for k, v in leg.items() if k in fields})
            for leg in json.loads(Path(path).read_text())["legs"]]


# --------------------------------------------------------------------------- does an engine sample its policy?


def randomized_pit(logits: torch.Tensor, tokens: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    """Randomised probability integral transform of sampled tokens under the policy's softmax.

    With the vocabulary ordered by descending probability p_(1) >= p_(2) >= ..., a token t of
    rank r gets u = sum_{j<r} p_(j) + V * p_t, V ~ U(0, 1). If t ~ softmax(logits), u ~ U(0, 1)
    exactly, whatever the distribution; and the u of successive tokens of one sequence, each
    taken under its own prefix's conditional, are independent uniforms (chain rule). A sampler
    that favours likely tokens (temperature < 1, top-k, top-p) puts too many u near 0, one
    that flattens puts too many near 1. Computed in float64.

    Args: logits: [N, V]; tokens: [N] int64.
    Returns: [N] float64 in [0, 1].
    """
    probs = torch.softmax(logits.double(), dim=-1)
    order = probs.argsort(dim=-1, descending=True, stable=True)
    sorted_probs = probs.gather(-1, order)
    rank = order.argsort(dim=-1).gather(-1, tokens[:, None])  # [N, 1] position of t in the order
    mass_before = (sorted_probs.cumsum(-1) - sorted_probs).gather(-1, rank).squeeze(-1)
    jitter = torch.rand(tokens.shape, generator=generator, dtype=torch.float64, device=tokens.device)
    return mass_before + jitter * probs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass(frozen=True)
class UniformityTest:
    statistic: float
    """Pearson's chi-square of the values' histogram over `bins` equal bins of [0, 1]."""
    critical: float
    """The chi-square(bins - 1) quantile at 1 - alpha (Wilson-Hilferty approximation)."""
    n: int

    @property
    def passed(self) -> bool:
        return self.statistic <= self.critical


def uniformity_chi_square(values: torch.Tensor, *, bins: int = 20, alpha: float = 1e-3) -> UniformityTest:
    """Chi-square test of values [N] in [0, 1] against U(0, 1): X = sum_k (O_k - N/K)^2 / (N/K).

    Under U(0, 1), X ~ chi-square(K - 1); the critical value is its 1 - alpha quantile by
    Wilson-Hilferty, k (1 - 2/(9k) + z sqrt(2/(9k)))^3 with k = K - 1 and z the normal
    1 - alpha quantile (within 1 % of the exact quantile for k >= 10). Tests run it at fixed
    seeds, so a pass or a fail is reproducible; alpha bounds how often a fresh seed would fail
    an exact sampler.
    """
    n = values.numel()
    counts = torch.histc(values.detach().double().cpu().clamp(0, 1), bins=bins, min=0.0, max=1.0)
    expected = n / bins
    k = bins - 1
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    critical = k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3
    return UniformityTest(statistic=float(((counts - expected) ** 2).sum() / expected), critical=critical, n=n)


def policy_and_requests(av: Path, parquet: Path, *, device: torch.device, n_requests: int = 3):
    """(actor, injector, tokenizer, requests) as `nla train` builds them from an AV checkpoint:
    an SFT adapter dir is continued (with its frozen "reference" copy), a full model gets a fresh
    LoRA; the requests are the parquet's first n_requests rows, the second made longer so that
    prompts of two lengths share a batch."""
    from nla_shell import families
    from nla_shell.engines.base import RolloutRequest
    from nla_shell.io.data import build_prompt_ids, load_rows
    from nla_shell.io.sidecars import load_sidecar
    from nla_shell.models import Injector, load_actor

    tokenizer = families.load_tokenizer(av)
    cfg = load_sidecar(parquet)
    actor = load_actor(av, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None, dtype=torch.float32,
                       device=device)
    injector = Injector(actor, marker_id=cfg.injection_token_id, left_id=cfg.injection_left_neighbor_id,
                        right_id=cfg.injection_right_neighbor_id)
    rows = load_rows(parquet, cfg, max_rows=n_requests)
    prompts = [build_prompt_ids(r.prompt, cfg, tokenizer) for r in rows]
    prompts[1] = tokenizer.encode("The cat sat on the mat. ", add_special_tokens=False) + prompts[1]
    return actor, injector, tokenizer, [RolloutRequest(tuple(p), r.activation) for p, r in zip(prompts, rows)]


def conditional_logits(actor, injector, rollouts, requests, *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's full next-token logits at every generated position, with the injection.

    Returns: (logits [N_tokens, V] float32, tokens [N_tokens]): each generated token of every
    rollout (row-major) and the logits of the conditional it was drawn from.
    """
    from nla_shell.models import inner_lm
    from nla_shell.training.update import response_batch

    device = next(actor.parameters()).device
    batch = response_batch(rollouts, pad_id=pad_id, device=device)
    vectors = torch.stack([requests[r.prompt_index].activation for r in rollouts]).to(device)
    with torch.no_grad(), injector.inject(batch.input_ids, vectors):
        logits = inner_lm(actor)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    at_positions = logits.gather(1, batch.positions[..., None].expand(-1, -1, logits.shape[-1]))
    return at_positions[batch.mask], batch.targets[batch.mask]
