"""How much of an activation vector the frozen AV carries to where its explanation is written, per injection.

    python bench/injection_reach.py DATA_DIR MODEL_DIR [--blocks 1,10,20] [--embedding-replace]
        [--train-rows N] [--eval-rows N] [--batch B] [--out FILE]

DATA_DIR is a datagen out_dir of `explainer=context` labels (ar_sft, av_sft and eval parquets with their sidecars);
MODEL_DIR the target LM they were captured from. For each injection (`residual_add`, the vector norm-matched and added
at the output of each block in --blocks; with --embedding-replace also kitft's replacement of the marker's embedding
at norm √D), the frozen base model (no adapter) reads the AV prompt of the sidecar with each row's vector injected at
its marker, through `nla_shell.models.Injector`, the trainer's own hook. The final hidden state (after the final
norm) is read at the marker and at the prompt's last position, where the first explanation token is predicted.
On these features, fitted on training rows (ar_sft + av_sft) and scored on the document-disjoint eval rows:

- `fve`: ridge regression from the features back to the vector (λ picked on a tenth of the training rows), held-out
  share of the vector's variance explained;
- `last_word`: a softmax probe of the label's last word (classes seen 5+ times in training), held-out accuracy, beside
  the same probe on the vector itself and the majority class.

The frozen network's reach: how much of the vector survives, linearly, to the positions an adapter reads from. It is
a proxy for how far an injection leaves the adapter to carry the vector, not a measurement of a trained AV.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nla_shell import families  # noqa: E402
from nla_shell.explainers.context import parse  # noqa: E402
from nla_shell.io.data import av_prompt_messages, build_prompt_ids  # noqa: E402
from nla_shell.io.sidecars import Injection, load_sidecar  # noqa: E402
from nla_shell.models import Injector  # noqa: E402
from real_nla import softmax_probe  # noqa: E402

RIDGE_LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
"""Ridge penalties tried, times the number of training rows (features standardised)."""


def load_split(data_dir: Path, splits: tuple[str, ...], rows: int, seed: int) -> tuple[np.ndarray, list[str | None]]:
    """[rows, D] vectors and each row's label's last word (None: no parsable label), `rows` drawn at random."""
    tables = [pq.read_table(data_dir / f"{split}.parquet", columns=["activation_vector", "explanation"]).to_pydict()
              for split in splits]
    vectors = np.concatenate([np.asarray(t["activation_vector"], dtype=np.float32) for t in tables])
    words = []
    for t in tables:
        for text in t["explanation"]:
            label = parse(text)
            words.append(label.ending.split()[-1] if label is not None and label.ending.split() else None)
    keep = np.random.default_rng(seed).permutation(len(vectors))[:rows]
    return vectors[keep], [words[i] for i in keep]


@torch.no_grad()
def features(model: Any, injector: Injector, prompt: list[int], marker: int, vectors: np.ndarray,
             *, batch: int) -> dict[str, np.ndarray]:
    """{"marker": [N, D], "last": [N, D]}: the final hidden state at the marker and at the prompt's last position, each
    row's vector injected. The prompt before the marker is the same for every row: its cache is computed once."""
    inner = model.get_decoder()  # the decoder stack and its final norm, no LM head
    prefix = torch.tensor([prompt[:marker]])
    suffix = torch.tensor([prompt[marker:]])
    cache = inner(input_ids=prefix, use_cache=True).past_key_values
    out: dict[str, list[np.ndarray]] = {"marker": [], "last": []}
    for start in range(0, len(vectors), batch):
        chunk = torch.from_numpy(vectors[start : start + batch])
        n = len(chunk)
        rows_cache = copy.deepcopy(cache)
        rows_cache.batch_repeat_interleave(n)
        ids = suffix.expand(n, -1)
        sites = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)], dim=1)
        with injector.inject(ids, chunk, sites=sites):
            hidden = inner(input_ids=ids, past_key_values=rows_cache, use_cache=True).last_hidden_state
        out["marker"].append(hidden[:, 0].float().numpy())
        out["last"].append(hidden[:, -1].float().numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def ridge_fve(x_train: np.ndarray, y_train: np.ndarray, x_eval: np.ndarray, y_eval: np.ndarray) -> dict[str, float]:
    """Held-out FVE of y from x by ridge regression (x standardised on training rows; λ picked on their last tenth)."""
    mean, scale = x_train.mean(0), x_train.std(0) + 1e-6
    a, b = (x_train - mean) / scale, (x_eval - mean) / scale
    y_mean = y_train.mean(0)

    def fit(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
        x1 = np.concatenate([x, np.ones((len(x), 1))], 1)
        gram = x1.T @ x1 + lam * len(x) * np.eye(x1.shape[1])
        return np.linalg.solve(gram, x1.T @ (y - y_mean))

    def fve(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        predicted = np.concatenate([x, np.ones((len(x), 1))], 1) @ w + y_mean
        return float(1 - ((y - predicted) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())

    cut = len(a) * 9 // 10
    lam = max(RIDGE_LAMBDAS, key=lambda lam: fve(fit(a[:cut], y_train[:cut], lam), a[cut:], y_train[cut:]))
    return {"fve": fve(fit(a, y_train, lam), b, y_eval), "lambda": lam}


def reach(data_dir: str, model_dir: str, *, blocks: list[int], embedding_replace: bool, train_rows: int,
          eval_rows: int, batch: int, seed: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    data = Path(data_dir)
    nla = load_sidecar(data / "av_sft.parquet.nla_meta.yaml")
    tokenizer = families.load_tokenizer(model_dir)
    prompt = build_prompt_ids(av_prompt_messages(nla.actor_prompt_template), nla, tokenizer)
    marker = prompt.index(nla.injection_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x_train, w_train = load_split(data, ("ar_sft", "av_sft"), train_rows, seed)
    x_eval, w_eval = load_split(data, ("eval",), eval_rows, seed)
    d_model = x_train.shape[1]

    def probe(f_train: np.ndarray, f_eval: np.ndarray) -> dict[str, Any]:
        return softmax_probe(f_train, w_train, f_eval, w_eval, min_count=5)

    result: dict[str, Any] = {
        "rows": {"train": len(x_train), "eval": len(x_eval)}, "prompt_tokens": len(prompt), "marker_position": marker,
        "vector": {"last_word": probe(x_train, x_eval)}, "injections": {},
    }
    settings = [(f"residual_add block {k}", Injection("residual_add", None, k)) for k in blocks]
    if embedding_replace:
        settings.append(("embedding_replace norm sqrt(D)", Injection("embedding_replace", math.sqrt(d_model), 1)))
    for name, injection in settings:
        start = time.perf_counter()
        injector = Injector.for_sidecar(model, nla, injection)
        try:
            f_train = features(model, injector, prompt, marker, x_train, batch=batch)
            f_eval = features(model, injector, prompt, marker, x_eval, batch=batch)
        finally:
            injector.remove()
        result["injections"][name] = {
            where: {**ridge_fve(f_train[where], x_train, f_eval[where], x_eval),
                    "last_word": probe(f_train[where], f_eval[where])}
            for where in ("marker", "last")
        }
        result["injections"][name]["seconds"] = time.perf_counter() - start
        print(name, json.dumps(result["injections"][name]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir")
    parser.add_argument("model_dir")
    parser.add_argument("--blocks", default="1,10,20", help="residual_add blocks, comma-separated")
    parser.add_argument("--embedding-replace", action="store_true", help="also kitft's embedding replacement at √D")
    parser.add_argument("--train-rows", type=int, default=6000)
    parser.add_argument("--eval-rows", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="a JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = reach(args.data_dir, args.model_dir, blocks=[int(b) for b in args.blocks.split(",")],
                   embedding_replace=args.embedding_replace, train_rows=args.train_rows, eval_rows=args.eval_rows,
                   batch=args.batch, seed=args.seed)
    result["command"] = " ".join(sys.argv)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
