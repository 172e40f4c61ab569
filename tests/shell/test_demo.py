"""`nla demo --tiny`: every stage of the toy NLA runs, in seconds, and the run dir is protected."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest
import torch
import yaml

from nla_shell import cli


@pytest.mark.parametrize("av_flags, av_weights", [
    ([], "adapter_config.json"),
    (["--no-av-lora"], "model.safetensors"),  # the whole AV fine-tuned; RL trains a fresh LoRA on it
])
def test_tiny_demo_runs_every_stage_and_reports(tmp_path, capsys, av_flags, av_weights):
    run_dir = tmp_path / "demo"
    # What a demo that failed or was interrupted midway leaves: the rerun replaces it, no --overwrite needed.
    (run_dir / "target_lm").mkdir(parents=True)
    (run_dir / "demo_config.json").write_text("{}")
    (run_dir / "target_lm" / "stale.txt").write_text("from the failed run")
    assert cli.main(["demo", "--tiny", "--run-dir", str(run_dir), *av_flags]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"[nla demo] replacing {run_dir}: a demo that stopped before its report"
    assert f"run directory: {run_dir}" in out.splitlines()[1]
    assert not (run_dir / "target_lm" / "stale.txt").exists()
    report = json.loads((run_dir / "report.json").read_text())
    env = report["environment"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and env["python"] == platform.python_version()
    assert env["packages"]["torch"] == torch.__version__ and set(env["packages"]) >= {"transformers", "peft", "numpy"}
    assert set(report["fve"]) == {"AR on gold explanations", "AV+AR before SFT (LM zero-shot)", "AV+AR after SFT",
                                  "AV+AR after RL", "AV+AR after SFT, AV given a shuffled vector (control)",
                                  "AV+AR after RL, AV given a shuffled vector (control)"}
    assert set(report["splice_kl"]) == {"AR on gold explanations", "AV+AR after SFT", "AV+AR after RL",
                                        "random vector at the AV+AR's error (after RL)", "dataset mean"}
    # Splice-KL ran after RL (on the rows whose AV explanation scored; the tiny AV may extract none).
    after_rl = json.loads((run_dir / "eval" / "after_rl" / "eval_summary.json").read_text())
    assert after_rl["splice/n_rows"] == 0 or report["splice_kl"]["dataset mean"] > 0
    assert set(report["fve_by_length"]) == {"first 2 tokens", "first 4 tokens", "first 8 tokens", "whole explanation"}
    markdown = (run_dir / "report.md").read_text()
    assert "| dataset mean | " in markdown and "| first 8 tokens | " in markdown
    assert f"torch's kernels {env['cpu_capability']}" in markdown and f"torch {torch.__version__}" in markdown
    assert "shuffled vector (control) |" in markdown
    assert set(report["seconds"]) == {"target LM", "datagen", "AR SFT", "AV SFT", "eval before RL", "RL",
                                      "eval after RL", "plot", "total"}
    assert report["fve"]["AR on gold explanations"] is not None
    assert "# nla demo report" in out and (run_dir / "report.md").read_text() in out
    for path in ("target_lm/config.json", "data/eval.parquet", "ar_sft/step_000002/value_head.safetensors",
                 f"av_sft/step_000002/{av_weights}", "rl/step_000002/adapter/adapter_config.json",
                 "rl/curves.png", "eval/after_rl/eval_table.md", "eval/after_rl/eval_controls.md"):
        assert (run_dir / path).is_file(), path
    # RL's adapter sits on what the AV's SFT left: the target LM under the SFT adapter, or the full SFT'd LM.
    sft_av = json.loads((run_dir / "sft_checkpoints.json").read_text())["av"]
    assert report["checkpoints"]["av"] == sft_av
    rl_base = json.loads((run_dir / "rl/step_000002/adapter/adapter_config.json").read_text())["base_model_name_or_path"]
    expected_base = run_dir / "target_lm" if not av_flags else run_dir / "av_sft" / "step_000002"
    assert Path(rl_base).resolve() == expected_base.resolve()


def test_an_existing_run_dir_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "demo"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    assert cli.main(["demo", "--tiny", "--run-dir", str(run_dir)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["demo", "--tiny", "--run-dir", str(run_dir), "--overwrite"]) == 2
    assert "no demo made" in capsys.readouterr().err
    assert (run_dir / "notes.txt").read_text() == "mine"
    finished = tmp_path / "finished"  # a demo that wrote its report is kept unless --overwrite
    finished.mkdir()
    for name in ("demo_config.json", "report.json"):
        (finished / name).write_text("{}")
    assert cli.main(["demo", "--tiny", "--run-dir", str(finished)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in finished.iterdir()) == ["demo_config.json", "report.json"]


def test_a_failed_demo_leaves_nothing_that_blocks_the_corrected_command(tmp_path, capsys, monkeypatch):
    """`nla demo --model gpt2 --tiny --run-dir dm` fails on the model: one line, and no dm/ to refuse the rerun."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--model", "gpt2", "--tiny", "--run-dir", "dm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nla demo: error: ") and "gpt2" in err, err
    assert not any(tmp_path.iterdir())


