"""Metric sinks behind one small interface: console, JSONL (always), wandb (when installed), TensorBoard.

Every step record passes through `flat_record`, so every sink sees the same keys: all of
`METRIC_KEYS` (NaN where the step had no value) followed by any extra keys, such as the
`eval/...` ones on eval steps.
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

Scalar = float | int | str | None
"""A metric value; bools are ints. NaN (or None) marks a value the step did not produce."""

METRIC_KEYS: tuple[str, ...] = (
    "step",
    "loss",
    "reward_mean", "reward_std", "reward_min", "reward_max",
    "mse_mean", "mse_std", "mse_min", "mse_max",  # over the scored samples
    "fve",  # 1 - mse / the paper's "rawvar" predict-the-mean baseline
    "fve_pct", "fve_baseline",  # the reference's: 100 * fve, and that baseline's mse
    "fve_meannorm",  # 1 - mse / the normalised-mean baseline (the reference's older curve)
    "advantage_mean", "advantage_std",
    "extraction_rate",
    "cjk_fraction",
    "response_len_mean",
    "kl_mean",
    "entropy_mean",  # the policy's entropy (nats) at the response tokens, in the update's forward
    "clip_frac",  # tokens where the PPO clip is active (verl's pg_clipfrac, TRL's clip_ratio/region_mean)
    "outside_clip_frac",  # tokens whose ratio lies outside the clip range, any advantage (the reference's clip_frac)
    "tis_frac",
    "entropy_mask_frac",  # response tokens whose surrogate top_entropy_quantile dropped (0 when off)
    "logp_diff_mean", "logp_diff_max",  # |behaviour - trainer log-prob| over generated tokens
    "grad_norm",
    "skipped_steps",  # running count of optimizer steps skipped for a non-finite grad norm
    "critic_loss",
    "critic_grad_norm",
    "truncated_frac",  # rollouts cut by the max_new_tokens cap
    "length_penalty_mean",  # hinged length penalty subtracted from the reward (0 when off)
    # Each phase measured on its own: score excludes the critic's backward and step; under vllm_sleep the
    # push made at the rollouts' wake-up is the sync's, not the rollout's.
    "time_rollout", "time_score", "time_update", "time_critic", "time_sync", "time_step",
    "tokens_per_s",
    "peak_mem_gb",
    "marker_echo_count",  # generated responses that contain the injection marker
    "mismatch_masked_frac",  # rollouts masked by mismatch_threshold
)
"""The flat keys every step record holds, in this order."""

LOGGER_NAMES: tuple[str, ...] = ("console", "jsonl", "wandb", "tensorboard")
"""The `logger=` choices of every command; the TrainConfig/SFTConfig Literals list the same names."""

EVAL_KEYS: tuple[str, ...] = (
    "eval/reward_mean", "eval/mse_mean", "eval/fve", "eval/fve_meannorm", "eval/extraction_rate",
    # The reference's names: the mean reward of the scored rows, mse_mean again, and 100 * fve.
    "eval/reward_mean_valid", "eval/mse_mean_valid", "eval/fve_pct",
)
"""Keys of the held-out eval, present only on eval steps; the console prints them as a second line."""


@runtime_checkable
class Logger(Protocol):
    """A metric sink."""

    def log(self, step: int, record: Mapping[str, Scalar]) -> None:
        """Record one step's metrics."""
        ...

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Scalar]]) -> None:
        """Record rows of a table (e.g. eval samples with their explanations)."""
        ...

    def close(self) -> None:
        """Flush and release the sink."""
        ...


def flat_record(step: int, record: Mapping[str, Any]) -> dict[str, Scalar]:
    """`record` with every METRIC_KEY present (NaN when missing) and values as plain scalars.

    Numbers of other types (numpy scalars, 0-d tensors) become floats; a nested value is a
    TypeError, because every sink needs a flat record.
    """
    if "step" in record and record["step"] != step:
        raise ValueError(f"record says step {record['step']!r} but was logged at step {step}")
    out: dict[str, Scalar] = dict.fromkeys(METRIC_KEYS, math.nan)
    for key, value in record.items():
        out[key] = _scalar(key, value)
    out["step"] = step
    return out


def _scalar(key: str, value: Any) -> Scalar:
    if value is None or isinstance(value, (int, float, str)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"metric {key!r} must be a number, string or None, got {type(value).__name__}"
        ) from None


