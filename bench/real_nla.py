"""The real NLA on SmolLM2-135M-Instruct: helpers of `bench/real_nla.sh` (see it for the GPU calls).

    python bench/real_nla.py random-model META_DIR OUT_DIR
        SmolLM2's config and tokenizer (META_DIR) with random weights: the timing calibration's model.
    python bench/real_nla.py assemble --engine E --seed S --sft-run DEMO_DIR --rl-dir TRAIN_DIR --after-rl EVAL_DIR --out DIR
        A demo-shaped run dir (report.json, demo_config.json, rl/metrics.jsonl) for an RL run made by hand
        from a demo's SFT checkpoints (`nla train --config DEMO_DIR/rl/config.yaml engine=E`) and scored by
        `nla eval` with the demo's eval settings: its gold and after-SFT numbers are the demo's evals.
    python bench/real_nla.py table RUN_DIR... --out DIR
        The per-run table of `nla demo` reports (engine, seed) with mean ± se per engine, the paired
        RL − SFT differences, the training curves of every run as one PNG, and a dozen held-out
        explanations before and after RL: DIR/real_nla.json, DIR/real_nla.md, DIR/real_nla_curves.png.
    python bench/real_nla.py label-parts RUN_DIR... [--out FILE]
        Which parts of the context label the AV gets right on the held-out rows after SFT and after RL: the play,
        the speaker, the ending's last word and its words (from each run's eval_samples.jsonl).
    python bench/real_nla.py linear-parts RUN_DIR [--out FILE]
        What each label part says about the vector, from a demo's data alone (no model): the held-out share of
        variance that the class means of the play, the speaker and the last word explain (least squares on
        one-hot parts, fitted on the SFT splits, scored on the eval split), and how well a linear probe reads
        each part from the vector (held-out accuracy against the majority class).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nla_shell.stats import mean_se  # noqa: E402

COLUMNS = (
    ("AR on gold", ("fve", "AR on gold explanations")),
    ("AV+AR after SFT", ("fve", "AV+AR after SFT")),
    ("AV+AR after RL", ("fve", "AV+AR after RL")),
    ("SFT / gold", ("fraction_of_gold", "after SFT")),
    ("RL / gold", ("fraction_of_gold", "after RL")),
    ("SFT / gold, greedy", ("fraction_of_gold", "after SFT, greedy")),
    ("RL / gold, greedy", ("fraction_of_gold", "after RL, greedy")),
    ("fve_nrm gold", ("fve_nrm", "AR on gold explanations")),
    ("fve_nrm after RL", ("fve_nrm", "AV+AR after RL")),
    ("shuffled control (RL)", ("fve", "AV+AR after RL, AV given a shuffled vector (control)")),
    ("splice-KL after RL", ("splice_kl", "AV+AR after RL")),
    ("splice-KL gold", ("splice_kl", "AR on gold explanations")),
    ("extraction after RL", ("extraction_rate", "after RL")),
    ("tokens after RL", ("explanation_tokens", "after RL")),
    ("AR SFT steps", ("sft", "AR", "step_used")),
    ("AV SFT steps", ("sft", "AV", "step_used")),
    ("s / RL step", ("seconds_per_rl_step",)),
    ("wall s", ("seconds", "total")),
)
"""Table columns: header, then the path of keys into a demo's report.json."""


def random_model(meta_dir: str, out_dir: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(meta_dir)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig.from_pretrained(meta_dir)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(meta_dir).save_pretrained(out_dir)


def _summary(eval_dir: Path) -> dict[str, Any]:
    return json.loads((eval_dir / "eval_summary.json").read_text())


def _samples(eval_dir: Path) -> list[dict[str, Any]]:
    path = eval_dir / "eval_samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def assemble(*, engine: str, seed: int, sft_run: str, rl_dir: str, after_rl: str, out: str) -> None:
    import shutil

    from nla_shell.pipeline.demo_report import held_out_samples, rl_step_seconds

    demo_dir, out_dir = Path(sft_run), Path(out)
    gold, sft, rl = (_summary(demo_dir / "eval" / "gold"), _summary(demo_dir / "eval" / "after_sft"),
                     _summary(Path(after_rl)))
    (out_dir / "rl").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(rl_dir) / "metrics.jsonl", out_dir / "rl" / "metrics.jsonl")
    config = {**json.loads((demo_dir / "demo_config.json").read_text()), "engine": engine, "seed": seed}
    (out_dir / "demo_config.json").write_text(json.dumps(config, indent=1))
    report = {
        "assembled_from": {"sft_run": str(demo_dir), "rl_dir": rl_dir, "after_rl": after_rl},
        "fve": {"AR on gold explanations": gold["gold/fve"], "AV+AR after SFT": sft["av/fve"],
                "AV+AR after RL": rl["av/fve"],
                "AV+AR after RL, AV given a shuffled vector (control)": rl.get("shuffled/fve")},
        "splice_kl": {"AR on gold explanations": rl.get("splice/kl_gold"), "AV+AR after RL": rl.get("splice/kl_av")},
        "extraction_rate": {"after SFT": sft["av/extraction_rate"], "after RL": rl["av/extraction_rate"]},
        "explanation_tokens": {"after SFT": sft.get("length/tokens_mean"), "after RL": rl.get("length/tokens_mean")},
        "seconds_per_rl_step": rl_step_seconds(Path(rl_dir)),
        "seconds": {},
        "samples": held_out_samples(_samples(demo_dir / "eval" / "after_sft"), _samples(Path(after_rl))),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))


