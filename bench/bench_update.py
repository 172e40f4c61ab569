"""The GRPO policy update alone at the Qwen3-8B shape: where its time goes (issue 12).

`bench_step.py` times whole steps; this times only `training.update.policy_update` on
synthetic rollouts (random prompt and response ids of fixed lengths, behaviour log-probs 0),
so one variant costs seconds, not minutes, and no engine or AR is built. Per variant:

  seconds      wall time of one update over all rollouts (no optimizer step: every variant
               sees the same weights), after a warm-up update over the same rollouts
  TF/s, % pk   the update's matrix FLOPs (bench_step.path_flops) over that time, against 790
  gpu busy     kernel time / wall time over a profiled update of a few micro-batches:
               the share of the time the GPU computes (the rest it waits on the host); kernel
               time is the union of the trace's kernel and copy intervals
  sites        with --sites: that profiled update's kernel seconds by launching op, source
               line or backward node, and input shape (kernel_sites.py)
  syncs        host synchronisations in that profiled update (torch.cuda sync debug mode)
  idle         kernels and idle seconds in that profiled update, and the host ops the GPU waited on
               (`timeline.idle_gaps`)
  lead         with --lead, per pass how far the host ran ahead of the GPU and where the GPU waited
               (`timeline.HostLead`, one more update without the profiler)
  peak GiB     torch.cuda.max_memory_allocated during the timed update

A variant is MICRO_BATCH[:OPTION+OPTION...], options `bf16` (bf16_autocast), `compile`
(compile_blocks: norms, MLPs, LoRA layers, the rotary embedding and the log-prob head), `refN` (the reference pass at N samples a
forward instead of --reference-micro-batch), `pbN` (the prompts of N micro-batches in one forward
instead of TrainConfig.logp_prompt_block; pb1: one prompt forward per micro-batch, as before prompt blocks), `noref`
(no reference pass: kl_beta 0 and no KL metric;
its time against the same variant's with the pass is the pass's), `fp8` (the trainer's fp8=reference,update: the base's
forwards in FP8), `fp8bw` (fp8=reference,update,backward: its input gradients too), `fastacc` (with fp8 or
fp8bw: fp8_fast_accum=all, every FP8 product's fast accumulation) and `fastfwd` (fp8_fast_accum=forward: the
forward products'), e.g. `16 32:bf16+compile 64:bf16+compile+ref256`. (Retired replays, their numbers in
bench/RESULTS.md: `synced`, the shared-prefix forward before its sync fix, last at 74a810e; `mlpcompile`, `norotary`
and `nohead`, compile_blocks before the LoRA layers, the rotary embedding and the log-prob head joined, last at fad6eb1.)

    python bench/bench_update.py --cases 32x8 --variants 16,32,32:bf16 --out $OUT/update.json   # H200
    .venv/bin/python bench/bench_update.py --tiny --variants 2,4:compile --out /tmp/update.json  # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic as syn  # noqa: E402
from bench_step import PEAK_TFLOPS, path_flops, write_profile_table  # noqa: E402
from kernel_sites import format_sites, kernel_sites  # noqa: E402
from timeline import HostLead, idle_gaps  # noqa: E402

OPTIONS = ("bf16", "compile", "noref", "fp8", "fp8bw", "fastacc", "fastfwd")


@dataclasses.dataclass(frozen=True)
class Variant:
    micro_batch: int
    options: frozenset[str]

    @property
    def name(self) -> str:
        return f"{self.micro_batch}" + (":" + "+".join(sorted(self.options)) if self.options else "")

    def reference_micro_batch(self, default: int) -> int:
        """N of a `refN` option, else `default`."""
        return next((int(o[3:]) for o in self.options if o.startswith("ref")), default)

    def prompt_block(self, default: int) -> int:
        """N of a `pbN` option, else `default`."""
        return next((int(o[2:]) for o in self.options if o.startswith("pb")), default)


def parse_variant(text: str) -> Variant:
    size, _, options = text.partition(":")
    chosen = frozenset(o for o in options.split("+") if o)
    unknown = {o for o in chosen - set(OPTIONS)
               if not (o.startswith("ref") and o[3:].isdigit() or o.startswith("pb") and o[2:].isdigit())}
    if not size.isdigit() or unknown:
        raise argparse.ArgumentTypeError(f"variant {text!r}: MICRO_BATCH[:OPTION+...] with options from {OPTIONS}, "
                                         "refN or pbN")
    return Variant(int(size), chosen)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/update.json", help="JSON written after every variant")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a tiny shape")
    parser.add_argument("--cases", default=None, help="prompts x samples (default 32x8; tiny 4x2)")
    parser.add_argument("--variants", default="16", help="comma-separated MICRO_BATCH[:bf16+compile] variants")
    parser.add_argument("--reference-micro-batch", type=int, default=64, help="samples per reference forward")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 96 (tiny 24)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 160 (tiny 8)")
    parser.add_argument("--profile-micro-batches", type=int, default=3,
                        help="micro-batches in the profiled update that measures gpu busy and syncs (0: none)")
    parser.add_argument("--tables", default=None, help="directory for each variant's torch.profiler table")
    parser.add_argument("--sites", action="store_true",
                        help="with --tables: the profiled update's kernel time by launching op, source line or "
                             "backward node, and input shape (kernel_sites.py), as sites_VARIANT.txt")
    parser.add_argument("--lead", action="store_true",
                        help="one more update per variant with timeline.HostLead marks (the GPU's lag behind the host)")
    args = parser.parse_args()
    if args.sites and not (args.tables and args.profile_micro_batches):
        parser.error("--sites writes beside the profiler tables: give --tables DIR and --profile-micro-batches > 0")
    prompts, _, group = (args.cases or ("4x2" if args.tiny else "32x8")).partition("x")
    args.prompts, args.group = int(prompts), int(group)
    try:
        args.variants = [parse_variant(v) for v in args.variants.split(",") if v]
    except argparse.ArgumentTypeError as err:  # one line, not a trace (RESULTS.md cites retired options)
        parser.error(str(err))
    args.prompt_len = args.prompt_len or (24 if args.tiny else 96)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 160)
    return args


def synthetic_rollouts(n_prompts: int, group: int, *, prompt_len: int, new_tokens: int, d_model: int,
                       tokens: dict[str, int], vocab: int, seed: int = 0):
    """Groups of `group` rollouts of one marker prompt each, responses of `new_tokens` random ids;
    the prompts' activations [n_prompts * group, D]."""
    from nla_shell.engines.base import Rollout

    requests = syn.make_requests(n_prompts, prompt_len, d_model, tokens, vocab=vocab, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    rollouts = []
    for index, request in enumerate(requests):
        prompt = torch.tensor(request.prompt_ids)
        for _ in range(group):
            response = torch.randint(3, vocab, (new_tokens,), generator=generator)
            rollouts.append(Rollout(torch.cat([prompt, response]), prompt_len, torch.zeros(new_tokens), "", index))
    activations = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    return rollouts, activations


@contextlib.contextmanager
def options_installed(actor, options: frozenset[str]):
    """The variant's options on the actor for the block; yields its FP8 copies (None without fp8/fp8bw)."""
    compiled = (actor,) if "compile" in options else ()
    with syn.trainer_options(actor, bf16_autocast="bf16" in options, compiled=compiled):
        with fp8_copies(actor, options) as copies:
            yield copies


@contextlib.contextmanager
def fp8_copies(actor, options: frozenset[str]):
    """The FP8 copies of the actor's base as the trainer's setup makes them for fp8=reference,update
    (`training.setup.make_fp8_copies`), with input gradients in FP8 too for `fp8bw` and fast accumulation for
    `fastacc` (every product) or `fastfwd` (the forward's); removed after."""
    if not options & {"fp8", "fp8bw"}:
        yield None
        return
    from nla_shell import families
    from nla_shell.models import inner_lm
    from nla_shell.models.fp8 import FP8Linears

    copies = FP8Linears(families.backbone(inner_lm(actor)), label="reference+update",
                        compile_backend="inductor" if "compile" in options else None,
                        backward="fp8bw" in options,
                        fast_accum="all" if "fastacc" in options else "forward" if "fastfwd" in options else "off")
    print(copies.summary(), flush=True)
    try:
        yield copies
    finally:
        copies.remove()


def profiled_call(fn, device: torch.device, table_path: Path | None, *, sites: bool = False) -> dict[str, float]:
    """gpu busy share, host syncs and idle gaps of one call of `fn` (see the module docstring); with `sites`
    and a `table_path`, its kernel time by launching site beside the table (`kernel_sites`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    syncs = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with profile(activities=activities, record_shapes=sites, with_stack=sites) as prof:
                seconds, _ = syn.timed(fn, device)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    # The device's busy time: the union of its kernels' and copies' intervals in the trace (summing the profiler's
    # device events counted some twice on torch 2.11: "gpu busy" read 109 % in run AJ).
    idle = trace_gaps(prof) if cuda else None
    busy_s = idle["busy_s"] if cuda else math.nan
    if table_path is not None:
        write_profile_table(prof, table_path, device, rows=40)
        if sites and cuda:
            text = format_sites(kernel_sites(prof, top=60))
            table_path.with_name("sites_" + table_path.name.removeprefix("update_")).write_text(text + "\n")
            print(text[:6000], flush=True)
    return {"profiled_s": seconds, "gpu_busy": busy_s / seconds, "syncs": syncs, "kernel_s": busy_s,
            **({"idle": idle} if cuda else {})}


def trace_gaps(prof) -> dict:
    """`timeline.idle_gaps` of a finished profile (its chrome trace, through a temporary file)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return idle_gaps(json.loads(path.read_text()))


def print_gaps(label: str, profiled: dict) -> None:
    """The profiled window's idle time and the host ops it went to (the top five)."""
    idle = profiled["idle"]
    ops = "; ".join(f"{name[:60]} {seconds:.3f}s/{count}" for name, seconds, count in idle["by_host_op"][:5])
    print(f"[idle] {label}: kernels {idle['busy_s']:.2f}s, idle {idle['idle_s']:.2f}s in {idle['gaps']} gaps "
          f"over {idle['span_s']:.2f}s; waiting on: {ops}", flush=True)


def main() -> None:
    args = parse_args()
    from nla_shell.io.config import TrainConfig
    from nla_shell.models import trainable_parameters
    from nla_shell.training.runtime import make_optimizer
    from nla_shell.training.update import LossOptions, policy_update

    device = torch.device("cpu") if args.tiny else torch.device("cuda")
    needs_bf16 = any("bf16" in v.options for v in args.variants)
    dtype = torch.float32 if args.tiny and not needs_bf16 else torch.bfloat16
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    record = syn.Record(args.out, {**syn.environment(device), "settings": {k: str(v) for k, v in vars(args).items()},
                                   "peak_tflops": PEAK_TFLOPS})
    tokenizer, tokens = syn.toy_tokenizer()
    config = syn.qwen3_config(syn.TINY if args.tiny else syn.QWEN3_8B, vocab_size=len(tokenizer))
    actor = syn.attach_lora(syn.random_qwen3(config, device=device, dtype=dtype), r=defaults["lora_r"],
                            alpha=defaults["lora_alpha"], use_rslora=defaults["use_rslora"])
    actor.train()
    injector = syn.make_injector(actor, tokens)
    optimizer = make_optimizer(trainable_parameters(actor), defaults["lr"], device=device, label="actor")
    rollouts, activations = synthetic_rollouts(
        args.prompts, args.group, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        d_model=config.hidden_size, tokens=tokens, vocab=min(config.vocab_size, len(tokenizer)))
    advantages = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(2))
    flops = path_flops(config, rollouts, ar_tokens=[], critic_layers=0)["update"]

    def update(variant: Variant, n: int, copies):
        return lambda: policy_update(
            actor, injector, optimizer, rollouts[:n], advantages[:n], activations[:n],
            loss=LossOptions(kl_beta=0.0, kl_metric=False) if "noref" in variant.options else LossOptions(),
            micro_batch=variant.micro_batch, max_grad_norm=defaults["max_grad_norm"], pad_id=tokenizer.pad_token_id,
            reference_micro_batch=variant.reference_micro_batch(args.reference_micro_batch),
            prompt_block=variant.prompt_block(defaults["logp_prompt_block"]), step_optimizer=False,
            fp8_reference=copies, fp8_update=copies)

    print(f"[setup] {args.prompts}x{args.group}, prompt {args.prompt_len} + {args.new_tokens} tokens, "
          f"{flops / 1e15:.2f} PFLOP per update", flush=True)
    for variant in args.variants:
        label = f"{args.prompts}x{args.group} mb {variant.name}"
        try:
            with options_installed(actor, variant.options) as copies:
                # First-use costs (compilation, allocator growth): the whole update, so that every compiled variant
                # the timed update meets exists (a warm-up on its first micro-batches need not meet them all).
                update(variant, len(rollouts), copies)()
                syn.free_memory(device)
                seconds, stats, memory = syn.measured(update(variant, len(rollouts), copies), device)
                profiled = {}
                if args.profile_micro_batches:
                    n = min(len(rollouts), args.profile_micro_batches * variant.micro_batch)
                    table = Path(args.tables) / f"update_{variant.name.replace(':', '_').replace('+', '-')}.txt" if args.tables else None
                    profiled = profiled_call(update(variant, n, copies), device, table, sites=args.sites)
                if args.lead:
                    from nla_shell.families import decoder_blocks

                    with HostLead(decoder_blocks(actor)) as lead:
                        update(variant, len(rollouts), copies)()
                    profiled["lead"] = lead.summary()
        except Exception as err:  # noqa: BLE001 - one variant's failure (out of memory) leaves the others
            record.error(label, err)
            syn.free_memory(device)
            continue
        tflops = math.nan if "noref" in variant.options else flops / seconds / 1e12  # flops count the reference pass
        case = {"variant": variant.name, "micro_batch": variant.micro_batch, "options": sorted(variant.options),
                "prompts": args.prompts, "group": args.group, "s": seconds, "tflops": tflops,
                "pct_peak": 100 * tflops / PEAK_TFLOPS, **memory, "loss": stats.loss,
                "grad_norm": stats.grad_norm, **profiled}
        record.add(case)
        print(f"[update] {label}: {seconds:.2f}s, {tflops:.1f} TF/s ({case['pct_peak']:.0f}% of peak), "
              f"peak {memory['peak_gib']:.1f} GiB, gpu busy {profiled.get('gpu_busy', math.nan):.0%}, "
              f"syncs {profiled.get('syncs', 'n/a')} in {args.profile_micro_batches} micro-batches; "
              f"loss {stats.loss:+.6e} grad_norm {stats.grad_norm:.6e}", flush=True)
        if "idle" in profiled:
            print_gaps(label, profiled)
        for phase, lead in profiled.get("lead", {}).items():
            print(f"[lead] {label} {phase}: {lead['marks']} marks, host ahead by {lead['median_ms']:.1f} ms "
                  f"(median), {lead['min_ms']:.2f} ms (min); GPU waited at {lead['starved']:.0%} of them", flush=True)
    print(f"saved {record.path}")


if __name__ == "__main__":
    main()
