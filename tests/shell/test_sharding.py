"""`sharding=fsdp2` on CPU (gloo): one rank and two ranks train like the unsharded process, resume exactly,
and the settings it cannot serve are refused in one line before anything is written.

The 2-rank runs are torchrun jobs with test_distributed's per-request seeded engine (its samples
depend only on the request), run through that file's script entry point.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from nla_shell import cli
from nla_shell.training import distributed
from nla_shell.training import setup as trainer_setup

sys.path.insert(0, str(Path(__file__).parent))
import test_distributed as dp  # noqa: E402  (the 2-rank harness and its seeded engine)

RANKS = str(Path(dp.__file__))


def _fresh_lora(av: str, path: Path) -> Path:
    """An adapter with a non-zero LoRA B, so lora_A gets a gradient from the first step."""
    from nla_shell.models import load_actor

    torch.manual_seed(1)
    actor = load_actor(av, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None, dtype=torch.float32,
                       device=torch.device("cpu"))
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    actor.save_pretrained(path)
    return path


def _assert_checkpoints_close(a: Path, b: Path, steps: list[str]) -> None:
    for step in steps:
        for part in ("adapter", "critic"):
            left, right = dp._tensors(a / step / part), dp._tensors(b / step / part)
            assert left.keys() == right.keys() and left
            for name in right:
                torch.testing.assert_close(left[name], right[name], rtol=1e-4, atol=1e-2 * dp.CRITIC_LR,
                                           msg=f"{step} {part} {name}")
        for name in ("actor", "critic"):
            left, right = _moments(a / step, name), _moments(b / step, name)
            assert len(left) == len(right) > 0
            for index, (mine, theirs) in enumerate(zip(left, right)):
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-7,
                                               msg=f"{step} {name} optimizer {index} {key}")


def _moments(checkpoint: Path, name: str) -> list[dict[str, torch.Tensor]]:
    """The `name` optimiser's moments per parameter, in its order: from training_state.pt, or from a sharding=fsdp2
    checkpoint's DCP shards (converted to one file: its parameters are named, the unsharded state's numbered)."""
    shards = checkpoint / "optimizer_shards"
    if not shards.is_dir():
        state = torch.load(checkpoint / "training_state.pt", weights_only=True)["optimizer_states"][name]["state"]
        return [state[index] for index in sorted(state)]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = checkpoint.parent / f"{checkpoint.name}_{name}_moments.pt"
    if not whole.exists():
        dcp_to_torch_save(shards, whole)
    saved = torch.load(whole, weights_only=False)[name]
    return [saved["state"][fqn] for group in saved["param_groups"] for fqn in group["params"]]


@pytest.fixture
def common(nla_run_inputs, tmp_path):
    av, _, _ = nla_run_inputs
    return dict(num_steps=2, save_every=1, batch_prompts=4, eval_every=0, aggregation="token_mean",
                resume_from_lora=_fresh_lora(av, tmp_path / "init"))


@pytest.mark.parametrize("extra", [{}, {"gradient_checkpointing": "true"}], ids=["plain", "checkpointing"])
def test_one_rank_of_fsdp2_gives_the_unsharded_runs_numbers(nla_run_inputs, tmp_path, common, monkeypatch, extra):
    """In one process (a process group of one): the same metrics, adapter, critic and saved Adam moments."""
    plain, sharded = tmp_path / "plain", tmp_path / "fsdp2"
    monkeypatch.setattr(trainer_setup, "make_engine", dp.seeded_make_engine)
    assert cli.main(["train", *dp._settings(nla_run_inputs, plain, **common, **extra)]) == 0
    assert cli.main(["train", *dp._settings(nla_run_inputs, sharded, sharding="fsdp2", **common, **extra)]) == 0
    assert not torch.distributed.is_initialized()
    dp._assert_metrics_close(dp._metrics(sharded), dp._metrics(plain))
    assert all(line["grad_norm"] > 0 for line in dp._metrics(plain))
    _assert_checkpoints_close(sharded, plain, ["step_000001", "step_000002"])


@pytest.mark.parametrize("extra", [{}, {"gradient_checkpointing": "true"}], ids=["plain", "checkpointing"])
def test_two_fsdp2_ranks_train_like_one_process(nla_run_inputs, tmp_path, common, monkeypatch, extra):
    """Per-step loss, grad norm, reward and every metric; the saved adapter, critic and Adam moments."""
    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setattr(trainer_setup, "make_engine", dp.seeded_make_engine)
    assert cli.main(["train", *dp._settings(nla_run_inputs, one, **common, **extra)]) == 0
    out = dp._run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", RANKS,
                       "train", *dp._settings(nla_run_inputs, two, sharding="fsdp2", **common, **extra)])
    assert "[sharding] fsdp2: the actor's 3 decoder blocks (base and LoRA) and the critic's 2 sharded over 2 rank(s)" in out, out[-3000:]
    dp._assert_metrics_close(dp._metrics(two), dp._metrics(one))
    _assert_checkpoints_close(two, one, ["step_000001", "step_000002"])


def test_a_killed_two_rank_fsdp2_run_resumes_exactly(nla_run_inputs, tmp_path):
    """The finished run's directory without its last checkpoint is what a kill -9 after saving step 2 leaves;
    rerunning the command (real per-rank sampling, co-trained critic) reproduces step 2 exactly."""
    whole, split = tmp_path / "whole", tmp_path / "split"

    def command(save_dir: Path) -> list[str]:
        settings = dp._settings(nla_run_inputs, save_dir, num_steps=3, save_every=2, eval_every=2, eval_n_prompts=3,
                                sharding="fsdp2")
        return [sys.executable, "-m", "nla_shell.cli", "train", "--nproc", "2", *settings]

    dp._run_job(command(whole))
    shutil.copytree(whole, split)
    shutil.rmtree(split / "step_000003")
    out = dp._run_job(command(split))
    assert "[resume]" in out and "at step 2" in out
    assert dp._metrics(whole) == dp._metrics(split)
    assert [line["step"] for line in dp._metrics(split)] == [0, 1, 2] and "eval/fve" in dp._metrics(split)[2]
    assert (whole / "samples.jsonl").read_text() == (split / "samples.jsonl").read_text()
    for name, value in dp._tensors(whole / "step_000003" / "adapter").items():
        assert torch.equal(value, dp._tensors(split / "step_000003" / "adapter")[name]), name


def test_a_ddp_run_resumes_under_fsdp2_and_an_fsdp2_checkpoint_refuses_ddp(nla_run_inputs, tmp_path, common, monkeypatch,
                                                                            capsys):
    """sharding may change on resume one way: a ddp checkpoint's whole moments are cut into shards and the run goes
    on as the uninterrupted ddp run; an fsdp2 checkpoint's sharded moments refuse ddp in one line."""
    whole, switched = tmp_path / "whole", tmp_path / "switched"
    monkeypatch.setattr(trainer_setup, "make_engine", dp.seeded_make_engine)
    settings = {**common, "num_steps": 3}
    assert cli.main(["train", *dp._settings(nla_run_inputs, whole, **settings)]) == 0
    shutil.copytree(whole, switched)
    shutil.rmtree(switched / "step_000003")
    assert cli.main(["train", *dp._settings(nla_run_inputs, switched, sharding="fsdp2", **settings)]) == 0
    dp._assert_metrics_close(dp._metrics(switched), dp._metrics(whole))
    assert (switched / "step_000003" / "optimizer_shards").is_dir()
    capsys.readouterr()
    assert cli.main(["train", *dp._settings(nla_run_inputs, switched, **{**settings, "num_steps": 4})]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "saved under sharding=fsdp2" in err and "resume with sharding=fsdp2" in err, err
    assert not (switched / "step_000004").exists()


def test_shards_left_by_a_run_killed_mid_save_are_removed_at_the_next_start(tmp_path):
    from nla_shell.training import checkpoint as ckpt

    staged = ckpt.shards_dir(tmp_path, 2)
    (staged / "optimizer").mkdir(parents=True)
    (staged / "optimizer" / "__0_0.distcp").write_bytes(b"half")
    kept = ckpt.checkpoint_dir(tmp_path, 1)
    kept.mkdir()
    ckpt.remove_stale_entries(tmp_path)
    assert not staged.exists() and kept.is_dir() and staged.name == ".shards_step_000002"


def test_sharded_units_on_two_ranks_give_the_whole_models_results(nla_run_inputs, tmp_path):
    """On 2 gloo ranks (one torchrun job, `_check_units`): the engine push of an FSDP2-sharded actor gives on every
    rank the same buckets, names and bit-identical LoRA-merged tensors as the push of the actor unsharded, each
    bucket one block gathered; and the sharded critic, with all of the inputs on rank 0 and none on rank 1,
    predicts and steps as the whole critic does in one process (the idle rank keeps the forwards in lockstep)."""
    av, ar, _ = nla_run_inputs
    dp._run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                 "units", str(_fresh_lora(av, tmp_path / "init")), av, ar, str(tmp_path)])
    for rank in (0, 1):
        buckets = (tmp_path / f"push_{rank}.txt").read_text().split()
        assert buckets == ["other", "layers.0", "layers.1", "layers.2"], buckets


