"""Crash-proof runs through `nla train` / `nla sft`: signals, damaged checkpoints, reruns, locks, keep_last.

Each test is a failure a kill/preemption soak found (issue 14), replayed on the tiny
hub-free models: the command must say one line and exit with the right code, and the
rerun's metrics and weights must equal those of the run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fixtures
from nla_shell import cli
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.config import config_to_dict
from nla_shell.pipeline import datagen as datagen_module
from nla_shell.pipeline import sft as sft_module
from nla_shell.training import checkpoint as ckpt
from nla_shell.training.runlock import LOCK_NAME

TIMING_KEYS = {"time_rollout", "time_score", "time_update", "time_critic", "time_sync", "time_step",
               "tokens_per_s", "peak_mem_gb"}


CRASH_RUN = dict(num_steps=4, group_size=2, max_new_tokens=8, train_critic="true", critic_lr=1e-3,
                 critic_micro_batch=2, eval_n_prompts=2, save_every=1)
"""A 4-step run with the critic co-trained, a checkpoint per step and eval at steps 0 and 2."""


def _train_args(inputs, save_dir: Path, **overrides) -> list[str]:
    return fixtures.train_argv(inputs, save_dir, **{**CRASH_RUN, **overrides})


def _metrics(save_dir: Path) -> list[dict]:
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in fixtures.read_metrics(save_dir)]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in sorted(path.glob("*.safetensors")) for name, t in load_file(str(file)).items()}


def _assert_same_weights(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta), f"{a} and {b} differ"


def _mtimes(directory: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in directory.rglob("*")}


def _contents(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


def _signal_during_training_rollouts(monkeypatch, *, call: int, signals: list[int]) -> None:
    """Send `signals` to this process from inside the `call`-th training rollout (1-based), i.e. mid-step."""
    original = HFRolloutEngine.generate
    calls = []

    def generate(self, requests, *, group_size, max_new_tokens, **kwargs):
        if group_size > 1:  # eval rollouts use one sample per prompt
            calls.append(None)
            if len(calls) == call:
                for sig in signals:
                    os.kill(os.getpid(), sig)
        return original(self, requests, group_size=group_size, max_new_tokens=max_new_tokens, **kwargs)

    monkeypatch.setattr(HFRolloutEngine, "generate", generate)


@pytest.fixture(scope="module")
def whole(nla_run_inputs, tmp_path_factory) -> Path:
    """A finished 4-step run (critic co-trained, a checkpoint per step, eval at steps 0 and 2). Read-only."""
    save_dir = tmp_path_factory.mktemp("crashproof") / "whole"
    assert cli.main(_train_args(nla_run_inputs, save_dir)) == 0
    return save_dir


# --------------------------------------------------------------------------- preemption


def test_sigterm_mid_step_saves_and_the_rerun_equals_the_uninterrupted_run(whole, nla_run_inputs, tmp_path,
                                                                            monkeypatch, capsys):
    save_dir = tmp_path / "run"
    _signal_during_training_rollouts(monkeypatch, call=2, signals=[signal.SIGTERM])  # inside step 1
    assert cli.main(_train_args(nla_run_inputs, save_dir, save_every=3)) == 143
    assert _one_line_error(capsys) == (
        f"nla train: stopped at step 2; rerun the same command to resume from {save_dir / 'step_000002'}"
    )
    # Step 1 was finished, not cut short, and saved although save_every=3 would not have saved it.
    assert [p.name for p in ckpt.complete_checkpoints(save_dir)] == ["step_000002"]
    assert [line["step"] for line in _metrics(save_dir)] == [0, 1]
    assert json.loads((save_dir / "summary.json").read_text())["steps_done"] == 2
    assert not (save_dir / LOCK_NAME).exists()
    monkeypatch.undo()

    # The rerun (with keep_last, a key a resume may change) continues exactly.
    assert cli.main(_train_args(nla_run_inputs, save_dir, save_every=3, keep_last=1)) == 0
    assert _metrics(save_dir) == _metrics(whole)
    for part in ("adapter", "critic"):
        _assert_same_weights(save_dir / "step_000004" / part, whole / "step_000004" / part)
    # keep_last=1 keeps the newest, plus step_000003: the only other one scored by a held-out eval (step 2's).
    assert sorted(p.name for p in save_dir.glob("step_*")) == ["step_000003", "step_000004"]
    manifest = json.loads((save_dir / "step_000003" / ckpt.MANIFEST_NAME).read_text())
    assert manifest["metrics"]["eval/fve"] == _metrics(whole)[2]["eval/fve"]


def test_ctrl_c_stops_sft_at_a_step_and_a_second_one_abandons_the_step(tiny_av_dir, toy_datasets, tmp_path,
                                                                       monkeypatch, capsys):
    def argv(save_dir: Path) -> list[str]:
        cfg = fixtures.sft_config("ar", tiny_av_dir, toy_datasets, save_dir, num_steps=4, save_every=3,
                                  batch_size=3, micro_batch=2)
        return ["sft", *(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in config_to_dict(cfg).items()
                         if v is not None)]

    original = sft_module.critic_step

    def signal_at(call: int, signals: list[int]) -> None:
        calls = []

        def critic_step(*args, **kwargs):
            calls.append(None)
            if len(calls) == call:
                for sig in signals:
                    os.kill(os.getpid(), sig)
            return original(*args, **kwargs)

        monkeypatch.setattr(sft_module, "critic_step", critic_step)

    uninterrupted, run = tmp_path / "uninterrupted", tmp_path / "run"
    assert cli.main(argv(uninterrupted)) == 0
    capsys.readouterr()

    signal_at(2, [signal.SIGINT])  # inside step 1: finish it, save step_000002
    assert cli.main(argv(run)) == 130
    assert _one_line_error(capsys) == (
        f"nla sft: interrupted at step 2; rerun the same command to resume from {run / 'step_000002'}"
    )
    signal_at(1, [signal.SIGINT, signal.SIGINT])  # the rerun's first step (step 2), abandoned at once
    assert cli.main(argv(run)) == 130
    assert _one_line_error(capsys) == (
        f"nla sft: interrupted at step 2; rerun the same command to resume from {run / 'step_000002'}"
    )
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step_000002"]
    assert not any(p.name.startswith(".tmp_") for p in run.iterdir())
    monkeypatch.undo()

    assert cli.main(argv(run)) == 0
    assert _metrics(run) == _metrics(uninterrupted)
    weights = "value_head.safetensors"
    a, b = load_file(str(run / "step_000004" / weights)), load_file(str(uninterrupted / "step_000004" / weights))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- damaged checkpoints


def test_a_bit_flip_in_the_newest_checkpoint_falls_back_and_the_rerun_still_matches(whole, nla_run_inputs, tmp_path,
                                                                                    capsys):
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    weights = next((run / "step_000004" / "critic").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # same size: only the hash can tell
    weights.write_bytes(bytes(data))
    assert cli.main(_train_args(nla_run_inputs, run)) == 0
    err = capsys.readouterr().err
    assert f"[warn] checkpoint {run / 'step_000004'} (critic/{weights.name} does not match its sha256" in err
    assert "resuming from step_000003" in err
    assert _metrics(run) == _metrics(whole)
    assert ckpt.checkpoint_problem(run / "step_000004") is None
    _assert_same_weights(run / "step_000004" / "critic", whole / "step_000004" / "critic")


def test_a_checkpoint_without_the_critic_that_train_critic_needs_is_refused(whole, nla_run_inputs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    newest = run / "step_000004"
    shutil.rmtree(newest / "critic")  # and from the manifest: a checkpoint saved without one
    manifest = json.loads((newest / ckpt.MANIFEST_NAME).read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("critic/")}
    (newest / ckpt.MANIFEST_NAME).write_text(json.dumps(manifest))
    before = _contents(run)
    assert cli.main(_train_args(nla_run_inputs, run)) == 2
    line = _one_line_error(capsys)
    assert f"checkpoint {newest} has no critic, which this config needs" in line
    after = _contents(run)
    # Only the claim's config.yaml is rewritten (this copy's save_dir, a key a resume may change).
    assert after.pop(run / "config.yaml") != before.pop(run / "config.yaml") and after == before


# --------------------------------------------------------------------------- reruns, locks, I/O errors


def test_a_rerun_with_nothing_left_to_do_keeps_the_summary_and_cleans_stale_dirs(whole, nla_run_inputs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    expected = json.loads((whole / "summary.json").read_text())
    assert expected["steps_done"] == 4 and expected["checkpoint"] == "step_000004"
    assert expected["final"] == json.loads((whole / "metrics.jsonl").read_text().splitlines()[-1])
    assert expected["final_eval"]["step"] == 3  # step 3 is no eval step: the run scored its final weights after it
    (run / "summary.json").unlink()  # killed between the last save and the summary
    (run / ".tmp_step_000005").mkdir()  # and an earlier run killed mid-save
    shutil.copytree(run / "step_000001", run / ".old_step_000001")
    assert cli.main(_train_args(nla_run_inputs, run)) == 0
    # Everything comes back from metrics.jsonl and the checkpoints; only the extra final eval needs a step run.
    assert json.loads((run / "summary.json").read_text()) == {k: v for k, v in expected.items() if k != "final_eval"}
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []
    shutil.copy(whole / "summary.json", run / "summary.json")
    assert cli.main(_train_args(nla_run_inputs, run)) == 0  # a plain no-op rerun keeps all of it
    assert json.loads((run / "summary.json").read_text()) == expected


def test_a_second_run_on_a_locked_save_dir_is_refused_and_writes_nothing(whole, nla_run_inputs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    holder = fixtures.hold_run_dir_lock(run)
    try:
        before = _mtimes(run)
        assert cli.main(_train_args(nla_run_inputs, run, num_steps=5)) == 2
        line = _one_line_error(capsys)
        assert f"is in use by another nla run (pid {holder.pid} on " in line and "since" in line
        assert _mtimes(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_disk_full_checkpoint_is_one_line_and_leaves_nothing_torn(nla_run_inputs, tmp_path, monkeypatch, capsys):
    original = ckpt.save_training_state

    def onto_a_full_disk(directory, **kwargs):
        (Path(directory) / ckpt.TRAINING_STATE_NAME).symlink_to("/dev/full")  # writes fail with ENOSPC
        return original(directory, **kwargs)

    monkeypatch.setattr(ckpt, "save_training_state", onto_a_full_disk)
    run = tmp_path / "run"
    assert cli.main(_train_args(nla_run_inputs, run, num_steps=1, eval_every=0)) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"nla train: error: cannot save checkpoint {run / 'step_000001'}: No space left on device")
    assert not list(run.glob("*step_*")) and not (run / LOCK_NAME).exists()


def test_a_rollout_out_of_gpu_memory_is_one_line_naming_the_phase_and_the_checkpoint(nla_run_inputs, tmp_path,
                                                                                       monkeypatch, capsys):
    # What vLLM's sleep-mode allocator raised when a 14B step's KV cache would not wake (bench/RESULTS.md, run AA).
    original, calls = HFRolloutEngine.generate, []

    def generate(self, requests, *, group_size, max_new_tokens, **kwargs):
        if group_size > 1:
            calls.append(None)
            if len(calls) == 2:
                raise RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163")
        return original(self, requests, group_size=group_size, max_new_tokens=max_new_tokens, **kwargs)

    monkeypatch.setattr(HFRolloutEngine, "generate", generate)
    run = tmp_path / "run"
    assert cli.main(_train_args(nla_run_inputs, run, num_steps=3, eval_every=0)) == 2
    line = _one_line_error(capsys)
    assert line.startswith("nla train: error: the GPU ran out of memory in the rollout phase of step 1: lower "
                           "vllm_gpu_mem or vllm_max_seqs"), line
    assert line.endswith(f"rerun to resume from {run / 'step_000001'}"), line
    assert (run / "step_000001").is_dir() and not (run / "step_000002").exists() and not (run / LOCK_NAME).exists()


def test_an_update_out_of_gpu_memory_names_its_micro_batch_keys(nla_run_inputs, tmp_path, monkeypatch, capsys):
    from nla_shell.training import step as step_module

    def too_large(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(step_module, "policy_update", too_large)
    assert cli.main(_train_args(nla_run_inputs, tmp_path / "run", num_steps=1, eval_every=0)) == 2
    line = _one_line_error(capsys)
    assert "in the update phase of step 0: lower logp_micro_batch and ref_micro_batch" in line
    assert line.endswith("no checkpoint yet"), line


def test_other_runtime_errors_are_not_taken_for_out_of_memory(nla_run_inputs, tmp_path, monkeypatch):
    from nla_shell.training import step as step_module

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(step_module, "policy_update", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.main(_train_args(nla_run_inputs, tmp_path / "run", num_steps=1, eval_every=0))


# --------------------------------------------------------------------------- seeding


class _Seen(Exception):
    """Stops a command right after the global RNGs were drawn from."""


def _draw_and_stop(draws: list, *args, **kwargs):
    draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
    raise _Seen


def _fresh_draws(seed: int) -> tuple[float, float, float]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_sft_and_datagen_seed_python_numpy_and_torch_as_documented(tiny_av_dir, toy_datasets, tmp_path, monkeypatch):
    draws: list = []
    hook = lambda *a, **k: _draw_and_stop(draws, *a, **k)  # noqa: E731
    monkeypatch.setattr(sft_module, "load_actor", hook)  # the first thing drawn from: the LoRA init
    monkeypatch.setattr(datagen_module, "resolve_device", hook)
    for seed in (3, 4):
        random.seed(99), np.random.seed(99), torch.manual_seed(99)  # whatever state the caller left
        with pytest.raises(_Seen):
            sft_module.sft(fixtures.sft_config("av", tiny_av_dir, toy_datasets, tmp_path / f"sft{seed}", seed=seed))
        with pytest.raises(_Seen):
            datagen_module.datagen(fixtures.datagen_config(tiny_av_dir, toy_datasets / "corpus.jsonl",
                                                           tmp_path / f"data{seed}", seed=seed))
    assert draws == [_fresh_draws(3)] * 2 + [_fresh_draws(4)] * 2
