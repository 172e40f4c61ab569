"""logger=wandb (offline) and logger=tensorboard for real: two steps, a resume, the files read back."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from nla_shell.io.logging import METRIC_KEYS, make_logger


def _record(step: int) -> dict[str, float]:
    return {"loss": 0.5 + step, "fve": 0.1 * step, "eval/fve": 0.2 * step}


def _run_two_steps_and_resume(save_dir: Path, names: tuple[str, ...]) -> None:
    """Steps 0, 1; then a resume from step 1 (as after a crash past step 1's log) logs 1, 2 again."""
    for start, steps in ((0, (0, 1)), (1, (1, 2))):
        logger = make_logger(names, save_dir=save_dir, config_dict={"lr": 1e-3}, start_step=start)
        for step in steps:
            logger.log(step, {**_record(step), "loss": 0.5 + step + (10.0 if start == 0 and step == 1 else 0.0)})
        logger.log_table("eval_samples", ["step", "explanation"], [[steps[-1], "a cat"]])
        logger.close()


def _wandb_history(path: Path) -> list[dict]:
    """History rows of a wandb transaction log (`run-ID.wandb`).

    The file is a LevelDB-style log, as wandb's datastore writes it: a 7-byte header
    (":W&B", magic 0xBEE1, version), then 32 KiB blocks of chunks (crc32, length, type
    FULL/FIRST/MIDDLE/LAST); the chunks of one record are a `wandb_internal_pb2.Record`.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, pending, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zero padding, or a chunk still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _jsonl_keys(save_dir: Path) -> set[str]:
    lines = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    return set().union(*lines)


def test_wandb_offline_logs_every_metric_key_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    save_dir = tmp_path / "run"
    _run_two_steps_and_resume(save_dir, ("wandb",))
    run_id = (save_dir / "wandb_run_id").read_text().strip()
    # Two runs in one second get "...-ID" and "...-ID-1".
    logs = sorted((save_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(logs) == 2, "the resume continues the same run id, offline"
    # wandb's core process may still be writing the log after finish() returns: wait for it.
    deadline = time.monotonic() + 60
    while True:
        rows = [row for log in logs for row in _wandb_history(log)]
        if {row.get("_step") for row in rows} >= {0, 1, 2} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    by_step = {}
    for row in rows:
        by_step.setdefault(row["_step"], []).append(row)
    assert sorted(by_step) == [0, 1, 2], [(log.name, _wandb_history(log)) for log in logs]
    keys = {k for row in rows for k in row if not k.startswith(("_", "eval_samples"))}
    assert any(k.startswith("eval_samples/") for row in rows for k in row), "the samples table is logged"
    assert keys == _jsonl_keys(save_dir), keys ^ _jsonl_keys(save_dir)  # the same keys in every sink
    assert set(METRIC_KEYS) <= keys and "eval/fve" in keys
    assert by_step[2][-1]["loss"] == 2.5 and by_step[1][-1]["loss"] == 1.5  # the resumed run's values
    assert math.isclose(by_step[1][-1]["fve"], 0.1)


def test_tensorboard_event_files_hold_every_metric_key_and_a_resume_replaces_its_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save_dir = tmp_path / "run"
    _run_two_steps_and_resume(save_dir, ("tensorboard",))
    events = EventAccumulator(str(save_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags | {"step"} == _jsonl_keys(save_dir)  # the same keys in every sink ("step" is the x axis)
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == [0.5, 1.5, 2.5], "the resumed run's step 1 replaced the first run's"
    assert [e.step for e in events.Scalars("eval/fve")] == [0, 1, 2]
    assert events.Tags()["tensors"], "the samples table is logged as text"
