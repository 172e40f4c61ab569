"""quant=4bit / 8bit against bf16: memory, actor step time, and log-prob agreement.

A random Qwen3 at the 8B geometry (or --layers fewer blocks) is saved once to --work, then
loaded the way the trainer loads it (`models.load_actor` with quant=none | 8bit | 4bit; a
LoRA r128 with a non-zero B on top). Per mode, on the same synthetic batch (B sequences of
T tokens with one injection marker each, the last R tokens the "response"):

  load_gib      GPU memory allocated after loading the actor
  step_s        median seconds of one forward + backward of `models.response_logprobs`
                (the trainer's fused log-prob path, injection on) over the batch
  peak_gib      peak GPU memory of those steps
  logp_max_abs / logp_mean_abs   |logp(mode) - logp(bf16)| over the response tokens

Each mode reports ratios to bf16 from the same run. Needs CUDA and bitsandbytes for the
quantised modes (pip install 'nla[bnb]'); on CPU, `--modes none --tiny` is a smoke run.

`--role ar` measures the AR instead, loaded as `nla sft --mode ar` and the co-trained critic
load it (`ARModel.from_pretrained`, truncated after block --extraction-layer, value head):
mode `full` trains the whole bf16 backbone (the default critic), `none` / `8bit` / `4bit` a
LoRA r128 on a bf16 / 8-bit / 4-bit frozen backbone (EasyNLA's `--use-lora` AR, which
`ar_lora=true` builds). A step is the AR's forward over the batch, the critic's MSE to random
targets, backward and the optimizer step (`runtime.make_optimizer`: AdamW8bit when bitsandbytes
is installed); `pred_*` compare each mode's predictions before training with `none`'s,
relative to their norm (`full` carries no LoRA, so it differs by the LoRA's small B too).

    python bench/bench_quant.py --out bench/quant_h200.json              # H200, 8B geometry
    python bench/bench_quant.py --layers 8 --out /tmp/quant.json         # quicker, 8 blocks
    python bench/bench_quant.py --role ar --modes none,full,8bit,4bit --out /tmp/quant_ar.json
    .venv/bin/python bench/bench_quant.py --tiny --modes none            # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="none,8bit,4bit", help="comma-separated quant modes; none (bf16) first "
                   "(--role ar: also full, the whole bf16 backbone trained)")
    p.add_argument("--role", default="av", choices=["av", "ar"], help="the actor's frozen base, or the AR")
    p.add_argument("--extraction-layer", type=int, default=24, help="--role ar: the AR keeps blocks 0..this")
    p.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the 8B model's 36)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--response-len", type=int, default=128, help="scored tokens at the end of each sequence")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one warm-up)")
    p.add_argument("--tiny", action="store_true", help="the CPU smoke geometry")
    p.add_argument("--work", default=None, help="dir for the saved random model (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    return p.parse_args()


def save_random_model(directory: Path, args, device: torch.device) -> tuple[Path, dict]:
    tokenizer, tokens = synthetic.toy_tokenizer()
    shape = synthetic.TINY if args.tiny else synthetic.QWEN3_8B
    config = synthetic.qwen3_config(shape, vocab_size=len(tokenizer), num_layers=args.layers)
    if not (directory / "config.json").exists():
        model = synthetic.random_qwen3(config, device=device, dtype=torch.bfloat16)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        del model
    return directory, tokens


def batch(args, tokens: dict, *, vocab: int, d_model: int, device: torch.device):
    """(input_ids [B, T], attention_mask, positions [B, R], targets [B, R], vectors [B, D])."""
    requests = synthetic.make_requests(args.batch, args.seq_len, d_model, tokens, vocab=vocab)
    ids = torch.tensor([r.prompt_ids for r in requests], device=device)
    mask = torch.ones_like(ids)
    positions = torch.arange(args.seq_len - args.response_len - 1, args.seq_len - 1, device=device).expand(args.batch, -1)
    targets = ids.gather(1, positions + 1)
    vectors = torch.stack([r.activation for r in requests]).to(device)
    return ids, mask, positions, targets, vectors


def run_mode(mode: str, model_dir: Path, tokens: dict, args, device: torch.device) -> dict:
    from nla_shell.models import load_actor, response_logprobs

    torch.manual_seed(0)
    synthetic.free_memory(device)
    synthetic.reset_peak(device)
    actor = load_actor(model_dir, lora_r=128, lora_alpha=16, use_rslora=True, resume_adapter=None,
                       dtype=torch.bfloat16, device=device, quant=mode)
    with torch.no_grad():
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 1e-3, generator=torch.Generator(param.device).manual_seed(0))
    load_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    injector = synthetic.make_injector(actor, tokens)
    config = actor.get_base_model().config
    ids, mask, positions, targets, vectors = batch(args, tokens, vocab=config.vocab_size, d_model=config.hidden_size,
                                                   device=device)

    def step() -> torch.Tensor:
        with injector.inject(ids, vectors):
            out = response_logprobs(actor, ids, mask, positions, targets)
        out.mean().backward()
        actor.zero_grad(set_to_none=True)
        return out.detach().float().cpu()

    step_s, logp = median_step(step, args.steps, device)
    peak = synthetic.peak_gib(device)
    injector.remove()
    actor = injector = step = None  # the next mode's load needs this one's memory back
    return {"mode": mode, "load_gib": load_gib, "peak_gib": peak, "step_s": step_s, "logp": logp}


def median_step(step, steps: int, device: torch.device):
    """(median seconds of `steps` timed calls of step() after one warm-up call, the last call's result)."""
    times, result = [], None
    for i in range(steps + 1):
        seconds, result = synthetic.timed(step, device)
        if i:
            times.append(seconds)
    return statistics.median(times), result


def run_ar_mode(mode: str, model_dir: Path, tokens: dict, args, device: torch.device) -> dict:
    """One AR mode: loaded as the trainer loads it, then timed optimizer steps of the critic's MSE."""
    from transformers import AutoConfig

    from nla_core import resolve_target_scale
    from nla_shell.models import ARModel, trainable_parameters
    from nla_shell.training.runtime import make_optimizer

    torch.manual_seed(0)
    synthetic.free_memory(device)
    synthetic.reset_peak(device)
    quant = "none" if mode == "full" else mode
    config = AutoConfig.from_pretrained(model_dir)
    layer = min(args.extraction_layer, config.num_hidden_layers - 1)
    ar = ARModel.from_pretrained(model_dir, mse_scale=resolve_target_scale("sqrt_d_model", config.hidden_size),
                                 extraction_layer_index=layer, create_head=True, dtype=torch.bfloat16, device=device,
                                 quant=quant)
    if mode != "full":
        ar.add_lora(r=128, alpha=16, use_rslora=True, base_model=model_dir, quant=quant)
        with torch.no_grad():  # the same non-zero LoRA in every mode, so predictions depend on it
            for name, param in ar.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 1e-3, generator=torch.Generator(param.device).manual_seed(0))
    ar.train()
    load_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    optimizer = make_optimizer(trainable_parameters(ar), 1e-5, device=device, label=f"ar {mode}")
    ids, mask, _, _, _ = batch(args, tokens, vocab=config.vocab_size, d_model=config.hidden_size, device=device)
    targets = torch.randn(ids.shape[0], config.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        predictions = ar(ids, mask).float().cpu()

    def step() -> None:
        (ar(ids, mask) - targets).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_s, _ = median_step(step, args.steps, device)
    peak = synthetic.peak_gib(device)
    trainable = sum(p.numel() for p in trainable_parameters(ar))
    ar = optimizer = step = None  # the next mode's load needs this one's memory back
    return {"mode": mode, "load_gib": load_gib, "peak_gib": peak, "step_s": step_s,
            "predictions": predictions, "trainable": trainable}


def ar_rows(results: list[dict]) -> list[dict]:
    """Each AR mode against bf16 LoRA (`none`): memory, time, predictions."""
    base = next(r for r in results if r["mode"] == "none")
    rows = []
    for r in results:
        gap = (r["predictions"] - base["predictions"]).norm(dim=-1) / base["predictions"].norm(dim=-1)
        rows.append({"mode": r["mode"], "trainable": r["trainable"], "load_gib": r["load_gib"], "peak_gib": r["peak_gib"],
                     "step_s": r["step_s"], "load_vs_bf16_lora": r["load_gib"] / base["load_gib"],
                     "step_vs_bf16_lora": r["step_s"] / base["step_s"],
                     "pred_rel_max": float(gap.max()), "pred_rel_mean": float(gap.mean())})
    return rows


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modes = args.modes.split(",")
    if modes[0] != "none":
        sys.exit("--modes must start with none: the other modes are compared with bf16")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_quant_"))
    model_dir, tokens = save_random_model(work / "model", args, device)
    if args.role == "ar":
        rows = ar_rows([run_ar_mode(mode, model_dir, tokens, args, device) for mode in modes])
        for row in rows:
            print(json.dumps(row), flush=True)
        write_record(args, device, rows)
        return
    results = [run_mode(mode, model_dir, tokens, args, device) for mode in modes]
    base = results[0]
    rows = []
    for r in results:
        diff = (r["logp"] - base["logp"]).abs()
        rows.append({
            "mode": r["mode"], "load_gib": r["load_gib"], "peak_gib": r["peak_gib"], "step_s": r["step_s"],
            "load_vs_bf16": r["load_gib"] / base["load_gib"], "step_vs_bf16": r["step_s"] / base["step_s"],
            "logp_max_abs": float(diff.max()), "logp_mean_abs": float(diff.mean()),
        })
        print(json.dumps(rows[-1]), flush=True)
    write_record(args, device, rows)


def write_record(args, device: torch.device, rows: list[dict]) -> None:
    record = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(args),
              "date": time.strftime("%Y-%m-%d"), "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
