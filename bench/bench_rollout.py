"""Rollout speed at the Qwen3-8B shape: HF `generate`, the native engine and vLLM, beside the HBM floor.

Random bf16 weights, built on the GPU directly; the trainer's actor (PEFT LoRA r128 on
q, k, v, o, non-zero) with the injection hook; prompts of --prompt-len random tokens with one
marker, each with a random activation; --new-tokens per sample. Sequence counts S in --seqs
run as S / G prompts x G samples (G from --groups: the NLA default 8 x 4, and 32 x 8).

For every engine, ms per decode step = (t(new_tokens) - t(1)) / (new_tokens - 1), so
prefill is excluded (the same definition as bench/bench_vllm.py); tokens/s counts the whole
call. The HBM floor of a step is (weights read + average KV read) / the device-to-device
copy bandwidth measured in the same run. Fidelity: mean and max |behaviour - trainer|
log-prob over the rollouts (trainer = `models.response_logprobs` with the injection).

Cases (each failure is reported and skipped; the JSON is rewritten after every case):
  hf                 HFRolloutEngine (HF generate, dynamic cache), steered, LoRA unmerged
  native             NativeRolloutEngine, steered, LoRA unmerged, CUDA graphs
  native_merged      the same with the LoRA merged for the rollout
  native_compiled    torch.compile'd step in the graph (--native-compile; compiles per shape)
  vllm/<config>      bench/bench_vllm.py's configs in a subprocess, when vllm imports
(`hf_static`, HF generate with transformers' static cache, no engine option and no recorded numbers, is
retired; last at e649374.)

    python bench/bench_rollout.py --out bench/rollout_h200.json          # H200, ~5 min
    .venv/bin/python bench/bench_rollout.py --tiny --out /tmp/rollout.json  # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic as syn  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/rollout.json", help="JSON written after every case")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, float32, short rollouts")
    parser.add_argument("--seqs", default=None, help="sequence counts (default 32,256; tiny 4,8)")
    parser.add_argument("--groups", default=None, help="G per sequence count (default 4,8; tiny 2,4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 96 (tiny 24)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 160 (tiny 8)")
    parser.add_argument("--lora-r", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats of each native call (median)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--native-compile", action="store_true", help="also the torch.compile'd native step")
    parser.add_argument("--vllm-configs", default="baseline",
                        help="bench_vllm.py configs to run ('' skips vLLM): baseline,nla,eager")
    parser.add_argument("--vllm-timeout", type=int, default=300, help="seconds allowed for the vLLM subprocess")
    args = parser.parse_args()
    tiny = args.tiny
    args.seqs = [int(s) for s in (args.seqs or ("4,8" if tiny else "32,256")).split(",")]
    args.groups = [int(g) for g in (args.groups or ("2,4" if tiny else "4,8")).split(",")]
    args.prompt_len = args.prompt_len or (24 if tiny else 96)
    args.new_tokens = args.new_tokens or (8 if tiny else 160)
    if len(args.groups) != len(args.seqs) or any(s % g for s, g in zip(args.seqs, args.groups)):
        parser.error("--groups needs one G per --seqs value, each dividing it")
    return args


# --------------------------------------------------------------------------- vLLM (subprocess)


def run_vllm(args, record: syn.Record) -> None:
    """bench_vllm.py's configs at the 8B shape, G = 8, in its own subprocesses (before our model exists)."""
    configs = [c for c in args.vllm_configs.split(",") if c]
    script = ROOT / "bench" / "bench_vllm.py"
    if args.tiny or not configs:
        return
    if importlib.util.find_spec("vllm") is None or not script.exists():
        record.data["vllm_skipped"] = "vllm does not import here" if script.exists() else "no bench/bench_vllm.py"
        print(f"[vllm] skipped: {record.data['vllm_skipped']}", flush=True)
        return
    out = Path(tempfile.mkdtemp(prefix="bench_rollout_vllm_")) / "vllm.json"
    cmd = [sys.executable, str(script), "--shapes", "8b", "--configs", ",".join(configs),
           "--seqs", ",".join(map(str, args.seqs)), "--group-size", "8", "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--repeats", "1", "--out", str(out)]
    print(f"[vllm] {' '.join(cmd)}", flush=True)
    try:
        subprocess.run(cmd, cwd=ROOT, timeout=args.vllm_timeout, check=True)
        results = json.loads(out.read_text())["results"]
    except Exception as err:  # noqa: BLE001 - report and go on with our own cases
        record.error("vllm", err)
        return
    for result in results:
        if "error" in result:
            record.error(f"vllm/{result['config']}", RuntimeError(result["error"]))
            continue
        variants = [("", result["timings"])]
        if "timings_unsteered" in result:
            variants.append((" unsteered", result["timings_unsteered"]))
        for suffix, timings in variants:
            for seqs, timing in timings.items():
                record.add({
                    "engine": f"vllm/{result['config']}{suffix}", "seqs": int(seqs), "group": 8,
                    "decode_ms": timing["decode_ms"], "prefill_ms": timing["prefill_ms"],
                    "tokens_per_s": int(seqs) * args.new_tokens / ((timing["prefill_ms"] + timing["decode_ms"]
                                                                    * (args.new_tokens - 1)) / 1000),
                    "lora": False, "detail": {k: result.get(k) for k in ("runner", "cudagraph_mode", "enforce_eager")},
                })