@pytest.mark.parametrize("ranks, keys, named", [
    (1, ["engine=native"], ["engine=native"]),
    (1, ["ar_ckpt=QUANTISED_AR"], ["ar_ckpt=QUANTISED_AR (an AR-LoRA trained on a 4bit backbone"]),
    (1, ["quant=4bit", "compile_blocks=true"], ["quant=4bit", "compile_blocks=true"]),
    (2, ["critic_ema=0.9", "dynamic_sampling=true"], ["critic_ema=0.9", "dynamic_sampling=true"]),
])
def test_what_fsdp2_cannot_serve_is_refused_in_one_line_and_nothing_is_written(
        nla_run_inputs, tmp_path, monkeypatch, capsys, ranks, keys, named):
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    save_dir = tmp_path / "run"
    quantised_ar = tmp_path / "ar_lora"  # what an AR-LoRA trained on a 4-bit backbone records
    quantised_ar.mkdir()
    (quantised_ar / "ar_meta.json").write_text(json.dumps({"quant": "4bit"}))
    keys = [key.replace("QUANTISED_AR", str(quantised_ar)) for key in keys]
    named = [key.replace("QUANTISED_AR", str(quantised_ar)) for key in named]
    assert cli.main(["train", *dp._settings(nla_run_inputs, save_dir, batch_prompts=4), "sharding=fsdp2",
                     *keys]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'sharding' = 'fsdp2'" in err and "sharding=ddp" in err, err
    assert all(key in err for key in named), err
    assert not save_dir.exists() and not distributed.active()


def _check_units(adapter: str, av: str, ar_dir: str, out: str) -> None:
    """A rank of the units test: the streamed push, then the critic in lockstep; any disagreement fails the job."""
    torch.distributed.init_process_group("gloo")
    _check_streamed_push(adapter, av, out)
    _check_critic_lockstep(ar_dir)
    torch.distributed.destroy_process_group()


def _check_critic_lockstep(ar_dir: str) -> None:
    """Rank 0 scores and steps on three AR inputs, rank 1 on none: the predictions and the stepped weights are the
    whole critic's in one process on the three."""
    import copy

    from nla_shell.models import ARModel
    from nla_shell.training import sharding
    from nla_shell.training.scoring import ar_predictions, critic_step

    torch.manual_seed(0)
    inputs = [[5, 6, 7], None, [8, 9], [10, 11, 12, 13]]
    golds = torch.randn(3, 64)
    critic = ARModel.from_pretrained(ar_dir, mse_scale=None)
    whole = copy.deepcopy(critic)
    start = {n: p.detach().clone() for n, p in critic.named_parameters()}
    expected = ar_predictions(whole, inputs, pad_id=0, micro_batch=2)
    expected_loss, expected_norm = critic_step(whole, torch.optim.SGD(whole.parameters(), lr=0.5),
                                               [i for i in inputs if i], golds, pad_id=0, micro_batch=2,
                                               max_grad_norm=1e9)
    sharding.shard_critic(critic)
    # Made before any forward, as the trainer does: FSDP2 leaves the root's parameters gathered after a no-grad one.
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.5)
    mine = inputs if torch.distributed.get_rank() == 0 else [None] * 3
    predicted = ar_predictions(critic, mine, pad_id=0, micro_batch=2)
    pairs = [i for i in mine if i]
    loss, norm = critic_step(critic, optimizer, pairs, golds[: len(pairs)], pad_id=0, micro_batch=2,
                             max_grad_norm=1e9)
    if torch.distributed.get_rank() == 0:
        torch.testing.assert_close(predicted, expected, equal_nan=True)
    assert torch.isnan(predicted).all() or torch.distributed.get_rank() == 0
    assert math.isclose(norm, expected_norm, rel_tol=1e-5) and math.isclose(loss, expected_loss, rel_tol=1e-5)
    for (name, p), reference in zip(critic.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.full_tensor() if hasattr(p, "full_tensor") else p, reference, msg=name)
        assert name in ("lm.lm_head.weight", "_final_norm.weight") or not torch.equal(reference, start[name]), name


def _check_streamed_push(adapter: str, av: str, out: str) -> None:
    """The merged buckets of the actor whole, then sharded; every tensor must agree."""
    from nla_shell.engines.weight_sync import iter_merged_weight_buckets, merged_weight_buckets
    from nla_shell.models import load_actor
    from nla_shell.models.common import sharded_over_ranks
    from nla_shell.training import sharding

    actor = load_actor(av, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=adapter, dtype=torch.float32,
                       device=torch.device("cpu"))
    whole = merged_weight_buckets(actor)
    sharding.shard_actor(actor)
    assert sharded_over_ranks(actor)
    streamed = iter_merged_weight_buckets(actor)
    for (bucket, pairs), (expected_bucket, expected) in zip(streamed, whole, strict=True):
        assert bucket == expected_bucket and [n for n, _ in pairs] == [n for n, _ in expected], bucket
        for (name, tensor), (_, reference) in zip(pairs, expected):
            assert type(tensor) is torch.Tensor and torch.equal(tensor, reference), name
    rank = torch.distributed.get_rank()
    Path(out, f"push_{rank}.txt").write_text(" ".join(bucket for bucket, _ in whole))


if __name__ == "__main__":
    torch.set_num_threads(1)
    _check_units(*sys.argv[2:6])
