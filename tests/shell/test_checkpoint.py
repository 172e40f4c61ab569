"""Checkpoints: atomic verified saves, fallback past damage, pruning, RNG round trips, exact-resume state,
run-dir claims and locks."""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest
import torch
import yaml

import fixtures
from nla_shell.training.checkpoint import (
    CheckpointError,
    checkpoint_problem,
    latest_checkpoint,
    latest_verified_checkpoint,
    load_training_state,
    prune_checkpoints,
    remove_stale_entries,
    restore_optimizer,
    rng_state,
    save_checkpoint,
    save_training_state,
    set_rng_state,
)
from nla_shell.training.run_identity import claim_save_dir
from nla_shell.training.runlock import LOCK_NAME, RunDirBusy, RunDirLock
from nla_shell.training.runtime import seed_everything
from nla_shell.io.config import ConfigError, config_to_dict
from nla_shell.training.config import TrainConfig


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

    with pytest.raises(CheckpointError, match="step_000002: RuntimeError: disk full"):
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
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "MANIFEST.json", "new"]
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


# --------------------------------------------------------------------------- manifests and verification


def weights_and_state(path):
    (path / "adapter").mkdir()
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path / "adapter" / "weights.pt")
    save_training_state(path, step=1, data_cursor={"epoch": 0, "offset": 2}, optimizer_states={}, rng=rng_state())


def test_manifest_records_every_file_size_and_sha256(tmp_path):
    path = save_checkpoint(tmp_path, 1, write=weights_and_state, metrics={"eval/fve": 0.5})
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert sorted(manifest["files"]) == ["adapter/weights.pt", "training_state.pt"]
    import hashlib

    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["metrics"] == {"eval/fve": 0.5} and checkpoint_problem(path) is None


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_one_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: truncate(p / "adapter" / "weights.pt"), "adapter/weights.pt has"),
        (lambda p: flip_one_bit(p / "training_state.pt"), "training_state.pt does not match its sha256"),
        (lambda p: (p / "adapter" / "weights.pt").unlink(), "adapter/weights.pt is missing"),
        (lambda p: (p / "training_state.pt").write_bytes(b""), "training_state.pt has 0 bytes"),
    ],
    ids=["truncated", "bit_flip", "deleted", "emptied"],
)
def test_a_damaged_newest_checkpoint_is_named_and_skipped_for_the_previous_one(tmp_path, capsys, damage, expected):
    first = save_checkpoint(tmp_path, 1, write=weights_and_state)
    second = save_checkpoint(tmp_path, 2, write=weights_and_state)
    damage(second)
    assert latest_checkpoint(tmp_path) == second  # still marked COMPLETE: only the manifest tells
    assert expected in checkpoint_problem(second)
    assert latest_verified_checkpoint(tmp_path) == first
    warning = capsys.readouterr().err
    assert str(second) in warning and expected in warning and "resuming from step_000001" in warning


def test_no_verified_checkpoint_at_all_is_an_error_naming_each(tmp_path):
    assert latest_verified_checkpoint(tmp_path) is None  # nothing saved yet: a fresh start
    only = save_checkpoint(tmp_path, 1, write=weights_and_state)
    flip_one_bit(only / "adapter" / "weights.pt")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* passes verification: .*step_000001 \(adapter"):
        latest_verified_checkpoint(tmp_path)


def test_a_part_the_config_needs_but_the_checkpoint_never_had_is_an_error(tmp_path):
    save_checkpoint(tmp_path, 1, write=weights_and_state)  # verified, but holds no critic/
    with pytest.raises(CheckpointError, match=r"step_000001 has no critic, which this config needs"):
        latest_verified_checkpoint(tmp_path, required=("adapter", "critic"))


def test_a_corrupt_training_state_fails_with_its_path_not_a_library_error(tmp_path):
    path = save_checkpoint(tmp_path, 1, write=weights_and_state)
    truncate(path / "training_state.pt")
    with pytest.raises(CheckpointError, match=f"cannot load {path / 'training_state.pt'}"):
        load_training_state(path)


def test_a_disk_full_save_names_the_checkpoint_and_leaves_the_earlier_ones_intact(tmp_path):
    first = save_checkpoint(tmp_path, 1, write=weights_and_state)

    def onto_a_full_disk(path):
        (path / "training_state.pt").symlink_to("/dev/full")  # every write there fails with ENOSPC
        weights_and_state(path)

    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 2, write=onto_a_full_disk)
    assert f"cannot save checkpoint {tmp_path / 'step_000002'}: No space left on device (" in str(err.value)
    assert "\n" not in str(err.value) and "earlier checkpoints are intact" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert latest_verified_checkpoint(tmp_path) == first