def test_the_readme_pipeline_commands_parse():
    import re
    import shlex
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"

    def commands_of(title, page):
        text = (docs / page).read_text()
        section = text[text.index(title) :]
        block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
        return [shlex.split(line.split("  #")[0])[1:] for line in block.splitlines() if line.startswith("nla ")]

    pipeline, upstream_data = commands_of("## The pipeline", "walkthrough.md"), commands_of("## Bring your EasyNLA / kitft data", "formats.md")
    assert [c[0] for c in pipeline] == [
        "convert", "datagen", "datagen", "sft", "sft", "train", "eval", "plot", "explain", "export"
    ]
    assert [c[0] for c in upstream_data] == ["train", "sft", "explain", "export"]
    for argv in pipeline + upstream_data:
        parser, _ = cli.build_parser(argv)
        parser.parse_args(argv)  # exits (SystemExit) on an unknown flag


def _quickstart_commands() -> list[list[str]]:
    """The README quickstart's `nla` commands (both blocks), as argv lists."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Quickstart") : readme.index("## Results")]
    return [shlex.split(part)[1:] for block in re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
            for line in block.splitlines() for part in line.split("  #")[0].split("&&")
            if part.strip().startswith("nla ")]


def test_the_readme_quickstart_commands_parse():
    commands = _quickstart_commands()
    assert [c[0] for c in commands] == ["demo", "demo", "convert", "corpus", "datagen", "sft", "sft", "train", "eval",
                                        "explain", "explain", "serve"]
    for argv in commands:
        parser, _ = cli.build_parser(argv)
        parser.parse_args(argv)


def test_the_quickstart_reads_what_its_earlier_commands_write():
    """The corpus datagen reads is the one `nla corpus` wrote; each step_NNNNNN is its run's --num-steps."""
    commands = {c[0] + (c[2] if c[0] == "sft" else ""): c for c in _quickstart_commands()}

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert flag(commands["datagen"], "--corpus") == commands["corpus"][2]
    steps = {flag(commands[c], "--save-dir"): int(flag(commands[c], "--num-steps")) for c in ("sftar", "sftav", "train")}
    for argv in commands.values():
        for value in argv:
            head = value.split("/")
            if len(head) > 1 and head[1].startswith("step_"):
                assert head[1] == f"step_{steps[head[0]]:06d}", (value, steps)