def _get(report: dict[str, Any], path: Sequence[str]) -> float | None:
    value: Any = report
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def table(run_dirs: list[str], out: str) -> None:
    runs = []
    for run_dir in map(Path, run_dirs):
        report_path = run_dir / "report.json"
        if not report_path.is_file():
            print(f"[table] {run_dir}: no report.json (the run did not finish)")
            continue
        config = json.loads((run_dir / "demo_config.json").read_text())
        runs.append({"run": run_dir.name, "engine": config["engine"], "seed": config["seed"],
                     "report": json.loads(report_path.read_text()), "dir": run_dir})
    runs.sort(key=lambda r: (r["engine"], r["seed"]))
    header = "| run | engine | seed | " + " | ".join(c for c, _ in COLUMNS) + " | RL − SFT |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 4)]
    summary: dict[str, Any] = {"runs": [], "by_engine": {}}
    for run in runs:
        values = {name: _get(run["report"], path) for name, path in COLUMNS}
        sft, rl = values["AV+AR after SFT"], values["AV+AR after RL"]
        values["RL − SFT"] = None if sft is None or rl is None else rl - sft
        summary["runs"].append({"run": run["run"], "engine": run["engine"], "seed": run["seed"], **values})
        cells = ["—" if v is None else (f"{v:.1f}" if name in ("wall s", "tokens after RL")
                                      else f"{v:.0f}" if name.endswith("steps") else f"{v:.3f}")
                 for name, v in values.items()]
        lines.append(f"| {run['run']} | {run['engine']} | {run['seed']} | " + " | ".join(cells) + " |")
    for engine in sorted({r["engine"] for r in runs}):
        rows = [r for r in summary["runs"] if r["engine"] == engine]
        stats = {name: [r[name] for r in rows if r[name] is not None] for name in [*dict(COLUMNS), "RL − SFT"]}
        summary["by_engine"][engine] = {name: {"mean": m.mean if v else None, "n": m.n,
                                               "se": m.se if len(v) > 1 else None}
                                        for name, v in stats.items() for m in [mean_se(v)]}
        summary["by_engine"][engine]["rl_beats_sft_every_seed"] = all(v > 0 for v in stats["RL − SFT"]) and bool(
            stats["RL − SFT"])
        lines.append(f"| | **{engine}** | mean ± se | " + " | ".join(mean_se(v).text() for v in stats.values()) + " |")
    lines += ["", "Held-out explanations (the first eval rows), verbatim, of each engine's first run:", ""]
    for engine in sorted({r["engine"] for r in runs}):
        first = next(r for r in runs if r["engine"] == engine)
        lines += [f"**{engine}, seed {first['seed']}**", ""]
        for i, sample in enumerate(first["report"].get("samples", [])):
            lines += [f"{i + 1}. …{sample['context'][-100:]!r}", f"   - gold: {sample['gold']!r}",
                      f"   - after SFT: {sample['after_sft']!r}", f"   - after RL: {sample['after_rl']!r}"]
        lines.append("")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "real_nla.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "real_nla.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    curves(runs, out_dir / "real_nla_curves.png")


def curves(runs: list[dict[str, Any]], path: Path) -> None:
    """Held-out FVE through AR and AV SFT, then reward, held-out FVE, KL and mean explanation length through RL,
    against step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward_mean", "reward (train)"), ("eval/fve", "held-out FVE (eval during RL)"),
              ("kl_mean", "KL to the SFT policy"), ("response_len_mean", "mean response tokens"))
    stages = (("AR", "AR SFT: held-out FVE on gold"), ("AV", "AV SFT: held-out round-trip FVE"))
    fig, axes = plt.subplots(1, len(stages) + len(panels), figsize=(4.5 * (len(stages) + len(panels)), 3.6))
    for run in runs:
        for ax, (stage, title) in zip(axes, stages):
            points = run["report"].get("sft", {}).get(stage, {}).get("heldout", {}).get("heldout/fve", [])
            if points:
                ax.plot(*zip(*points), label=f"{run['engine']} s{run['seed']}")
            ax.set_title(title)
            ax.set_xlabel("SFT step")
        records = [json.loads(line) for line in (run["dir"] / "rl" / "metrics.jsonl").read_text().splitlines()]
        for ax, (key, title) in zip(axes[len(stages):], panels):
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), label=f"{run['engine']} s{run['seed']}",
                        linestyle="-" if run["engine"] == "hf" else "--")
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _emit(result: dict[str, Any], out: str | None) -> dict[str, Any]:
    """Print `result` as JSON, and write it to `out` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out is not None:
        Path(out).write_text(text + "\n")
    return result


