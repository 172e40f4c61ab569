"""vLLM rollout speed: steered vs unsteered ms per decode step, and weight-push seconds.

Random weights (vLLM's "dummy" loader), prompts of --prompt-len tokens with one marker,
--new-tokens generated per sample (EOS ignored, so every sample runs the full length),
one request per prompt with n = --group-size. Sequences S in --seqs means S / group_size
prompts. ms per decode step = (time(new_tokens) - time(1 token)) / (new_tokens - 1),
medians over --repeats, so prefill is excluded; rollout s = time(new_tokens), prefill included.

Configurations (each in its own subprocess: vLLM plugins load once per process, and
vllm-lens cannot be switched off once loaded):
  baseline   plain vLLM, CUDA graphs, unsteered: the reference point of every ratio
  nla        our plugin, CUDA graphs: steered, and the same engine unsteered (op overhead);
             also the weight sync (GPU actor, LoRA merge + push) and a CPU-bucket push
  nla_cached nla with salted prefix caching (TrainConfig.vllm_prefix_caching): the n samples of
             a prompt share its prefill; the cache is reset before every generate call, as a
             weight push resets it in training, so no call reuses an earlier one's blocks
  eager      plain vLLM, enforce_eager, unsteered (what vllm-lens forces)
  vllm_lens  the reference path: vllm-lens SteeringVectors (eager), slow at 256 sequences

Run on the H200 (one `run` of at most 10 minutes each; the 8B shape takes the most):
  source /tmp/vllm_env.sh && python bench/bench_vllm.py --shapes tiny --out bench/vllm_tiny.json
  source /tmp/vllm_env.sh && python bench/bench_vllm.py --shapes 8b --out bench/vllm_8b.json
  source /tmp/vllm_env.sh && python bench/bench_vllm.py --shapes 8b --configs vllm_lens --seqs 32 \
      --repeats 1 --out bench/vllm_8b_lens.json      # the reference path, for the record
Prints a table with ratios against the baseline measured in the same run; saves a JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": dict(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    ),
    # Qwen3-8B
    "8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    ),
}
CONFIGS = ("baseline", "nla", "nla_cached", "eager", "vllm_lens")
MARKER, LEFT, RIGHT, EOS = 7, 5, 6, 2
LAYER = 1


# --------------------------------------------------------------------------- worker side


def _model_dir(shape: str, directory: Path) -> Path:
    from transformers import Qwen3Config

    Qwen3Config(
        **SHAPES[shape],
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
        dtype="bfloat16",
    ).save_pretrained(directory)
    return directory


def _requests(n_prompts: int, prompt_len: int, d_model: int, vocab: int):
    import torch

    from nla_shell.engines.base import RolloutRequest

    generator = torch.Generator().manual_seed(0)
    requests = []
    for _ in range(n_prompts):
        ids = torch.randint(10, vocab, (prompt_len,), generator=generator)
        ids[39:42] = torch.tensor([LEFT, MARKER, RIGHT])
        requests.append(RolloutRequest(tuple(ids.tolist()), torch.randn(d_model, generator=generator)))
    return requests


class _Tokenizer:
    """Only what the engine needs from a tokenizer; the bench never reads text."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _decode_timings(run, specs_for, args) -> dict:
    """{S: {"decode_ms", "prefill_ms"}} for run(specs) over each sequence count."""
    out = {}
    for seqs in args.seqs:
        full, one = specs_for(seqs, args.new_tokens), specs_for(seqs, 1)
        run(one)
        run(full)  # warm-up: first batches of a size may still compile or allocate
        t_full = statistics.median(_timed(lambda: run(full)) for _ in range(args.repeats))
        t_one = statistics.median(_timed(lambda: run(one)) for _ in range(args.repeats))
        out[str(seqs)] = {
            "decode_ms": 1000 * (t_full - t_one) / (args.new_tokens - 1),
            "prefill_ms": 1000 * t_one,
            "rollout_s": t_full,
        }
        print(f"  [{args.worker}] {seqs} seqs: {out[str(seqs)]}", flush=True)
    return out


def _llm_info(llm) -> dict:
    config = llm.llm_engine.vllm_config
    return {
        "runner": "v2" if config.use_v2_model_runner else "v1",
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "kv_cache_tokens": (config.cache_config.num_gpu_blocks or 0) * config.cache_config.block_size,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "max_cudagraph_capture_size": config.compilation_config.max_cudagraph_capture_size,
        "enforce_eager": config.model_config.enforce_eager,
    }


