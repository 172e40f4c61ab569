"""A researcher's first real run (issue #15): help, flags, paths, messages, progress, cleanup."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import time
from pathlib import Path

import pytest

import fixtures
from nla_shell import cli
from nla_shell.training.config import TrainConfig
from nla_shell.io import progress
from nla_shell.io.progress import ProgressLines, progress_bar
from nla_shell.pipeline.evaluate import markdown_table

REPO = Path(__file__).resolve().parents[2]


def _fails_in_one_line(capsys, argv, *needles) -> str:
    """Exit code 2 and exactly one stderr line holding every needle."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# --------------------------------------------------------------------------- help and flags


def test_train_help_lists_every_key_with_its_default_and_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in out, f.name
    assert "--num-steps NUM_STEPS, --num_steps NUM_STEPS Number of optimizer steps" in out
    assert "[default: 100]" in out and "[default: 30000]" not in out
    assert "[choices: hf, vllm, native]" in out
    assert "[choices: console, jsonl, wandb, tensorboard]" in out
    assert "--av-ckpt AV_CKPT, --av_ckpt AV_CKPT Activation-verbaliser" in out and "[required]" in out


def test_other_commands_show_defaults_and_choices(capsys):
    with pytest.raises(SystemExit):
        cli.main(["datagen", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[choices: api, local, jsonl, rule, context, none]" in out and "[default: null]" in out
    assert "--no-progress turns it off" in out


def test_train_takes_key_value_flags_like_every_command():
    argv = ["train", "--num-steps", "3", "--av-ckpt", "a", "--ar_ckpt", "b", "--rl-parquet", "r.parquet",
            "--save-dir", "s", "--train-critic", "--logger", "jsonl,tensorboard", "eval_every=0"]
    parser, _ = cli.build_parser(argv)
    cfg = cli._load_config(TrainConfig, parser.parse_args(argv))
    assert (cfg.num_steps, cfg.av_ckpt, cfg.ar_ckpt, cfg.train_critic, cfg.eval_every) == (3, "a", "b", True, 0)
    assert cfg.logger == ("jsonl", "tensorboard")


def test_boolean_flags_can_be_turned_off():
    from nla_shell.pipeline.datagen_config import DatagenConfig

    argv = ["datagen", "--model", "m", "--corpus", "c.jsonl", "--layer", "1", "--out-dir", "o", "--explainer", "rule",
            "--no-progress"]
    parser, _ = cli.build_parser(argv)
    assert cli._load_config(DatagenConfig, parser.parse_args(argv)).progress is False
    parser, _ = cli.build_parser(argv[:-1])
    assert cli._load_config(DatagenConfig, parser.parse_args(argv[:-1])).progress is True


def test_a_flag_typo_gets_did_you_mean(capsys):
    _fails_in_one_line(capsys, ["train", "--num-stpes", "3"], "unknown flag --num-stpes", "did you mean --num-steps?")
    _fails_in_one_line(capsys, ["sft", "--mdoe", "av"], "did you mean --mode?")


def test_a_command_or_choice_typo_gets_did_you_mean(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _fails_in_one_line(capsys, ["trian"], "unknown command 'trian'; did you mean 'train'?", "choose from train,")
    assert "invalid choice" not in err
    _fails_in_one_line(capsys, ["corpus", "shakspeare", "x.jsonl"], "did you mean 'shakespeare'?")
    _fails_in_one_line(capsys, ["convert", "a", "b", "--dtype", "float16"], "unknown --dtype 'float16'")
    err = _fails_in_one_line(capsys, ["xyzzy"], "unknown command 'xyzzy' (choose from")
    assert "did you mean" not in err
    assert not any(tmp_path.iterdir())


def test_a_truncated_flag_is_refused_not_taken_for_the_whole_one(capsys):
    """argparse would read --num-step as --num-steps (and --max as ambiguous, listing every option twice)."""
    _fails_in_one_line(capsys, ["train", "--num-step", "3"], "unknown flag --num-step;", "did you mean --num-steps?")
    err = _fails_in_one_line(capsys, ["train", "--max", "3"], "unknown flag --max;")
    assert "ambiguous" not in err and err.count("--max") == 2, err  # the flag and one suggestion
    # The suggestion is the dashed form the README uses, even for an underscore typo.
    _fails_in_one_line(capsys, ["datagen", "--outdir", "x"], "did you mean --out-dir?")
    _fails_in_one_line(capsys, ["datagen", "--out_dri", "x"], "did you mean --out-dir?")


def test_nla_alone_lists_the_commands_and_version_prints_it(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "datagen", "sft", "eval", "explain", "demo", "plot")), out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == "nla 0.1.0"


def test_explainer_none_is_a_choice_not_null(tmp_path):
    """datagen's own error recommends explainer=none: every spelling of it must reach the config as "none"."""
    from nla_shell.io.config import load_config
    from nla_shell.pipeline.datagen_config import DatagenConfig

    base = ["model=m", "corpus=c.jsonl", "layer=1", "out_dir=o", "av_sft_fraction=0", "ar_sft_fraction=0",
            "eval_fraction=0"]
    assert load_config(None, [*base, "explainer=none"], cls=DatagenConfig).explainer == "none"
    argv = ["datagen", "--explainer", "none", *base]
    parser, _ = cli.build_parser(argv)
    assert cli._load_config(DatagenConfig, parser.parse_args(argv)).explainer == "none"
    (tmp_path / "d.yaml").write_text("explainer: none\n")
    assert load_config(tmp_path / "d.yaml", base, cls=DatagenConfig).explainer == "none"
    assert load_config(None, [*base, "explainer=null", "write_sites=s.jsonl"], cls=DatagenConfig).explainer is None


def test_datagen_with_explainer_none_writes_the_rl_split(tiny_av_dir, tmp_path):
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=4)
    out = tmp_path / "data"
    assert cli.main(["datagen", "--model", str(tiny_av_dir), "--corpus", str(corpus), "--layer", "1", "--out-dir",
                     str(out), "--explainer", "none", "--av-sft-fraction", "0", "--ar-sft-fraction", "0",
                     "--eval-fraction", "0", "device=cpu", "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".parquet") == ["rl.parquet"]


# --------------------------------------------------------------------------- local paths


def test_a_mistyped_local_checkpoint_fails_at_once_naming_the_closest(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "av" / "step_000010").mkdir(parents=True)
    (tmp_path / "ar").mkdir()
    for model_dir in ("av/step_000010", "ar"):
        (tmp_path / model_dir / "config.json").write_text("{}")
    (tmp_path / "rl.parquet").write_bytes(b"")
    start = time.perf_counter()
    _fails_in_one_line(
        capsys, ["train", "av_ckpt=av/step_999", "ar_ckpt=ar", "rl_parquet=rl.parquet", "save_dir=run"],
        "'av_ckpt' = 'av/step_999': no such directory", "did you mean 'av/step_000010'?",
    )
    assert time.perf_counter() - start < 5, "no hub retries"
    _fails_in_one_line(
        capsys, ["datagen", "--model", "nomodel", "--corpus", "c.jsonl", "--layer", "1", "--out-dir", "data",
                 "--explainer", "rule"],
        "'model' = 'nomodel': no such directory",
    )
    _fails_in_one_line(
        capsys, ["train", "av_ckpt=av/step_000010", "ar_ckpt=ar", "rl_parquet=nope.parquet", "save_dir=run"],
        "'rl_parquet' = 'nope.parquet': no such file",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar", "av", "rl.parquet"]


def test_a_run_dir_passed_as_a_checkpoint_names_its_newest_checkpoint(toy_sft, toy_datasets, tmp_path, capsys):
    av, ar = toy_sft
    _fails_in_one_line(
        capsys, ["train", f"av_ckpt={av.parent}", f"ar_ckpt={ar}", f"rl_parquet={toy_datasets / 'rl.parquet'}",
                 f"save_dir={tmp_path / 'run'}"],
        "is an nla run directory, not a checkpoint", str(av),
    )
    assert not (tmp_path / "run").exists()


def test_a_path_shaped_like_a_hub_id_fails_at_once_when_the_hub_cannot_be_asked(tmp_path, capsys, monkeypatch):
    """`--model models/qwen3-tiny` with no models/ dir: offline (or with no hub answering) it is a typo, said in
    one line at once, not ten "Retrying in Ns" lines."""
    monkeypatch.chdir(tmp_path)
    argv = ["datagen", "--model", "models/qwen3-tiny", "--corpus", "c.jsonl", "--layer", "1", "--out-dir", "data",
            "--explainer", "rule"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    _fails_in_one_line(capsys, argv, "'model' = 'models/qwen3-tiny': no such directory",
                       "model hub is offline (HF_HUB_OFFLINE is set)")
    assert time.perf_counter() - start < 5
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers
    for name in ("TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)  # (a proxy would be trusted to reach the hub)
    _fails_in_one_line(capsys, argv, "no such directory", "model hub is unreachable (127.0.0.1:9 does not answer)")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_without_a_model_says_so(tmp_path, capsys):
    """Not "You need to have sentencepiece or tiktoken installed" or "Should have a `model_type` key"."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not a model")
    _fails_in_one_line(
        capsys, ["datagen", "--model", str(tmp_path / "notes"), "--corpus", "c.jsonl", "--layer", "1", "--out-dir",
                 str(tmp_path / "data"), "--explainer", "rule"],
        f"'model' = '{tmp_path / 'notes'}' is not a model directory (no config.json",
    )
    assert not (tmp_path / "data").exists()


def test_hub_ids_are_not_mistaken_for_local_paths(tmp_path, monkeypatch):
    from nla_shell.io.paths import looks_like_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "av").mkdir()
    assert looks_like_hub_id("Qwen/Qwen3-8B")
    assert not looks_like_hub_id("av/step_999")  # av/ is a local directory
    assert not looks_like_hub_id("nomodel") and not looks_like_hub_id("./lm") and not looks_like_hub_id("/abs/lm")


# --------------------------------------------------------------------------- messages that point the right way


def test_an_av_passed_as_ar_says_what_it_is(toy_sft, toy_datasets, tmp_path, capsys):
    av, _ = toy_sft
    _fails_in_one_line(
        capsys, ["eval", "--ar", str(av), "--parquet", str(toy_datasets / "eval.parquet"), "--out-dir",
                 str(tmp_path / "e"), "device=cpu"],
        "it is an AV adapter", "nla sft --mode ar",
    )
    assert not (tmp_path / "e").exists()


def test_an_sft_parquet_without_activations_names_the_key_and_datagen(toy_datasets, tiny_av_dir, tmp_path, capsys):
    import pyarrow.parquet as pq

    bad = tmp_path / "av_sft.parquet"
    pq.write_table(pq.read_table(toy_datasets / "av_sft.parquet").drop_columns(["activation_vector"]), bad)
    shutil.copy(toy_datasets / "av_sft.parquet.nla_meta.yaml", str(bad) + ".nla_meta.yaml")
    err = _fails_in_one_line(
        capsys, ["sft", "--mode", "av", "--model", str(tiny_av_dir), "--parquet", str(bad), "--save-dir",
                 str(tmp_path / "av"), "device=cpu"],
        "parquet:", "no column 'activation_vector'", "written by nla datagen",
    )
    assert "RL parquet" not in err
    assert not (tmp_path / "av").exists()


def test_train_in_an_sft_run_dir_says_it_is_another_commands_run(toy_sft, toy_datasets, tmp_path, capsys):
    av, ar = toy_sft
    sft_run = tmp_path / "sft_run"
    shutil.copytree(av.parent, sft_run)
    err = _fails_in_one_line(
        capsys, ["train", f"av_ckpt={av}", f"ar_ckpt={ar}", f"rl_parquet={toy_datasets / 'rl.parquet'}",
                 f"save_dir={sft_run}", "device=cpu", "batch_prompts=2"],
        "holds a run of another nla command",
    )
    assert len(err) < 400, "a sentence, not a 40-field diff"


def test_an_empty_split_hint_names_real_keys(tiny_av_dir, tmp_path, capsys):
    from nla_shell.pipeline.datagen_config import DatagenConfig

    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl", n_docs=1)
    out = tmp_path / "data"
    err = _fails_in_one_line(
        capsys, ["datagen", "--model", str(tiny_av_dir), "--corpus", str(corpus), "--layer", "1", "--out-dir",
                 str(out), "--explainer", "rule", "eval_fraction=0.05", "device=cpu", "--no-progress"],
        "received no rows",
    )
    named = [w.split("=")[0] for w in err.replace(",", " ").split() if w.endswith("=0")]
    assert named and all(k in {f.name for f in dataclasses.fields(DatagenConfig)} for k in named), err
    # 11: a failed run leaves neither its temp dir nor the out_dir it made.
    assert not out.exists()


# --------------------------------------------------------------------------- train: eval_parquet, windows, summary


def test_train_on_datagen_output_with_eval_parquet(toy_sft, toy_datasets, tmp_path, capsys):
    """The README's train command on a small dataset: no row window to set, held-out rows from eval.parquet."""
    av, ar = toy_sft
    save_dir = tmp_path / "rl"
    argv = ["train", "--av-ckpt", str(av), "--ar-ckpt", str(ar), "--rl-parquet", str(toy_datasets / "rl.parquet"),
            "--eval-parquet", str(toy_datasets / "eval.parquet"), "--save-dir", str(save_dir), "--num-steps", "2",
            "--batch-prompts", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-every", "1",
            "--eval-n-prompts", "2", "--lora-r", "4", "--device", "cpu", "--logger", "jsonl"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"from {toy_datasets / 'eval.parquet'}" in out
    eval_docs = {json.loads(line)["doc_id"] for line in (save_dir / "samples.jsonl").read_text().splitlines()}
    import pyarrow.parquet as pq

    assert eval_docs <= set(pq.read_table(toy_datasets / "eval.parquet").column("doc_id").to_pylist())
    summary = json.loads((save_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["final"]["step"] == 1
    assert (save_dir / summary["checkpoint"] / "adapter").is_dir()
    assert f"done: 2 steps; checkpoint {save_dir / summary['checkpoint']}" in out and f"nla plot {save_dir}" in out


def test_rerunning_a_finished_run_with_fewer_steps_is_refused(nla_run_inputs, tmp_path, capsys):
    """It would say "[resume] from step_000002", run nothing, name a step_000001 that does not exist and rewrite
    config.yaml to num_steps 1: refused instead, with nothing written."""
    save_dir = tmp_path / "run"
    assert cli.main(fixtures.train_argv(nla_run_inputs, save_dir, num_steps=2, eval_every=0)) == 0
    assert "done: 2 steps;" in capsys.readouterr().out
    before = {p: p.read_bytes() for p in save_dir.rglob("*") if p.is_file() and p.suffix != ".lock"}
    _fails_in_one_line(capsys, fixtures.train_argv(nla_run_inputs, save_dir, num_steps=1, eval_every=0),
                       "'num_steps' = 1 is invalid", "already holds step_000002 (2 steps done)", "num_steps >= 2")
    assert {p: p.read_bytes() for p in save_dir.rglob("*") if p.is_file() and p.suffix != ".lock"} == before
    assert cli.main(fixtures.train_argv(nla_run_inputs, save_dir, num_steps=3, eval_every=0, save_every=1)) == 0
    assert "done: 3 steps;" in capsys.readouterr().out


# --------------------------------------------------------------------------- progress, .gitignore, the eval table


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_step_total_rate_and_eta_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert isinstance(progress_bar(total=10, desc="train", unit="step"), ProgressLines), "CI logs get lines, no bar"
    assert progress_bar(total=10, desc="train", unit="step", lines=False).disable, "a command's own lines suffice"
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert progress_bar(total=10, desc="train", unit="step", enabled=False).disable, "file-only loggers get no bar"
    bar = progress_bar(total=10, initial=2, desc="train", unit="step")
    bar.update(3)
    bar.refresh()
    shown = terminal.getvalue().split("\r")[-1]
    assert "train" in shown and "5/10" in shown and "step/s" in shown and "<" in shown, shown  # "<" precedes the ETA
    bar.close()


def test_off_a_terminal_datagen_and_eval_print_progress_lines(tmp_path, tiny_av_dir, toy_datasets, toy_sft,
                                                              monkeypatch, capsys):
    """In a log (CI, nohup) a long stage says where it is, in plain lines: no silent stretch, no \\r redraws."""
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # a line at every update
    corpus = fixtures.write_toy_corpus(tmp_path / "c.jsonl")
    assert cli.main(["datagen", "--model", str(tiny_av_dir), "--corpus", str(corpus), "--layer", "1", "--out-dir",
                     str(tmp_path / "data"), "--explainer", "rule", "device=cpu"]) == 0
    captured = capsys.readouterr()
    assert "[datagen] 24/24 doc (100%), " in captured.out and " doc/s, ETA 0m00s" in captured.out, captured.out
    assert "\r" not in captured.err + captured.out
    av, ar = toy_sft
    assert cli.main(["eval", "--av", str(av), "--ar", str(ar), "--parquet", str(toy_datasets / "eval.parquet"),
                     "--out-dir", str(tmp_path / "e"), "--n-rows", "4", "--micro-batch", "2", "device=cpu"]) == 0
    captured = capsys.readouterr()
    assert "[eval: AV] 2/4 row (50%), " in captured.out and "[eval: AV] 4/4 row (100%), " in captured.out, captured.out
    assert "\r" not in captured.err + captured.out


def test_the_eta_in_a_log_follows_the_runs_average_not_its_last_burst(monkeypatch, capsys):
    """datagen counts documents as they are read, then processes them as a batch: bursts of updates, then
    silence. The ETA of each line stays within 25 % of the time really left (tqdm's smoothed rate swings)."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    lines = ProgressLines(total=100, desc="datagen", unit="doc", initial=0, every_s=5.0)
    for batch in range(10):  # 10 documents read at once, then 10 s of work on them
        now[0] = 10.0 * batch
        for _ in range(10):
            lines.update()
        now[0] += 10.0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 9 and out[0].startswith("[datagen] 11/100 doc (11%), 1.1 doc/s, ETA "), out
    for line, left in zip(out, range(90, 0, -10)):
        minutes, seconds = line.split("ETA ")[1].rstrip("s").split("m")
        assert 0.75 * left <= 60 * int(minutes) + int(seconds) <= 1.25 * left, (line, left)


def test_the_gguf_loaders_own_bar_draws_only_on_a_terminal(monkeypatch):
    """transformers' GGUF loader draws a tqdm bar past its progress switch; `nla convert` keeps it off a log."""
    from transformers import modeling_gguf_pytorch_utils as loader

    from nla_shell.io.progress import terminal_only_bars

    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    with terminal_only_bars(loader):
        list(loader.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."))
    assert log.getvalue() == ""
    list(loader.tqdm(range(50), desc="outside"))  # the loader's bar as it is, restored after the block
    assert "\r" in log.getvalue()
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with terminal_only_bars(loader):
        list(loader.tqdm(range(50), desc="Converting"))
    assert "50/50" in terminal.getvalue()


def test_train_under_a_file_only_logger_still_shows_its_bar_on_a_terminal(nla_run_inputs, tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert cli.main(fixtures.train_argv(nla_run_inputs, tmp_path / "run", num_steps=1, eval_every=0,
                                        logger="jsonl")) == 0
    assert "train: 100%" in terminal.getvalue() and "1/1" in terminal.getvalue()


def test_the_demo_lm_stage_shows_a_bar_on_a_terminal(tiny_tokenizer, monkeypatch):
    from nla_shell.pipeline.demo import train_lm
    from nla_shell.toy.builders import build_tiny_qwen3

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    model = build_tiny_qwen3(tiny_tokenizer, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                             intermediate_size=32, seed=0)
    train_lm(model, tiny_tokenizer, ["a cat sat", "a dog ran"], steps=3, batch=2, lr=1e-3, seed=0)
    assert "target LM" in terminal.getvalue() and "3/3" in terminal.getvalue()


def test_a_bar_left_open_by_an_error_is_closed_before_the_last_line(monkeypatch):
    """Else the garbage collector closes it after the CLI's message, redrawing the bar under that line."""
    from nla_shell.pipeline import plot

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)

    def failing(run_dir, out):
        bar = progress_bar(total=4, desc="work", unit="step")
        bar.update(2)
        raise ValueError("boom")

    monkeypatch.setattr(plot, "plot_run", failing)
    assert cli.main(["plot", "somewhere"]) == 2
    shown = terminal.getvalue()
    assert shown.endswith("nla plot: error: boom\n") and "work:  50%" in shown, shown


def test_demo_run_dir_is_ignored_by_git():
    assert "nla_demo/" in (REPO / ".gitignore").read_text().splitlines()


def test_eval_table_never_shows_a_broken_character():
    # "café" cut inside the two bytes of "é" decodes to "caf\ufffd".
    table = markdown_table([{"context": "x" * 50 + " caf\ufffd", "explanation": "a drink"}], context_chars=10)
    assert "\ufffd" not in table and "…" in table and "caf |" in table
    table.encode("utf-8")
