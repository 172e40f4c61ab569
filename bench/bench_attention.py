"""The attention and rotary kernels of the update's response forward, alone, at the Qwen3-8B shape (issue 31).

The shared-prefix response forward (training/prefix.py) runs its n samples' R - 1 queries against
P prompt keys + R - 1 response keys. transformers' SDPA function, given that forward's padding mask,
materialises a boolean [n, 1, R-1, P+R-1] mask and repeats the keys and values to every query head
(`repeat_kv`); the arithmetic is lower-right-aligned causal attention, which flash attention does
with neither. This times, forward + backward on the same random inputs, per variant:

  response/hf_mask       what the trainer runs today: repeat_kv + the boolean mask, SDPA's own choice
  response/lower_right   `causal_lower_right` + enable_gqa (flash attention where it can run)
  ar/hf_mask             the AR's forward today (right-padded rows, so a padding mask): repeat_kv + mask
  ar/causal              the same rows with is_causal and enable_gqa (a right pad follows every real token)
  rotary/<mode>          transformers' Qwen3 apply_rotary_pos_emb on q [n, H, R-1, Dh] (a transpose, as the attention
                         hands it over) and k: eager, torch.compile dynamic=True (what compile_blocks
                         runs), dynamic=False, and dynamic=True with the head dims (H, Dh) marked
                         static, the batch and length dynamic

and the largest |difference| of each variant's output and input gradients from its family's first.

    python bench/bench_attention.py --out $OUT/attention.json            # H200
    .venv/bin/python bench/bench_attention.py --tiny --out /tmp/att.json  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from transformers.integrations.sdpa_attention import repeat_kv
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import synthetic as syn  # noqa: E402


def response_hf_mask(q, k, v, prompt: int):
    lq, lk = q.shape[2], k.shape[2]
    allowed = torch.arange(lk, device=q.device)[None] <= torch.arange(lq, device=q.device)[:, None] + prompt
    mask = allowed[None, None].expand(q.shape[0], 1, lq, lk)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)


def response_lower_right(q, k, v, prompt: int):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          enable_gqa=True)


def ar_hf_mask(q, k, v, prompt: int):
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    mask = causal[None, None].expand(q.shape[0], 1, length, length)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)


def ar_causal(q, k, v, prompt: int):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def head_dims_static(rotary):
    """`rotary` with q, k's H and Dh and cos, sin's Dh marked static for dynamo (N and T stay dynamic)."""
    def run(q, k, cos, sin):
        for heads in (q, k):
            torch._dynamo.mark_static(heads, 1)
            torch._dynamo.mark_static(heads, 3)
        for table in (cos, sin):
            torch._dynamo.mark_static(table, 2)
        return rotary(q, k, cos, sin)
    return run


def timed(fn, inputs, grads, reps: int, device) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of forward + backward over reps (after 2 untimed), and (output, input grads) of the last run."""
    def once():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [t.grad for t in inputs]

    runs = [syn.timed(once, device) for _ in range(reps + 2)][2:]
    return sorted(seconds for seconds, _ in runs)[len(runs) // 2], runs[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes (a smoke test)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n, heads, kv_heads, dim, prompt, response, ar_len = (
        (2, 4, 2, 16, 6, 9, 12) if args.tiny else (64, 32, 8, 128, 96, 160, 170))
    lq, lk = response - 1, prompt + response - 1
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()

    rows = []

    def run(family, variants, inputs, extra=()):
        grads = None
        first = None
        for name, fn in variants:
            call = (lambda *xs, fn=fn: fn(*xs, *extra))
            if grads is None:
                probe = call(*inputs)
                probe = probe if isinstance(probe, tuple) else (probe,)
                grads = [torch.randn(p.shape, generator=gen).to(device, dtype) for p in probe]
            seconds, result = timed(call, inputs, grads, args.reps, device)
            first = first or result
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(result, first))
            rows.append({"family": family, "variant": name, "ms": seconds * 1e3, "max_abs_diff": diff})
            print(f"[attention] {family}/{name}: {seconds * 1e3:.3f} ms fwd+bwd, max |diff| {diff:.3g}", flush=True)

    q, k, v = rand(n, heads, lq, dim), rand(n, kv_heads, lk, dim), rand(n, kv_heads, lk, dim)
    run("response", [("hf_mask", response_hf_mask), ("lower_right", response_lower_right)], [q, k, v], (prompt,))
    q, k, v = rand(n, heads, ar_len, dim), rand(n, kv_heads, ar_len, dim), rand(n, kv_heads, ar_len, dim)
    run("ar", [("hf_mask", ar_hf_mask), ("causal", ar_causal)], [q, k, v], (0,))

    q_rows = rand(n, lq, heads, dim)  # the projection's layout; the attention transposes it
    k_rows = rand(n, lq, kv_heads, dim)
    angles = torch.rand(n, lq, dim // 2, generator=gen) * 6.28
    cos = torch.cat([angles.cos()] * 2, -1).to(device, dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(device, dtype)

    def rotary(fn):
        return lambda qr, kr: fn(qr.transpose(1, 2), kr.transpose(1, 2), cos, sin)

    variants = [("eager", rotary(apply_rotary_pos_emb))]
    if device.type == "cuda" or args.tiny:
        variants += [("compiled_dynamic", rotary(torch.compile(apply_rotary_pos_emb, dynamic=True))),
                     ("compiled_static", rotary(torch.compile(apply_rotary_pos_emb, dynamic=False))),
                     ("compiled_head_dims_static",
                      rotary(head_dims_static(torch.compile(apply_rotary_pos_emb, dynamic=True))))]
    run("rotary", variants, [q_rows, k_rows])

    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "shape": {"n": n, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "prompt": prompt,
                      "response": response, "ar_len": ar_len}, "reps": args.reps, "rows": rows}
    Path(args.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