def _json_value(value: Scalar) -> Scalar:
    # JSON has no NaN or infinity; null means "no value this step".
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class NullLogger:
    """Discards everything; the default where no logger is given."""

    def log(self, step: int, record: Mapping[str, Scalar]) -> None:
        pass

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Scalar]]) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleLogger:
    """One line per step in the reference's format, plus an eval line on eval steps."""

    _TABLE_ROWS_SHOWN = 3
    _CELL_CHARS = 200

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream

    def _print(self, line: str) -> None:
        # Resolved at print time so pytest's capture (and redirection) is honoured; tqdm.write keeps
        # the line clear of a progress bar on the terminal.
        from tqdm.auto import tqdm

        stream = self._stream or sys.stdout
        tqdm.write(line, file=stream)
        stream.flush()

    def log(self, step: int, record: Mapping[str, Scalar]) -> None:
        self._print(format_step_line(step, record))
        if any(k in record for k in EVAL_KEYS):
            self._print(format_eval_line(step, record))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Scalar]]) -> None:
        # A few rows are enough to watch explanations evolve; the JSONL sink keeps them all.
        for row in rows[: self._TABLE_ROWS_SHOWN]:
            cells = " | ".join(
                f"{c}={(format(v, '.4g') if isinstance(v, float) else str(v)).replace(chr(10), ' ')[: self._CELL_CHARS]}"
                for c, v in zip(columns, row)
            )
            self._print(f"  [{name}] {cells}")

    def close(self) -> None:
        pass


def _fmt(value: Scalar, spec: str) -> str:
    """`value` formatted with `spec`; "-" when absent (None), "nan" when not finite."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return "nan"
    return format(value, spec)


def _percent(value: Scalar) -> Scalar:
    return value * 100.0 if isinstance(value, (int, float)) else value


def format_step_line(step: int, record: Mapping[str, Scalar]) -> str:
    """`step 0003 | loss 0.1234 | r -1.234 | mse 0.123 | FVE 12.3% | kl 0.0012 | clip 1.23% | ext 95% | t 1.2s`.

    FVE is shown in percent; a critic loss (`crit`) appears when the record has a finite one.
    """
    critic = record.get("critic_loss")
    crit = (
        f"crit {_fmt(critic, '.4f')} | "
        if isinstance(critic, (int, float)) and math.isfinite(critic)
        else ""
    )
    return (
        f"step {step:04d} | loss {_fmt(record.get('loss'), '.4f')} "
        f"| r {_fmt(record.get('reward_mean'), '.3f')} | mse {_fmt(record.get('mse_mean'), '.3f')} "
        f"| FVE {_fmt(_percent(record.get('fve')), '.1f')}% | {crit}"
        f"kl {_fmt(record.get('kl_mean'), '.4f')} | clip {_fmt(record.get('clip_frac'), '.2%')} "
        f"| ext {_fmt(record.get('extraction_rate'), '.0%')} | t {_fmt(record.get('time_step'), '.1f')}s"
    )


def format_eval_line(step: int, record: Mapping[str, Scalar]) -> str:
    """`  [eval@3] reward -1.234 | mse 0.123 | FVE 12.3% | ext 95%`."""
    return (
        f"  [eval@{step}] reward {_fmt(record.get('eval/reward_mean'), '.3f')} "
        f"| mse {_fmt(record.get('eval/mse_mean'), '.3f')} "
        f"| FVE {_fmt(_percent(record.get('eval/fve')), '.1f')}% "
        f"| ext {_fmt(record.get('eval/extraction_rate'), '.0%')}"
    )


def read_metrics(path: str | Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl (a line torn by a crash is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class JsonlLogger:
    """One flat JSON object per step in `path`; table rows in a sibling `samples.jsonl`.

    Lines are flushed as written, so a crashed run keeps every step it logged. A run that
    starts at `start_step` (0, or the step a resume continues from) first drops the lines
    it is about to write again, so an interrupted-then-resumed run leaves the same file
    as an uninterrupted one.
    """

    def __init__(self, path: str | os.PathLike[str], *, start_step: int = 0) -> None:
        self.path = Path(path)
        self.samples_path = self.path.with_name("samples.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for p in (self.path, self.samples_path):
            _drop_lines_from_step(p, start_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._samples: IO[str] | None = None  # opened on the first table

    def log(self, step: int, record: Mapping[str, Scalar]) -> None:
        flat = {k: _json_value(v) for k, v in flat_record(step, record).items()}
        self._file.write(json.dumps(flat, allow_nan=False, ensure_ascii=False) + "\n")
        self._file.flush()

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Scalar]]) -> None:
        if self._samples is None:
            self._samples = self.samples_path.open("a", encoding="utf-8")
        for row in rows:
            if len(row) != len(columns):
                raise ValueError(f"table {name!r}: row has {len(row)} cells for {len(columns)} columns")
            obj = {"table": name, **{c: _json_value(_scalar(c, v)) for c, v in zip(columns, row)}}
            self._samples.write(json.dumps(obj, allow_nan=False, ensure_ascii=False) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._file.close()
        if self._samples is not None:
            self._samples.close()


def _drop_lines_from_step(path: Path, start_step: int) -> None:
    """Keep only the lines of `path` whose "step" is below `start_step` (lines without one stay)."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
        if not isinstance(step, int) or step < start_step:
            kept.append(line)
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)


