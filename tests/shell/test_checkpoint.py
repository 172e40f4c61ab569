"""Checkpoints: atomic saves, RNG round trips, exact-resume state, run-dir claims."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import yaml

from nla_shell.training.checkpoint import (
    claim_save_dir,
    latest_checkpoint,
    load_training_state,
    rng_state,
    save_checkpoint,
    save_training_state,
    set_rng_state,
)
from nla_shell.io.config import ConfigError, TrainConfig, config_to_dict


def write_files(*names):
    def write(path):
        for name in names:
            (path / name).write_text(name)
    return write


def test_save_returns_the_step_dir_marked_complete(tmp_path):
    path = save_checkpoint(tmp_path, 50, write=write_files("adapter.bin"))
    assert path == tmp_path / "step_000050"
    assert (path / "adapter.bin").read_text() == "adapter.bin" and (path / "COMPLETE").is_file()
    assert latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000050"]


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_latest(tmp_path):
    first = save_checkpoint(tmp_path, 1, write=write_files("a"))

    def crash(path):
        (path / "half_written").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, write=crash)
    assert latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert (first / "a").read_text() == "a"


def test_leftovers_of_a_killed_save_are_never_counted(tmp_path):
    first = save_checkpoint(tmp_path, 1, write=write_files("a"))
    (tmp_path / ".tmp_step_000002").mkdir()
    (tmp_path / ".tmp_step_000002" / "COMPLETE").write_text("2")
    (tmp_path / "step_000003").mkdir()  # no COMPLETE: e.g. copied by hand, half-way
    assert latest_checkpoint(tmp_path) == first
    second = save_checkpoint(tmp_path, 2, write=write_files("b"))  # replaces the stale temp dir
    assert latest_checkpoint(tmp_path) == second and not (tmp_path / ".tmp_step_000002").exists()


def test_saving_the_same_step_again_replaces_it_whole(tmp_path):
    save_checkpoint(tmp_path, 4, write=write_files("old"))
    path = save_checkpoint(tmp_path, 4, write=write_files("new"))
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]


def test_latest_checkpoint_orders_by_step_number(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    for step in (9, 1_000_000, 10):
        save_checkpoint(tmp_path, step, write=write_files())
    assert latest_checkpoint(tmp_path).name == "step_1000000"


def draws(generator):
    return (
        random.random(), np.random.rand(3).tolist(), np.random.randn(),
        torch.rand(3).tolist(), torch.rand(3, generator=generator).tolist(),
    )


def test_rng_round_trip_reproduces_the_same_draws(tmp_path):
    generator = torch.Generator().manual_seed(7)
    np.random.randn()  # leaves numpy holding a cached gaussian, which must round-trip too
    state = rng_state({"rollout": generator})
    expected = draws(generator)
    draws(generator)  # move every RNG on
    save_training_state(tmp_path, step=3, data_cursor={"row": 24}, optimizer_states={}, rng=state)
    set_rng_state(load_training_state(tmp_path).rng, {"rollout": generator})
    assert draws(generator) == expected


def test_set_rng_state_refuses_an_unknown_generator():
    with pytest.raises(KeyError, match="'critic'"):
        set_rng_state(rng_state(), {"critic": torch.Generator()})


def test_training_state_round_trip_restores_an_optimizer(tmp_path):
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.tensor([1.0, -1.0])
    opt.step()
    save_training_state(
        tmp_path, step=5, data_cursor={"epoch": 0, "row": 40},
        optimizer_states={"actor": opt.state_dict()}, rng=rng_state(), extra={"skipped_steps": 1},
    )
    state = load_training_state(tmp_path)
    assert (state.step, state.data_cursor, state.extra) == (5, {"epoch": 0, "row": 40}, {"skipped_steps": 1})
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    fresh.load_state_dict(state.optimizer_states["actor"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def config(**changes):
    cfg = TrainConfig(av_ckpt="av", ar_ckpt="ar", rl_parquet="rl.parquet", save_dir="run", **changes)
    return config_to_dict(cfg)


def snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_claim_writes_the_config_into_a_new_dir(tmp_path):
    run = tmp_path / "run"
    claim_save_dir(run, config(), overwrite=False, resume="auto")
    assert yaml.safe_load((run / "config.yaml").read_text()) == config()


def test_claim_lets_the_same_run_resume_with_changed_mutable_keys(tmp_path):
    claim_save_dir(tmp_path, config(), overwrite=False, resume="auto")
    save_checkpoint(tmp_path, 2, write=write_files())
    claim_save_dir(tmp_path, config(num_steps=200, logger=("jsonl",)), overwrite=False, resume="auto")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["num_steps"] == 200
    assert latest_checkpoint(tmp_path) is not None


def test_claim_refuses_another_run_without_writing(tmp_path):
    claim_save_dir(tmp_path, config(), overwrite=False, resume="auto")
    save_checkpoint(tmp_path, 2, write=write_files("adapter"))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as err:
        claim_save_dir(tmp_path, config(lr=1e-5, seed=1), overwrite=False, resume="auto")
    message = str(err.value)
    assert "'save_dir'" in message and "overwrite=true" in message
    assert "lr: 5e-06 there, 1e-05 now" in message and "seed: 0 there, 1 now" in message
    assert snapshot(tmp_path) == before


def test_claim_refuses_to_restart_a_run_with_resume_never(tmp_path):
    claim_save_dir(tmp_path, config(), overwrite=False, resume="auto")
    claim_save_dir(tmp_path, config(), overwrite=False, resume="never")  # no checkpoint yet: fine
    save_checkpoint(tmp_path, 2, write=write_files())
    with pytest.raises(ConfigError, match="resume=never"):
        claim_save_dir(tmp_path, config(), overwrite=False, resume="never")


def test_overwrite_clears_another_run(tmp_path):
    claim_save_dir(tmp_path, config(), overwrite=False, resume="auto")
    save_checkpoint(tmp_path, 2, write=write_files())
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    claim_save_dir(tmp_path, config(lr=1e-5), overwrite=True, resume="auto")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["lr"] == 1e-5


def test_overwrite_keeps_a_matching_run_that_resume_auto_continues(tmp_path):
    claim_save_dir(tmp_path, config(), overwrite=False, resume="auto")
    save_checkpoint(tmp_path, 2, write=write_files())
    claim_save_dir(tmp_path, config(), overwrite=True, resume="auto")
    assert latest_checkpoint(tmp_path) is not None


def test_claim_never_deletes_a_directory_nla_did_not_make(tmp_path):
    (tmp_path / "thesis.tex").write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="no nla run"):
            claim_save_dir(tmp_path, config(), overwrite=overwrite, resume="auto")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]