def label_parts(run_dirs: list[str], out: str | None) -> dict[str, Any]:
    """Which parts of the context label (`explainer=context`) the AV gets right on the held-out rows, after SFT and
    after RL, over every run: the play (topic), the speaker (rows whose gold names one), the last word of the
    quoted ending, and the share of the ending's words it writes; `parsed` is the share in the label's layout.
    `mse_by_last_word`: on the parsed rows the AR scored, the mean MSE of the AV's explanation and of the gold one,
    split by whether the AV's last word is right (where the gap to the gold AR lies)."""
    from nla_shell.explainers.context import parse

    def last_word(ending: str) -> str:
        words = ending.split()
        return words[-1].strip(".,;:!?'\"").lower() if words else ""

    result: dict[str, Any] = {}
    plays: set[str | None] = set()
    for stage in ("after_sft", "after_rl"):
        counts: dict[str, list[float]] = {"parsed": [], "play": [], "speaker": [], "last_word": [], "ending_words": []}
        mses: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for run_dir in map(Path, run_dirs):
            for sample in _samples(run_dir / "eval" / stage):
                gold, written = parse(sample["gold_explanation"]), parse(sample.get("explanation"))
                counts["parsed"].append(written is not None)
                if gold is not None:
                    plays.add(gold.topic)
                if gold is None or written is None:
                    continue
                if gold.topic is not None:
                    counts["play"].append(gold.topic == written.topic)
                if gold.speaker is not None:
                    counts["speaker"].append(gold.speaker == written.speaker)
                right = last_word(gold.ending) == last_word(written.ending)
                counts["last_word"].append(right)
                if sample.get("mse") is not None and sample.get("gold_mse") is not None:
                    mses[right].append((sample["mse"], sample["gold_mse"]))
                gold_words = {w.lower() for w in gold.ending.split()}
                counts["ending_words"].append(len(gold_words & {w.lower() for w in written.ending.split()})
                                              / max(1, len(gold_words)))
        result[stage] = {key: statistics.fmean(v) if v else None for key, v in counts.items()}
        result[stage]["rows"] = len(counts["parsed"])
        result[stage]["mse_by_last_word"] = {
            "right" if right else "wrong": {"rows": len(pairs), "av": statistics.fmean(p[0] for p in pairs),
                                            "gold": statistics.fmean(p[1] for p in pairs)}
            for right, pairs in mses.items() if pairs}
    result["plays_among_gold"] = len(plays)
    return _emit(result, out)