def _cache_counters(llm) -> dict:
    """vLLM's prefix-cache and preemption counters over every call of the worker (warm-ups included);
    empty when this vLLM's metrics reader differs (the timings matter more than the counters)."""
    try:
        metrics = llm.get_metrics()
    except Exception as err:  # noqa: BLE001 - a reader API change must not lose the timings
        print(f"  counters unavailable: {type(err).__name__}: {err}", flush=True)
        return {}
    return {m.name: float(m.value) for m in metrics
            if isinstance(getattr(m, "value", None), (int, float)) and ("prefix_cache" in m.name or "preempt" in m.name)}


def _push_timings(engine, shape: str) -> dict:
    """Full sync from a GPU PEFT actor (our path) and a push of CPU bf16 buckets (the reference's)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import nla_core

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device("meta"):
        actor = Qwen3ForCausalLM(config).to(torch.bfloat16)  # bf16 before materialising: 16 GB at 8B, not 32
    actor = actor.to_empty(device="cuda")
    with torch.no_grad():
        for p in actor.parameters():
            p.zero_()
    actor = get_peft_model(actor, LoraConfig(r=64, lora_alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    engine.sync_weights(actor)  # warm-up
    sync_s = statistics.median(engine.sync_weights(actor) for _ in range(3))
    cpu = [
        (hf_name, torch.ones(p.shape, dtype=torch.bfloat16))
        for name, p in actor.named_parameters()
        if (hf_name := nla_core.hf_param_name(name)) is not None
    ]
    del actor
    torch.cuda.empty_cache()
    cpu_push_s = engine.push_buckets(nla_core.layer_buckets(cpu))
    return {"sync_gpu_actor_s": sync_s, "push_cpu_buckets_s": cpu_push_s}


def _prepare_env(config: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config != "vllm_lens":
        os.environ["VLLM_LENS_DISABLE"] = "1"


def worker(args) -> dict:
    _prepare_env(args.worker)
    import vllm

    from nla_shell.engines.vllm import VLLMRolloutEngine, build_request_specs, llm_kwargs_for, sampling_kwargs

    d_model, vocab = SHAPES[args.shape]["hidden_size"], SHAPES[args.shape]["vocab_size"]
    model_dir = _model_dir(args.shape, Path(tempfile.mkdtemp(prefix=f"bench_{args.shape}_")))
    common = dict(
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        tensor_parallel_size=1,
        enable_prefix_caching=False,
        load_format="dummy",
    )
    max_seqs = max(args.seqs) if args.max_num_seqs is None else args.max_num_seqs
    extra = {"max_num_seqs": max_seqs} if max_seqs else {}  # 0: vLLM's own default (1024 on an H200)
    extra["disable_log_stats"] = False  # for the prefix-cache and preemption counters (`_cache_counters`)
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype

    def specs_for(seqs: int, new_tokens: int):
        requests = _requests(seqs // args.group_size, args.prompt_len, d_model, vocab)
        return build_request_specs(
            requests, group_size=args.group_size, max_new_tokens=new_tokens, marker_id=MARKER, left_id=LEFT,
            right_id=RIGHT, d_model=d_model, injection_layer=LAYER, stop_token_ids=[EOS], ignore_eos=True,
        )

    result = {"config": args.worker, "shape": args.shape}
    if args.worker in ("baseline", "eager"):
        quantized = {"quantization": args.quantization} if args.quantization != "none" else {}
        llm = vllm.LLM(**llm_kwargs_for(model_dir, enforce_eager=args.worker == "eager", **common), **extra, **quantized)

        def run(specs):
            prompts = [vllm.TokensPrompt(prompt_token_ids=list(s.prompt_ids)) for s in specs]
            params = [vllm.SamplingParams(**sampling_kwargs(s, extra_args=None)) for s in specs]
            llm.generate(prompts, params, use_tqdm=False)

        result.update(_llm_info(llm), timings=_decode_timings(run, specs_for, args), counters=_cache_counters(llm))
        return result

    cached = args.worker == "nla_cached"
    # The engine's own max_num_seqs, so it captures decode graphs as large as it decodes (above 512).
    engine_max_seqs = extra.pop("max_num_seqs", None)
    engine = VLLMRolloutEngine(
        model_dir, _Tokenizer(), marker_id=MARKER, left_id=LEFT, right_id=RIGHT, injection_layer=LAYER,
        steering="vllm_lens" if args.worker == "vllm_lens" else "nla", enforce_eager=False, llm_kwargs=extra,
        max_num_seqs=engine_max_seqs, quantization=None if args.quantization == "none" else args.quantization,
        **{**common, "enable_prefix_caching": cached},
    )
    result.update(_llm_info(engine.llm))

    def run(specs):
        if cached and not engine.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        engine.run_specs(specs)

    result["timings"] = _decode_timings(run, specs_for, args)
    result["counters"] = _cache_counters(engine.llm)
    if args.worker == "nla":
        result["timings_unsteered"] = _decode_timings(lambda specs: engine.run_specs(specs, steered=False), specs_for, args)
        result["push"] = _push_timings(engine, args.shape)
    return result


# --------------------------------------------------------------------------- driver side


def _run_worker(config: str, shape: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result_path = handle.name
    cmd = [
        sys.executable, __file__, "--worker", config, "--shape", shape, "--result", result_path,
        "--seqs", ",".join(map(str, args.seqs)), "--group-size", str(args.group_size),
        "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
        "--repeats", str(args.repeats), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        *(["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs is not None else []),
        "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype,
    ]
    env = dict(os.environ)
    if config == "vllm_lens":
        env.pop("VLLM_LENS_DISABLE", None)
    print(f"[{shape}/{config}] starting", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"config": config, "shape": shape, "error": f"worker exited {proc.returncode}"}
    result = json.loads(Path(result_path).read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def _table(results: list[dict], args) -> str:
    lines = [f"{'shape':6} {'seqs':>5} {'config':22} {'ms/step':>9} {'x base':>7} {'prefill ms':>10} {'rollout s':>9}"
             "  runner/graphs"]
    for shape in args.shapes:
        rows = {r["config"]: r for r in results if r["shape"] == shape and "error" not in r}
        base = rows.get("baseline")
        for seqs in map(str, args.seqs):
            entries = []
            for config, row in rows.items():
                entries.append((config, row["timings"], row))
                if "timings_unsteered" in row:
                    entries.append((f"{config} (unsteered)", row["timings_unsteered"], row))
            for name, timings, row in entries:
                ms = timings[seqs]["decode_ms"]
                ratio = ms / base["timings"][seqs]["decode_ms"] if base else float("nan")
                lines.append(
                    f"{shape:6} {seqs:>5} {name:22} {ms:9.2f} {ratio:7.2f} {timings[seqs]['prefill_ms']:10.1f}"
                    f" {timings[seqs].get('rollout_s', math.nan):9.2f}"
                    f"  {row['runner']}/{row['cudagraph_mode']}{' eager' if row['enforce_eager'] else ''}"
                )
        for row in rows.values():
            if "push" in row:
                lines.append(f"{shape:6} weight sync from GPU actor (merge + push): {row['push']['sync_gpu_actor_s']:.2f} s; "
                             f"push of CPU buckets: {row['push']['push_cpu_buckets_s']:.2f} s")
    for r in results:
        if r.get("counters"):
            lines.append(f"{r['shape']}/{r['config']} (max_num_seqs {r['max_num_seqs']}, graphs up to "
                         f"{r.get('max_cudagraph_capture_size')}, KV {r['kv_cache_tokens']} tokens): "
                         + ", ".join(f"{k} {v:g}" for k, v in sorted(r["counters"].items())))
    for r in results:
        if "error" in r:
            lines.append(f"{r['shape']}/{r['config']}: {r['error']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,8b", type=lambda s: s.split(","))
    parser.add_argument("--configs", default="baseline,nla,eager", type=lambda s: s.split(","),
                        help=f"subset of {','.join(CONFIGS)} (vllm_lens is slow: opt in)")
    parser.add_argument("--seqs", default="32,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--group-size", default=8, type=int)
    parser.add_argument("--prompt-len", default=96, type=int)
    parser.add_argument("--new-tokens", default=160, type=int)
    parser.add_argument("--repeats", default=3, type=int)
    parser.add_argument("--gpu-memory-utilization", default=0.6, type=float)
    parser.add_argument("--max-num-seqs", default=None, type=int,
                        help="vLLM's max_num_seqs (default the largest --seqs; 0: vLLM's own default)")
    parser.add_argument("--quantization", default="none",
                        help="vLLM's quantization of the bf16 weights (fp8: its dynamic FP8, the trainer's vllm_quantization)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto: the model's bf16; fp8)")
    parser.add_argument("--out", default="bench/vllm_bench.json")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(s % args.group_size for s in args.seqs):
        parser.error(f"every --seqs value must be a multiple of --group-size {args.group_size}")

    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return

    import torch
    import vllm

    results = [_run_worker(config, shape, args) for shape in args.shapes for config in args.configs]
    table = _table(results, args)
    print(table)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "settings": {k: getattr(args, k) for k in ("seqs", "group_size", "prompt_len", "new_tokens", "repeats",
                                                     "gpu_memory_utilization", "max_num_seqs", "quantization",
                                                     "kv_cache_dtype")},
        "results": results,
        "table": table,
    }
    out = ROOT / args.out
    out.write_text(json.dumps(record, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