# --------------------------------------------------------------------------- our engines


def weight_bytes(model: torch.nn.Module, *, with_lora: bool) -> int:
    """Bytes of the parameters a decode step reads (the embedding table is only gathered)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if "embed_tokens" not in name and (with_lora or "lora_" not in name))


def fidelity(actor, injector, requests, rollouts, *, pad_id: int, device: torch.device, micro: int = 16) -> dict:
    """|behaviour - trainer| log-prob over generated tokens; trainer = the update's forward."""
    from nla_shell.models import response_logprobs
    from nla_shell.training.update import response_batch

    diffs = []
    for start in range(0, len(rollouts), micro):
        chunk = rollouts[start : start + micro]
        batch = response_batch(chunk, pad_id=pad_id, device=device)
        vectors = torch.stack([requests[r.prompt_index].activation for r in chunk]).to(device)
        with torch.no_grad(), injector.inject(batch.input_ids, vectors):
            logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
        diffs.append((logp - batch.behavior_logp)[batch.mask].abs().cpu())
    diff = torch.cat(diffs)
    return {"mean_abs": float(diff.mean()), "max_abs": float(diff.max())}


def time_engine(engine, requests, group: int, args, device: torch.device, *, repeats: int, warm_tokens: int):
    """(decode_ms, prefill_s, full_s, rollouts of the last full call)."""
    def call(tokens: int):
        return engine.generate(requests, group_size=group, max_new_tokens=tokens,
                               generator=torch.Generator(device).manual_seed(0))

    call(warm_tokens)  # graph capture / compile / allocator warm-up
    one = statistics.median(syn.timed(lambda: call(1), device)[0] for _ in range(repeats))
    fulls = [syn.timed(lambda: call(args.new_tokens), device) for _ in range(repeats)]
    full = statistics.median(t for t, _ in fulls)
    return 1000 * (full - one) / max(args.new_tokens - 1, 1), one, full, fulls[-1][1]


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    header = {**syn.environment(device), "settings": {k: v for k, v in vars(args).items()}}
    record = syn.Record(args.out, header)
    run_vllm(args, record)

    from nla_shell.engines.hf import HFRolloutEngine
    from nla_shell.engines.native import NativeRolloutEngine

    tokenizer, tokens = syn.toy_tokenizer()
    shape = syn.TINY if args.tiny else syn.QWEN3_8B
    config = syn.qwen3_config(shape, vocab_size=len(tokenizer))
    t0 = time.perf_counter()
    actor = syn.attach_lora(syn.random_qwen3(config, device=device, dtype=dtype), r=args.lora_r, alpha=16)
    injector = syn.make_injector(actor, tokens)
    print(f"[setup] model + LoRA on {device} in {time.perf_counter() - t0:.1f}s", flush=True)
    bandwidth = syn.copy_bandwidth(device, gib=0.25 if args.tiny else 1.0)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
    record.data.update(copy_bandwidth_gbs=bandwidth / 1e9, kv_bytes_per_token=kv_per_token,
                       weight_bytes=weight_bytes(actor, with_lora=False),
                       lora_bytes=weight_bytes(actor, with_lora=True) - weight_bytes(actor, with_lora=False))
    record.save()
    print(f"[setup] copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)

    cases = []
    if not args.skip_hf:
        cases.append(("hf", lambda: HFRolloutEngine(actor, injector, tokenizer), True))
    cases.append(("native", lambda: NativeRolloutEngine(actor, injector, tokenizer), True))
    cases.append(("native_merged", lambda: NativeRolloutEngine(actor, injector, tokenizer, merge_lora=True), False))
    if args.native_compile:
        cases.append(("native_compiled", lambda: NativeRolloutEngine(actor, injector, tokenizer, merge_lora=True,
                                                                     compile=True), False))

    for seqs, group in zip(args.seqs, args.groups):
        requests = syn.make_requests(seqs // group, args.prompt_len, config.hidden_size, tokens,
                                     vocab=min(config.vocab_size, len(tokenizer)), seed=seqs)
        kv_avg = seqs * (args.prompt_len + args.new_tokens / 2) * kv_per_token
        for name, make, unmerged in cases:
            label = f"{name} {seqs} seqs ({seqs // group} x {group})"
            print(f"[case] {label}", flush=True)
            syn.free_memory(device)
            syn.reset_peak(device)
            try:
                engine = make()
                hf = name.startswith("hf")
                decode_ms, one_s, full_s, rollouts = time_engine(
                    engine, requests, group, args, device, repeats=1 if hf else args.repeats,
                    warm_tokens=min(args.new_tokens, 4) if name == "hf" else args.new_tokens,
                )
                floor_ms = 1000 * (weight_bytes(actor, with_lora=unmerged) + kv_avg) / bandwidth
                case = {
                    "engine": name, "seqs": seqs, "group": group, "decode_ms": decode_ms, "prefill_ms": 1000 * one_s,
                    "tokens_per_s": seqs * args.new_tokens / full_s, "floor_ms": floor_ms,
                    "x_floor": decode_ms / floor_ms, "lora": True, "peak_gib": syn.peak_gib(device),
                    "mean_new_tokens": sum(r.response_len for r in rollouts) / len(rollouts),
                    "fidelity": fidelity(actor, injector, requests, rollouts, pad_id=tokenizer.pad_token_id,
                                         device=device),
                }
                if not hf:
                    case.update(stats=engine.last_stats, cuda_graphs=engine.cuda_graphs, graph_error=engine.graph_error)
                engine.close()
                del engine, rollouts
                record.add(case)
                print(f"  decode {decode_ms:.2f} ms/step (floor {floor_ms:.2f}), {case['tokens_per_s']:.0f} tok/s, "
                      f"fidelity {case['fidelity']}", flush=True)
            except Exception as err:  # noqa: BLE001 - report, free, go on
                record.error(label, err)
                syn.free_memory(device)
    table = summary(record.data["cases"])
    record.data["table"] = table
    record.save()
    print(table)
    print(f"saved {args.out}")


def summary(cases: list[dict]) -> str:
    hf = {c["seqs"]: c["decode_ms"] for c in cases if c["engine"] == "hf"}
    lines = [f"{'engine':26} {'seqs':>5} {'ms/step':>8} {'floor':>6} {'x floor':>7} {'HF/this':>8} {'tok/s':>8} "
             f"{'|dlogp| mean':>12} {'peak GiB':>8}"]
    for c in cases:
        fid = c.get("fidelity", {}).get("mean_abs", float("nan"))
        speedup = hf[c["seqs"]] / c["decode_ms"] if c["seqs"] in hf else float("nan")
        lines.append(f"{c['engine']:26} {c['seqs']:>5} {c['decode_ms']:8.2f} {c.get('floor_ms', float('nan')):6.2f} "
                     f"{c.get('x_floor', float('nan')):7.2f} {speedup:8.1f} {c['tokens_per_s']:8.0f} {fid:12.4f} "
                     f"{c.get('peak_gib', float('nan')):8.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