def softmax_probe(x_train: Any, keys_train: Sequence[str | None], x_eval: Any, keys_eval: Sequence[str | None], *,
                  min_count: int) -> dict[str, Any] | None:
    """A linear probe of a label part from features: softmax regression on standardised features (300 full-batch
    Adam steps), over the parts seen min_count+ times in training; its held-out accuracy beside the majority class's.
    None when fewer than two parts are that frequent (the labels leave the part out)."""
    import collections

    import numpy as np
    import torch

    counts = collections.Counter(k for k in keys_train if k is not None)
    vocab = {k: i for i, k in enumerate(k for k, c in counts.items() if c >= min_count)}
    if len(vocab) < 2:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mean, scale = x_train.mean(0), x_train.std(0) + 1e-6
    rows_train = [i for i, k in enumerate(keys_train) if k in vocab]
    rows_eval = [i for i, k in enumerate(keys_eval) if k in vocab]
    a, b = (torch.tensor((np.asarray(x)[rows] - mean) / scale, dtype=torch.float32, device=device)
            for x, rows in ((x_train, rows_train), (x_eval, rows_eval)))
    ya, yb = (torch.tensor([vocab[keys[i]] for i in rows], device=device)
              for keys, rows in ((keys_train, rows_train), (keys_eval, rows_eval)))
    linear = torch.nn.Linear(a.shape[1], len(vocab)).to(device)
    opt = torch.optim.Adam(linear.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(linear(a), ya).backward()
        opt.step()
    with torch.no_grad():
        accuracy = (linear(b).argmax(1) == yb).float().mean().item()
    majority = (yb == torch.bincount(ya).argmax()).float().mean().item()
    return {"classes": len(vocab), "eval_rows": len(rows_eval), "accuracy": accuracy, "majority": majority}


def linear_parts(run_dir: str, out: str | None) -> dict[str, Any]:
    """See the module docstring. Parts seen fewer than twice in training share one "other" class (ridge, λ = 1);
    the probes (softmax regression on standardised vectors, 300 full-batch Adam steps) keep classes seen 5+ times."""
    import collections

    import numpy as np
    import pyarrow.parquet as pq

    from nla_shell.explainers.context import parse

    def last_word(label: Any) -> str | None:
        return label.ending.split()[-1] if label is not None and label.ending.split() else None

    part_of = {"play": lambda label: None if label is None else label.topic,
               "speaker": lambda label: None if label is None else label.speaker, "last word": last_word}

    def load(*splits: str) -> tuple[Any, dict[str, list[str | None]]]:
        tables = [pq.read_table(Path(run_dir) / "data" / f"{split}.parquet",
                                columns=["activation_vector", "explanation"]).to_pydict() for split in splits]
        x = np.concatenate([np.asarray(t["activation_vector"], dtype=np.float64) for t in tables])
        labels = [parse(e) for t in tables for e in t["explanation"]]
        return x, {name: [f(label) for label in labels] for name, f in part_of.items()}

    x_train, parts_train = load("ar_sft", "av_sft")
    x_eval, parts_eval = load("eval")
    mean = x_train.mean(0)
    total = ((x_eval - mean) ** 2).sum(1).mean()

    def classes(name: str, min_count: int) -> dict[str, int]:
        """The values of part `name` seen at least min_count times in training, numbered."""
        counts = collections.Counter(k for k in parts_train[name] if k is not None)
        return {k: i for i, k in enumerate(k for k, c in counts.items() if c >= min_count)}

    def class_index(name: str, offset: int) -> tuple[Any, Any, int]:
        """Each row's class of part `name` (train, eval), offset into the joint columns; rare or absent: one column."""
        vocab = classes(name, 2)
        index = [np.array([vocab.get(k, len(vocab)) if k is not None else len(vocab) for k in parts[name]]) + offset
                 for parts in (parts_train, parts_eval)]
        return index[0], index[1], len(vocab) + 1

    def class_mean_fve(names: Sequence[str]) -> float:
        """Ridge regression on the parts' one-hot columns, built from class indices (F^T F by counting, no dense F)."""
        blocks, width = [], 0
        for name in names:
            train, held_out, n = class_index(name, width)
            blocks.append((train, held_out))
            width += n
        gram = np.eye(width)
        for a, _ in blocks:
            for b, _ in blocks:
                np.add.at(gram, (a, b), 1.0)
        rhs = np.zeros((width, x_train.shape[1]))
        for a, _ in blocks:
            np.add.at(rhs, a, x_train - mean)
        w = np.linalg.solve(gram, rhs)
        predicted = sum(w[held_out] for _, held_out in blocks)
        return float(1 - ((x_eval - mean - predicted) ** 2).sum(1).mean() / total)

    result = {
        "rows": {"train": len(x_train), "eval": len(x_eval)},
        "mean_share_of_norm2": float((mean ** 2).sum() / (x_train ** 2).sum(1).mean()),
        "class_mean_fve": {" + ".join(names): class_mean_fve(names) for names in
                           (("play",), ("speaker",), ("last word",), ("play", "speaker"),
                            ("last word", "play", "speaker"))},
        "probe": {name: softmax_probe(x_train, parts_train[name], x_eval, parts_eval[name], min_count=5)
                  for name in part_of},
    }
    return _emit(result, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("random-model")
    p.add_argument("meta_dir")
    p.add_argument("out_dir")
    p = sub.add_parser("assemble")
    for flag in ("--engine", "--sft-run", "--rl-dir", "--after-rl", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--seed", type=int, required=True)
    p = sub.add_parser("table")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", required=True)
    p = sub.add_parser("label-parts")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", help="a JSON file")
    p = sub.add_parser("linear-parts")
    p.add_argument("run_dir")
    p.add_argument("--out", help="a JSON file")
    args = parser.parse_args()
    if args.command == "random-model":
        random_model(args.meta_dir, args.out_dir)
    elif args.command == "assemble":
        assemble(engine=args.engine, seed=args.seed, sft_run=args.sft_run, rl_dir=args.rl_dir, after_rl=args.after_rl,
                 out=args.out)
    elif args.command == "linear-parts":
        linear_parts(args.run_dir, args.out)
    elif args.command == "label-parts":
        label_parts(args.run_dirs, args.out)
    else:
        table(args.run_dirs, args.out)


if __name__ == "__main__":
    main()