class WandbLogger:
    """Weights & Biases; offline unless WANDB_API_KEY is set (or WANDB_MODE says otherwise).

    The run id is kept in `save_dir/wandb_run_id`, so a resumed run continues the same
    wandb run. Table rows accumulate and the whole table is re-logged, as in the reference.
    Raises ImportError when wandb is not installed.
    """

    def __init__(
        self, *, save_dir: str | os.PathLike[str], config_dict: Mapping[str, Any],
        project: str, run_name: str | None,
    ) -> None:
        import wandb  # optional extra: nla[wandb]

        self._wandb = wandb
        save_dir = Path(save_dir)
        id_file = save_dir / "wandb_run_id"
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            # Our own id (wandb.util.generate_id is gone from wandb 0.31): 8 of wandb's [a-z0-9] characters.
            run_id = uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
        mode = None
        if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
            mode = "offline"
        self._run = wandb.init(
            project=project, name=run_name, config=dict(config_dict), dir=str(save_dir),
            id=run_id, resume="allow", mode=mode,
        )
        self._step = 0
        self._tables: dict[str, list[list[Scalar]]] = {}

    def log(self, step: int, record: Mapping[str, Scalar]) -> None:
        self._step = step
        self._run.log(flat_record(step, record), step=step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Scalar]]) -> None:
        data = self._tables.setdefault(name, [])
        data.extend(list(row) for row in rows)
        self._run.log({name: self._wandb.Table(columns=list(columns), data=data)}, step=self._step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardLogger:
    """TensorBoard event files in `save_dir/tensorboard` (torch's SummaryWriter), one scalar per key.

    A run that starts at `start_step` (a resume) purges the events it is about to write
    again, like the JSONL sink. Tables become markdown text at their step.
    """

    def __init__(self, save_dir: str | os.PathLike[str], *, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = Path(save_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=start_step or None)
        self._step = start_step

    def log(self, step: int, record: Mapping[str, Scalar]) -> None:
        self._step = step
        for key, value in flat_record(step, record).items():
            if key != "step" and isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Scalar]]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |" for row in rows]
        self._writer.add_text(name, "\n".join(lines), global_step=self._step)

    def close(self) -> None:
        self._writer.close()


class MultiLogger:
    """Fans every call out to several loggers."""

    def __init__(self, loggers: Iterable[Logger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, record: Mapping[str, Scalar]) -> None:
        for logger in self.loggers:
            logger.log(step, record)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Scalar]]) -> None:
        for logger in self.loggers:
            logger.log_table(name, columns, rows)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _missing_sink(name: str, install: str) -> None:
    print(f"[logging] warning: logger '{name}' requested but {name} is not installed ({install}); "
          "continuing without it", file=sys.stderr, flush=True)


def make_logger(
    names: Iterable[str],
    *,
    save_dir: str | os.PathLike[str],
    config_dict: Mapping[str, Any],
    project: str = "nla",
    run_name: str | None = None,
    start_step: int = 0,
) -> MultiLogger:
    """The loggers named (any of LOGGER_NAMES), always including save_dir/metrics.jsonl.

    A requested wandb or tensorboard that is not installed prints one warning line and is skipped.
    `start_step` is the step this run starts at (see JsonlLogger).
    """
    loggers: list[Logger] = [JsonlLogger(Path(save_dir) / "metrics.jsonl", start_step=start_step)]
    for name in dict.fromkeys(names):  # ordered de-duplication
        if name == "jsonl":
            continue
        if name == "console":
            loggers.append(ConsoleLogger())
        elif name == "wandb":
            try:
                loggers.append(WandbLogger(
                    save_dir=save_dir, config_dict=config_dict, project=project, run_name=run_name,
                ))
            except ImportError:
                _missing_sink("wandb", "pip install 'nla[wandb]'")
        elif name == "tensorboard":
            try:
                loggers.append(TensorBoardLogger(save_dir, start_step=start_step))
            except ImportError:
                _missing_sink("tensorboard", "pip install tensorboard")
        else:
            raise ValueError(f"unknown logger {name!r}; choose from {', '.join(LOGGER_NAMES)}")
    return MultiLogger(loggers)
