"""Loggers: flat JSONL with the same keys every line, console format, wandb degradation."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from nla_shell.io.logging import (
    METRIC_KEYS,
    ConsoleLogger,
    JsonlLogger,
    Logger,
    MultiLogger,
    NullLogger,
    flat_record,
    format_step_line,
    make_logger,
)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_are_flat_with_the_same_keys_and_nan_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JsonlLogger(path)
    logger.log(0, {"loss": 0.5, "reward_mean": -1.0, "kl_mean": 0.01, "fve": 0.2})
    logger.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "eval/fve": 0.3})
    logger.log(2, {})
    logger.close()
    lines = read_jsonl(path)
    assert [line["step"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert list(line)[: len(METRIC_KEYS)] == list(METRIC_KEYS)
        assert all(v is None or isinstance(v, (int, float, str)) for v in line.values())
    assert lines[0]["loss"] == 0.5 and lines[0]["tis_frac"] is None
    assert lines[1]["loss"] is None and lines[1]["grad_norm"] is None
    assert lines[1]["eval/fve"] == 0.3


def test_jsonl_is_readable_line_by_line_before_close(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JsonlLogger(path)
    logger.log(0, {"loss": 1.0})
    assert read_jsonl(path)[0]["loss"] == 1.0
    logger.close()


def test_jsonl_restart_drops_steps_it_will_log_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlLogger(path)
    for step in range(4):
        first.log(step, {"loss": float(step)})
    first.log_table("eval/samples", ["step", "explanation"], [[0, "a"], [3, "b"]])
    first.close()
    with path.open("a") as f:
        f.write('{"step": 4, "lo')  # torn by a crash mid-write
    resumed = JsonlLogger(path, start_step=2)
    resumed.log(2, {"loss": 2.0})
    resumed.close()
    assert [line["step"] for line in read_jsonl(path)] == [0, 1, 2]
    assert [row["explanation"] for row in read_jsonl(tmp_path / "samples.jsonl")] == ["a"]


def test_tables_go_to_a_sibling_samples_file(tmp_path):
    logger = JsonlLogger(tmp_path / "metrics.jsonl")
    logger.log_table("eval/samples", ["step", "reward", "explanation"], [[3, float("nan"), "中文"]])
    logger.close()
    assert read_jsonl(tmp_path / "samples.jsonl") == [
        {"table": "eval/samples", "step": 3, "reward": None, "explanation": "中文"}
    ]


def test_flat_record_rejects_nested_values_and_converts_numbers():
    np = pytest.importorskip("numpy")
    record = flat_record(5, {"loss": np.float32(0.25)})
    assert record["loss"] == 0.25 and type(record["loss"]) is float
    assert math.isnan(record["kl_mean"]) and record["step"] == 5
    with pytest.raises(TypeError, match="'hist'"):
        flat_record(5, {"hist": [1, 2]})


def test_console_line_format():
    record = {
        "loss": 0.12345, "reward_mean": -1.2345, "mse_mean": 0.5, "fve": 0.123,
        "kl_mean": 0.00123, "clip_frac": 0.0123, "extraction_rate": 0.95, "time_step": 1.25,
    }
    assert format_step_line(3, record) == (
        "step 0003 | loss 0.1235 | r -1.234 | mse 0.500 | FVE 12.3% | kl 0.0012 "
        "| clip 1.23% | ext 95% | t 1.2s"
    )
    assert "| crit 0.2500 | kl" in format_step_line(3, {**record, "critic_loss": 0.25})


def test_console_tolerates_missing_keys_and_nan(capsys):
    logger = ConsoleLogger()
    logger.log(7, {"loss": float("nan"), "critic_loss": float("nan")})
    logger.log(8, {"eval/reward_mean": -1.0, "eval/fve": 0.5})
    logger.log_table("eval/samples", ["idx", "explanation"], [[i, "x\ny"] for i in range(5)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "step 0007 | loss nan | r - | mse - | FVE -% | kl - | clip - | ext - | t -s"
    )
    assert out[2] == "  [eval@8] reward -1.000 | mse - | FVE 50.0% | ext -"
    assert out[3:] == [f"  [eval/samples] idx={i} | explanation=x y" for i in range(3)]


def test_console_tables_show_floats_to_four_figures(capsys):
    ConsoleLogger().log_table("eval_samples", ["idx", "reward", "mse"], [[0, -1.2345678901, 0.000123456789]])
    assert capsys.readouterr().out.strip() == "[eval_samples] idx=0 | reward=-1.235 | mse=0.0001235"


def test_missing_wandb_degrades_with_one_warning_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    logger = make_logger(
        ["console", "wandb", "console"], save_dir=tmp_path, config_dict={"lr": 1.0},
        project="nla", run_name=None,
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wandb" in err and "not installed" in err
    assert [type(x).__name__ for x in logger.loggers] == ["JsonlLogger", "ConsoleLogger"]
    logger.log(0, {"loss": 1.0})
    logger.close()
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "wandb_run_id").exists()


def test_wandb_logger_runs_offline_and_keeps_its_run_id(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    fake = types.SimpleNamespace(
        init=init,
        Table=lambda columns, data: ("table", tuple(columns), [list(r) for r in data]),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for _ in range(2):
        logger = make_logger(["wandb"], save_dir=tmp_path, config_dict={"lr": 1.0},
                             project="p", run_name="r")
        logger.log(4, {"loss": 1.0})
        logger.log_table("samples", ["a"], [[1]])
        logger.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    # Our own run id (wandb 0.31 has no wandb.util.generate_id; tests/shell/test_loggers.py runs the real wandb).
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert len(run_id) == 8 and run_id.isalnum()
    assert [(k["mode"], k["id"], k["resume"]) for k in inits] == [("offline", run_id, "allow")] * 2
    logged = [c for c in calls if c[0] == "log"]
    assert logged[0][1] == 4 and set(METRIC_KEYS) <= set(logged[0][2])
    assert logged[1] == ("log", 4, {"samples": ("table", ("a",), [[1]])})


def test_loggers_satisfy_the_protocol(tmp_path):
    for logger in (NullLogger(), ConsoleLogger(), JsonlLogger(tmp_path / "m.jsonl"), MultiLogger([])):
        assert isinstance(logger, Logger)
        logger.close()


def test_make_logger_refuses_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="'mlflow'; choose from console, jsonl, wandb, tensorboard"):
        make_logger(["mlflow"], save_dir=tmp_path, config_dict={})

