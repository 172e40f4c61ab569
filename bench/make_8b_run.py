"""Inputs for `nla train` at a Qwen3 shape (default 8B) on a GPU: random weights, toy tokenizer and data.

Writes DIR/av (HF checkpoint + tokenizer), DIR/ar (the AV truncated after two thirds of its depth,
`synthetic.ar_extraction_layer`: layer 24 at 8B, with an identity value head) and DIR/data/rl.parquet
+ sidecar (random activations, D = the shape's width, 4096 at 8B). The model's vocabulary is the real
151,936; the toy tokenizer covers its first ids only (ids beyond it decode to nothing), which is all
the trainer needs to exercise every phase.

    python3 bench/make_8b_run.py /tmp/nla8b                   # on the GPU
    python3 bench/make_8b_run.py /tmp/nla14b --shape 14b      # another Qwen3 size
    python3 bench/make_8b_run.py /tmp/nla8b --rows 1024       # rows for 256 prompts a step
    python3 bench/make_8b_run.py /tmp/nla8b --tiny            # CPU smoke: the tiny geometry
    nla train av_ckpt=/tmp/nla8b/av ar_ckpt=/tmp/nla8b/ar rl_parquet=/tmp/nla8b/data/rl.parquet ...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synthetic  # noqa: E402

from nla_shell.toy import builders as toy  # noqa: E402
from nla_shell.models import ARModel  # noqa: E402


def main(out: Path, *, tiny: bool, shape: str = "8b", rows: int = 96) -> None:
    t0 = time.perf_counter()
    device = torch.device("cpu" if tiny else "cuda")
    ar_layer = synthetic.ar_extraction_layer(shape, tiny=tiny)
    tokenizer = toy.train_tokenizer([synthetic.CORPUS] * 4, vocab_size=512)
    config = synthetic.qwen3_config(synthetic.bench_shape(shape, tiny=tiny), vocab_size=len(tokenizer))
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = synthetic.random_qwen3(config, device=device, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    toy.save_av_checkpoint(model, tokenizer, out / "av")
    del model
    ar = ARModel.from_pretrained(out / "av", mse_scale=None, extraction_layer_index=ar_layer, create_head=True,
                                 dtype=torch.bfloat16, device=device)
    ar.save_pretrained(out / "ar")
    del ar
    toy.make_toy_rl_dataset(out / "data", tokenizer, d_model=config.hidden_size, n_rows=rows, n_docs=max(80, rows), seed=0,
                            layer_index=ar_layer, row_group_size=32)
    print(f"[make_8b_run] wrote {out} ({'tiny' if tiny else shape}, AR layer {ar_layer}) in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: the tiny geometry")
    parser.add_argument("--shape", default="8b", choices=list(synthetic.QWEN3_SHAPES))
    parser.add_argument("--rows", type=int, default=96, help="RL rows (batch_prompts x steps need as many)")
    args = parser.parse_args()
    main(args.out, tiny=args.tiny, shape=args.shape, rows=args.rows)