def test_stale_entries_are_removed_and_a_checkpoint_moved_aside_comes_back(tmp_path):
    kept = save_checkpoint(tmp_path, 1, write=weights_and_state)
    moved = save_checkpoint(tmp_path, 2, write=weights_and_state)
    os.replace(moved, tmp_path / ".old_step_000002")  # a re-save killed between its two renames
    for stale in (".tmp_step_000003", ".old_step_000001", ".deleting_step_000000"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "COMPLETE").write_text("")
    remove_stale_entries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]
    assert checkpoint_problem(moved) is None and checkpoint_problem(kept) is None


def test_pruning_keeps_the_newest_and_the_best_scored(tmp_path):
    scores = {1: 0.2, 2: 0.9, 3: None, 4: 0.5, 5: float("nan")}
    for step, score in scores.items():
        save_checkpoint(tmp_path, step, write=write_files("w"), metrics={} if score is None else {"eval/fve": score})
    assert json.loads((tmp_path / "step_000005" / "MANIFEST.json").read_text())["metrics"] == {}  # NaN: no score
    deleted = prune_checkpoints(tmp_path, keep_last=2, best_by="eval/fve")
    assert sorted(p.name for p in deleted) == ["step_000001", "step_000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004", "step_000005"]
    flip_one_bit(tmp_path / "step_000005" / "w")
    with pytest.raises(CheckpointError, match="step_000005 fails verification right after saving"):
        prune_checkpoints(tmp_path, keep_last=1)
    assert len(list(tmp_path.iterdir())) == 3


def test_seed_everything_seeds_python_numpy_and_torch():
    seed_everything(11)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(1)
    seed_everything(11)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


# --------------------------------------------------------------------------- the run-dir lock

def test_a_second_process_is_refused_with_the_holders_pid_until_it_dies(tmp_path):
    save_dir = tmp_path / "run"
    holder = fixtures.hold_run_dir_lock(save_dir)
    try:
        with pytest.raises(RunDirBusy) as err:
            with RunDirLock(save_dir):
                pass
        message = str(err.value)
        assert f"pid {holder.pid} on " in message and " since 20" in message and "'save_dir'" in message
        assert "\n" not in message
    finally:
        holder.send_signal(signal.SIGKILL)  # dies without cleaning up: the kernel drops the lock
        holder.wait()
    assert (save_dir / LOCK_NAME).exists()
    with RunDirLock(save_dir):
        assert f"pid {os.getpid()} " in (save_dir / LOCK_NAME).read_text()
    assert not (save_dir / LOCK_NAME).exists()


def test_a_lock_on_a_new_dir_leaves_nothing_when_the_run_writes_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with RunDirLock(tmp_path / "a" / "run"):
            raise RuntimeError("bad input")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == []
    with RunDirLock(tmp_path / "kept"):
        claim_save_dir(tmp_path / "kept", config(), overwrite=False, resume="auto")
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["config.yaml"]


def test_an_optimizer_state_for_other_parameters_is_refused_naming_the_checkpoint(tmp_path):
    """A critic saved with more trainable tensors (e.g. before its final norm and lm_head were
    frozen) must not fail inside torch with a message that names no file."""
    saved = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2)) for _ in range(3)])
    save_training_state(tmp_path, step=1, data_cursor={"epoch": 0, "offset": 0},
                        optimizer_states={"actor": saved.state_dict(), "critic": saved.state_dict()}, rng={})
    state = load_training_state(tmp_path)
    fits = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2)) for _ in range(3)])
    restore_optimizer(fits, state, "actor", tmp_path)  # the same parameters: loads
    fewer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2)) for _ in range(2)])
    with pytest.raises(CheckpointError) as caught:
        restore_optimizer(fewer, state, "critic", tmp_path)
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path / "training_state.pt") in message
    assert "critic optimizer state" in message and "start a new run from its weights" in message
