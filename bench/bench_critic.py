"""The AR's score + critic step alone at the Qwen3-8B shape: its micro-batch and where its time goes (issue 12).

`bench_step.py` times whole steps; this times only `training.scoring.score_and_train_critic`
(one AR forward per explanation serving the reward and the critic loss, the backward, the
optimizer step) on synthetic explanations of a fixed length, so one variant costs seconds.
The AR is the step benchmark's: 25 random blocks of the 8B shape and an identity value head,
trained in full with the trainer's optimizer (bitsandbytes AdamW8bit when installed). Per variant:

  seconds      wall time of one call over all explanations, after a warm-up call
  TF/s, % pk   the AR's forward + backward FLOPs (3 x forward, `bench_step.path_flops`) over that time
  idle         kernels and idle seconds in a profiled call over a few micro-batches, and the
               host ops the GPU waited on (`timeline.idle_gaps`)
  peak GiB     torch.cuda.max_memory_allocated during the timed call

A variant is MICRO_BATCH[:compile] (compile_blocks on the AR's blocks, as `nla train` installs it), e.g.
`24:compile,48:compile`. (The `masked` replay of the AR's padding mask before 2026-12-03 is retired; run AI's
numbers are in bench/RESULTS.md.)

    python bench/bench_critic.py --inputs 512 --variants 24:compile,48:compile --out $OUT/critic.json   # H200
    .venv/bin/python bench/bench_critic.py --tiny --variants 2,4:compile --out /tmp/critic.json        # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic as syn  # noqa: E402
from bench_step import PEAK_TFLOPS, forward_flops, word_text  # noqa: E402
from bench_update import print_gaps, profiled_call  # noqa: E402

TEMPLATE = "Text: {explanation}"
"""The step benchmark's AR template (its 5 tokens are added to each explanation's)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    micro_batch: int
    compiled: bool

    @property
    def name(self) -> str:
        return f"{self.micro_batch}" + (":compile" if self.compiled else "")


def parse_variant(text: str) -> Variant:
    size, _, options = text.partition(":")
    chosen = set(options.split("+")) - {""}
    if not size.isdigit() or chosen - {"compile"}:
        raise argparse.ArgumentTypeError(f"variant {text!r}: MICRO_BATCH[:compile]")
    return Variant(int(size), "compile" in chosen)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/critic.json", help="JSON written after every variant")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a tiny shape")
    parser.add_argument("--inputs", type=int, default=None, help="explanations per call (default 512; tiny 8)")
    parser.add_argument("--tokens", type=int, default=None, help="explanation tokens (default 160; tiny 8)")
    parser.add_argument("--variants", default="24:compile", help="comma-separated MICRO_BATCH[:compile]")
    parser.add_argument("--profile-micro-batches", type=int, default=4,
                        help="micro-batches in the profiled call (0: no profile)")
    args = parser.parse_args()
    args.inputs = args.inputs or (8 if args.tiny else 512)
    args.tokens = args.tokens or (8 if args.tiny else 160)
    args.variants = [parse_variant(v) for v in args.variants.split(",")]
    return args


def main() -> None:
    args = parse_args()
    from nla_shell.io.config import TrainConfig
    from nla_shell.models import trainable_parameters
    from nla_shell.training.scoring import score_and_train_critic
    from nla_shell.training.runtime import make_optimizer

    device = torch.device("cpu") if args.tiny else torch.device("cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    record = syn.Record(args.out, {**syn.environment(device), "settings": {k: str(v) for k, v in vars(args).items()},
                                   "peak_tflops": PEAK_TFLOPS})
    tokenizer, _ = syn.toy_tokenizer()
    shape = syn.TINY if args.tiny else syn.QWEN3_8B
    extraction_layer = 1 if args.tiny else 24
    ar = syn.random_ar(shape, extraction_layer=extraction_layer, vocab_size=len(tokenizer), device=device, dtype=dtype)
    ar.requires_grad_(True)
    optimizer = make_optimizer(trainable_parameters(ar), defaults["critic_lr"], device=device, label="critic")
    generator = torch.Generator().manual_seed(0)
    explanations = [word_text(tokenizer, torch.randint(0, 1 << 20, (args.tokens,), generator=generator).tolist())
                    for _ in range(args.inputs)]
    golds = torch.randn(args.inputs, ar.lm.config.hidden_size, generator=generator)
    ar_tokens = len(tokenizer.encode(TEMPLATE.format(explanation=explanations[0]), add_special_tokens=False))
    flops = 3 * forward_flops(ar.lm.config, layers=extraction_layer + 1, tokens=args.inputs * ar_tokens,
                              attention_pairs=args.inputs * ar_tokens * (ar_tokens + 1) // 2, logit_rows=0)

    def call(variant: Variant, n: int):
        return lambda: score_and_train_critic(
            ar, optimizer, tokenizer, explanations[:n], golds[:n], template=TEMPLATE, mse_scale=ar.mse_scale,
            reward_kind=defaults["reward"], max_tokens=defaults["max_explanation_tokens"],
            micro_batch=variant.micro_batch, max_grad_norm=defaults["max_grad_norm"])

    print(f"[setup] {args.inputs} explanations of {ar_tokens} AR tokens, {extraction_layer + 1} blocks, "
          f"{flops / 1e15:.2f} PFLOP per call", flush=True)
    for variant in args.variants:
        label = f"{args.inputs} inputs mb {variant.name}"
        try:
            with syn.trainer_options(ar.lm, bf16_autocast=False, compiled=(ar.lm,) if variant.compiled else ()):
                call(variant, min(args.inputs, 2 * variant.micro_batch))()  # compilation, allocator growth
                syn.free_memory(device)
                seconds, (scores, loss, grad_norm, _), memory = syn.measured(call(variant, args.inputs), device)
                profiled = {}
                if args.profile_micro_batches:
                    n = min(args.inputs, args.profile_micro_batches * variant.micro_batch)
                    profiled = profiled_call(call(variant, n), device, None)
        except Exception as err:  # noqa: BLE001 - one variant's failure (out of memory) leaves the others
            record.error(label, err)
            syn.free_memory(device)
            continue
        tflops = flops / seconds / 1e12
        case = {"variant": variant.name, "micro_batch": variant.micro_batch, "compiled": variant.compiled,
                "inputs": args.inputs, "ar_tokens": ar_tokens, "s": seconds, "tflops": tflops,
                "pct_peak": 100 * tflops / PEAK_TFLOPS, **memory, "loss": loss, "grad_norm": grad_norm,
                "scored": int(scores.valid.sum()), **profiled}
        record.add(case)
        print(f"[critic] {label}: {seconds:.2f}s, {tflops:.1f} TF/s ({case['pct_peak']:.0f}% of peak), "
              f"peak {memory['peak_gib']:.1f} GiB, loss {loss:.6f} grad_norm {grad_norm:.4e}", flush=True)
        if "idle" in profiled:
            print_gaps(label, profiled)
    print(f"saved {record.path}")


if __name__ == "__main__":
    main()