def test_the_quickstart_and_demo_outputs_are_ignored_by_git():
    """Run from the checkout, the quickstart leaves nothing untracked (docs.jsonl, explained.parquet.parts/...)."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    outputs = []
    for argv in _quickstart_commands():
        named = [argv[i + 1] for i, a in enumerate(argv) if a in ("--out-dir", "--save-dir", "--out", "--run-dir")]
        positional = {"convert": argv[2:3], "corpus": argv[2:3]}.get(argv[0], [])
        outputs += named + positional
    outputs += [p + ".parts/part_000000.parquet" for p in outputs if p.endswith(".parquet")]
    assert {"docs.jsonl", "explained.parquet", "data", "rl", "demo_tiny"} <= set(outputs)
    probes = [o if o.endswith((".jsonl", ".parquet")) else o + "/x" for o in outputs]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *probes], cwd=repo, capture_output=True,
                             text=True).stdout.split()
    assert sorted(set(probes) - set(ignored)) == []


def test_setup_installs_the_pinned_dependency_set():
    """scripts/setup.sh installs through constraints.txt, which pins every dependency of nla and its test extras;
    the packages the demo's numbers depend on are installed at those versions (else rerun scripts/setup.sh)."""
    import importlib.metadata
    import re
    from pathlib import Path

    from nla_shell.pipeline.demo_report import REPORTED_PACKAGES

    repo = Path(__file__).resolve().parents[2]
    installs = [line for line in (repo / "scripts/setup.sh").read_text().splitlines() if "pip install" in line]
    assert len(installs) >= 3 and all("-c constraints.txt" in line for line in installs if "--upgrade pip" not in line)

    def name(requirement: str) -> str:
        return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    pins = dict(line.split("==") for line in (repo / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    pins = {name(k): v for k, v in pins.items()}
    required = {name(r) for r in importlib.metadata.requires("nla") or []
                if "extra ==" not in r or 'extra == "test"' in r}
    assert required and required <= set(pins), sorted(required - set(pins))
    installed = {p: importlib.metadata.version(p).split("+")[0] for p in REPORTED_PACKAGES}
    assert installed == {p: pins[p] for p in REPORTED_PACKAGES}, "this .venv is not the pinned set: bash scripts/setup.sh"


README_TOY_COLUMNS = {
    "AR on gold explanations": "AR on gold explanations",
    "AV+AR after SFT": "AV+AR after SFT",
    "AV+AR after RL": "AV+AR after RL",
    "shuffled-vector control, after RL": "AV+AR after RL, AV given a shuffled vector (control)",
}
"""The README toy table's FVE columns and the demo report's keys they hold."""


def _readme_toy_table() -> dict[str, float]:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = readme[readme.index("The toy NLA, `nla demo`") :].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| "))
    names = [cell.strip() for cell in lines[header].strip("|").split("|")]
    values = [cell.strip() for cell in lines[header + 2].strip("|").split("|")]
    return {name: float(value.replace("−", "-")) for name, value in zip(names, values) if name in README_TOY_COLUMNS}


def test_the_demo_reproduces_the_readme_table(tmp_path, capsys):
    """`nla demo` at seed 0 against the README's toy table, within 0.02, on every machine that runs the tests
    (float-level differences between CPUs moved the earlier, shorter demo by up to 0.05: docs/demo.md)."""
    table = _readme_toy_table()
    assert set(table) == set(README_TOY_COLUMNS), table
    assert cli.main(["demo", "--run-dir", str(tmp_path / "demo")]) == 0
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    measured = {name: report["fve"][key] for name, key in README_TOY_COLUMNS.items()}
    apart = {name: (table[name], round(measured[name], 3)) for name in table if abs(measured[name] - table[name]) > 0.02}
    assert not apart, (f"nla demo (README, measured) differs by more than 0.02: {apart}; environment "
                       f"{report['environment']}")


def test_a_demo_with_a_co_trained_ar_scores_after_rl_with_it(tmp_path, capsys):
    """rl_train_critic=true: RL saves the co-trained AR, and the eval after RL (and the explain command) use it."""
    run_dir = tmp_path / "demo"
    assert cli.main(["demo", "--tiny", "--run-dir", str(run_dir), "rl_train_critic=true"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    critic = run_dir / "rl" / "step_000002" / "critic"
    assert (critic / "value_head.safetensors").is_file()
    assert report["checkpoints"]["ar_after_rl"] == str(critic) and f"--ar {critic} " in report["explain"]
    scored_by = {stage: json.loads((run_dir / "eval" / stage / "eval_summary.json").read_text())["provenance"]["ar"]["path"]
                 for stage in ("after_sft", "after_rl")}
    assert scored_by == {"after_sft": str(Path(report["checkpoints"]["ar"]).resolve()), "after_rl": str(critic.resolve())}


@pytest.mark.parametrize(("flags", "expected"), [
    (["injection_style=embedding_replace", "injection_scale=2.5"], ("embedding_replace", 2.5, None)),
    (["injection_layer=0"], ("residual_add", None, 0)),
])
def test_the_demos_injection_reaches_the_av_and_rl_follows_it(tmp_path, flags, expected):
    """injection_style / injection_scale / injection_layer go to the AV's SFT; RL continues that AV with them (its
    sidecar says so)."""
    run_dir = tmp_path / "dm"
    assert cli.main(["demo", "--tiny", "--run-dir", str(run_dir), *flags]) == 0
    for adapter in (run_dir / "av_sft" / "step_000002", run_dir / "rl" / "step_000002" / "adapter"):
        meta = yaml.safe_load((adapter / "nla_meta.yaml").read_text())
        assert (meta["injection_style"], meta["extraction"]["injection_scale"], meta.get("injection_layer")) == expected
    data = yaml.safe_load((run_dir / "data" / "rl.parquet.nla_meta.yaml").read_text())
    assert data.get("injection_style", "residual_add") == "residual_add"  # the data keep theirs: the AV's differ


def test_greedy_eval_scores_the_avs_after_sft_and_rl_again_by_argmax_on_the_same_rows_and_ars(tmp_path):
    """greedy_eval (on in the real-model presets): the same rows as the evals after SFT and RL, decoded greedily,
    through the same ARs, reported beside the sampled figures with their shares of the gold AR's."""
    run_dir = tmp_path / "demo"
    assert cli.main(["demo", "--tiny", "--run-dir", str(run_dir), "greedy_eval=true"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    for stage, name in (("after_sft", "after SFT"), ("after_rl", "after RL")):
        greedy = json.loads((run_dir / "eval" / f"{stage}_greedy" / "eval_summary.json").read_text())
        sampled = json.loads((run_dir / "eval" / stage / "eval_summary.json").read_text())
        assert greedy["provenance"]["config"]["greedy"] and not sampled["provenance"]["config"]["greedy"]
        assert greedy["n_rows"] == sampled["n_rows"] and greedy["gold/fve"] == sampled["gold/fve"]  # same rows, AR
        assert greedy["provenance"]["av"] == sampled["provenance"]["av"]
        assert greedy["provenance"]["ar"] == sampled["provenance"]["ar"]
        rows = [json.loads(line) for line in (run_dir / "eval" / f"{stage}_greedy" / "eval_samples.jsonl").open()]
        assert [r["context"] for r in rows] == [json.loads(line)["context"] for line in
                                                 (run_dir / "eval" / stage / "eval_samples.jsonl").open()]
        reported = report["fve"][f"AV+AR {name}, greedy decoding"]  # the tiny AV extracts nothing: NaN, null
        assert reported == greedy["av/fve"] or (greedy["av/fve"] is None and math.isnan(reported))
        assert f"{name}, greedy" in report["fraction_of_gold"]
    assert "greedy decoding" in (run_dir / "report.md").read_text()
    plain = tmp_path / "plain"  # off by default (the toy demo's settings)
    assert cli.main(["demo", "--tiny", "--run-dir", str(plain)]) == 0
    assert not (plain / "eval" / "after_sft_greedy").exists()
