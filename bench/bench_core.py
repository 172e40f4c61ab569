"""CPU benchmark of the loss path: nla_core vs a faithful copy of the reference's.

At the reference's micro-batch (2 rows, 40 prompt + 160 response tokens, V = 8192) and 64
samples in all, time `token_logprobs` (policy + reference) + `grpo_loss` + backward against
the reference's `grpo_update_microbatched` arithmetic: a full float32 `log_softmax` of each
micro-batch's logits, then its per-sample loop. Same inputs, same run. Prints the time ratio,
each path's peak extra memory (the process's peak RSS during the path, reset through
/proc/self/clear_refs, minus its RSS before; logit gradients, the same for both paths, count),
and the max abs difference of losses and logit gradients.

    .venv/bin/python bench/bench_core.py            # full run (~1 min on 2 cores)
    .venv/bin/python bench/bench_core.py --quick    # fewer samples, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import nla_core

MICRO, PROMPT, RESPONSE, VOCAB = 2, 40, 160, 8192
CLIP_EPS, KL_BETA, TIS_CAP = 0.2, 0.04, 2.0


def make_inputs(n_samples: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for _ in range(n_samples // MICRO):
        logits = (3 * torch.randn(MICRO, PROMPT + RESPONSE, VOCAB, generator=g)).requires_grad_()
        ref_logits = logits.detach() + 0.1 * torch.randn(logits.shape, generator=g)
        ids = torch.randint(VOCAB, (MICRO, PROMPT + RESPONSE), generator=g)
        chunks.append((logits, ref_logits, ids))
    old = [torch.randn(MICRO, RESPONSE, generator=g) * 0.05 for _ in chunks]
    adv = torch.randn(n_samples, generator=g)
    return chunks, old, adv


def reference_path(chunks, old, adv, n):
    """grpo_update_microbatched's loss arithmetic, verbatim in structure."""
    losses = []
    for c, (logits, ref_logits, ids) in enumerate(chunks):
        new_logp = F.log_softmax(logits.float(), dim=-1)
        ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
        chunk_losses = []
        for row in range(MICRO):
            target = ids[row, PROMPT:]
            pred_idx = torch.arange(PROMPT - 1, PROMPT + RESPONSE - 1)
            new_lp = new_logp[row].index_select(0, pred_idx).gather(-1, target.unsqueeze(-1)).squeeze(-1)
            ref_lp = ref_logp[row].index_select(0, pred_idx).gather(-1, target.unsqueeze(-1)).squeeze(-1).detach()
            old_lp = new_lp.detach() + old[c][row]
            ratio = torch.clamp(torch.exp(new_lp - old_lp), max=TIS_CAP)
            clipped = torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
            a = adv[c * MICRO + row]
            surrogate = torch.minimum(ratio * a, clipped * a)
            delta = ref_lp - new_lp
            kl = torch.exp(delta) - delta - 1.0
            chunk_losses.append((-(surrogate - KL_BETA * kl)).mean())
        del ref_logp
        chunk_loss = torch.stack(chunk_losses).sum() / n
        chunk_loss.backward()
        losses.append(chunk_loss.detach())
        del new_logp
    return torch.stack(losses)


def core_path(chunks, old, adv, n):
    losses = []
    mask = torch.ones(MICRO, RESPONSE, dtype=torch.bool)
    for c, (logits, ref_logits, ids) in enumerate(chunks):
        targets = ids[:, PROMPT:]
        logp = torch.stack([nla_core.token_logprobs(logits[r, PROMPT - 1 : -1], targets[r]) for r in range(MICRO)])
        with torch.no_grad():
            ref = torch.stack([nla_core.token_logprobs(ref_logits[r, PROMPT - 1 : -1], targets[r]) for r in range(MICRO)])
        out = nla_core.grpo_loss(
            logp, logp.detach() + old[c], adv[c * MICRO : (c + 1) * MICRO], mask, ref_logp=ref,
            clip_eps=CLIP_EPS, kl_beta=KL_BETA, tis="ratio_cap", tis_cap=TIS_CAP, denominator=n,
        )
        out.loss.backward()
        losses.append(out.loss.detach())
    return torch.stack(losses)


PATHS = {"reference": reference_path, "core": core_path}


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_mib(fn, chunks, old, adv, n) -> float:
    """Peak RSS above the starting RSS while fn runs (Linux: '5' resets the peak)."""
    for logits, _, _ in chunks:
        logits.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    fn(chunks, old, adv, n)
    return (_status_kib("VmHWM") - before) / 1024


def main() -> None:
    # A fixed mmap threshold makes glibc return every large freed block to the OS at once;
    # otherwise its dynamic threshold keeps freed tensors resident and hides peaks from RSS.
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeats = 8, 2
    torch.set_num_threads(1)
    n = args.samples
    chunks, old, adv = make_inputs(n)

    results = {}
    for name, fn in PATHS.items():
        times = []
        for _ in range(args.repeats):
            for logits, _, _ in chunks:
                logits.grad = None
            t0 = time.perf_counter()
            losses = fn(chunks, old, adv, n)
            times.append(time.perf_counter() - t0)
        grads = torch.cat([logits.grad.flatten() for logits, _, _ in chunks])
        results[name] = {"median_s": statistics.median(times), "losses": losses, "grads": grads}

    mem = {name: peak_extra_mib(fn, chunks, old, adv, n) for name, fn in PATHS.items()}
    ratio = results["core"]["median_s"] / results["reference"]["median_s"]
    loss_diff = float((results["core"]["losses"] - results["reference"]["losses"]).abs().max())
    grad_diff = float((results["core"]["grads"] - results["reference"]["grads"]).abs().max())
    grad_scale = float(results["reference"]["grads"].abs().max())
    report = {
        "samples": n, "micro_batch": MICRO, "prompt": PROMPT, "response": RESPONSE, "vocab": VOCAB,
        "threads": 1, "repeats": args.repeats,
        "reference_s": results["reference"]["median_s"], "core_s": results["core"]["median_s"],
        "time_ratio_core_over_reference": ratio,
        "peak_extra_mib": mem,
        "of_which_logit_grads_mib": sum(l.numel() * l.element_size() for l, _, _ in chunks) / 2**20,
        "max_abs_loss_diff": loss_diff, "max_abs_grad_diff": grad_diff, "max_abs_grad": grad_scale,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
