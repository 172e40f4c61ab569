"""The README's two commands and the walkthrough (docs/walkthrough.md) stay honest (docs/api.md's loss example:
test_docs_losses.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
DOCS = README.parent / "docs"


def _section(title: str, page: Path) -> str:
    text = page.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_readme_opens_with_the_demo_and_test_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1).splitlines()
    assert first_block[0].startswith("bash scripts/setup.sh && .venv/bin/nla demo")
    assert first_block[1].startswith("bash scripts/setup.sh && .venv/bin/python -m pytest tests -q")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest tests -q" in ci


@pytest.fixture(params=["tiny_qwen3", "smollm2"])
def walkthrough_lm(request) -> Path:
    """The walkthrough's LM: a tiny random Qwen3, and the real SmolLM2 (converted once per session)."""
    return request.getfixturevalue("tiny_av_dir" if request.param == "tiny_qwen3" else "smollm2_dir")


def test_pipeline_walkthrough_runs_as_written(tmp_path, walkthrough_lm, monkeypatch, capsys):
    """The walkthrough's commands, in order, on CPU: on a tiny random Qwen3 (D=64, 3 blocks) and on
    SmolLM2-135M-Instruct, with no injection_char= (datagen finds SmolLM2's marker itself).

    Each `nla` command runs through the CLI as written, with only speed settings appended
    (short rollouts, small batches); the labelling step runs the script as a subprocess. The
    `source` line is the shell's, and `nla convert smollm2` is the session's conversion (the
    `smollm2_dir` fixture runs that same command once). On SmolLM2 the RL step also runs with
    the native engine, from the same checkpoints.
    """
    import os
    import shlex
    import subprocess
    import sys

    from nla_shell import cli

    block = re.search(r"```bash\n(.*?)```", _section("The pipeline: a walkthrough on real text", DOCS / "walkthrough.md"), re.DOTALL).group(1)
    lines = block.strip().splitlines()
    assert lines[:3] == ["source .venv/bin/activate", "nla convert smollm2 smollm2", "LM=smollm2"]
    env = {"LM": str(walkthrough_lm), "CORPUS": str(README.parent / "docs/examples/walkthrough_corpus.jsonl")}
    assert [line.split("=")[0] for line in lines[2:4]] == list(env)  # the test supplies these two
    speed = {
        "sft": ["batch_size=4", "micro_batch=4", "device=cpu"],
        "train": ["max_new_tokens=8", "batch_prompts=2", "group_size=2", "logp_micro_batch=4", "eval_n_prompts=3",
                  "lora_r=8", "device=cpu", "logger=jsonl"],
        "eval": ["max_new_tokens=8", "device=cpu", "n_rows=16"],
        "explain": ["max_new_tokens=8", "device=cpu"],
        "datagen": ["device=cpu", "--no-progress"],
        "plot": [],
        "export": [],
    }
    real = walkthrough_lm.name == "smollm2"
    if real:  # SmolLM2 is 135M parameters: fewer SFT and RL steps on the CPU
        speed["sft"] += ["num_steps=5"]
        speed["train"] += ["num_steps=2", "eval_every=2"]
    monkeypatch.chdir(tmp_path)
    for line in lines[4:]:
        for name, value in env.items():
            line = line.replace(f"${name}", value)
        if line.startswith("python "):
            script, _, target = line.partition(" > ")
            argv = shlex.split(script)
            with open(target, "w", encoding="utf-8") as out:
                subprocess.run([sys.executable, str(README.parent / argv[1]), *argv[2:]], stdout=out, check=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            continue
        argv = shlex.split(line)[1:]
        if real:  # the SFT runs have 5 steps here, the RL run 2: their checkpoints are step_000005, step_000002
            argv = [a.replace("rl/step_000010", "rl/step_000002").replace("/step_000020", "/step_000005") for a in argv]
        assert cli.main([*argv, *speed[argv[0]]]) == 0, line
    steps = 2 if real else 10
    out = capsys.readouterr().out
    if real:
        from transformers import AutoTokenizer

        from nla_shell.io.sidecars import load_sidecar

        train = next(shlex.split(line.replace("$LM", env["LM"]).replace("/step_000020", "/step_000005"))[1:]
                     for line in lines if line.startswith("nla train"))
        assert cli.main([*train, *speed["train"], "engine=native", "save_dir=rl_native"]) == 0
        assert (tmp_path / "rl_native" / f"step_{steps:06d}" / "adapter").is_dir()
        sidecar = load_sidecar(tmp_path / "data" / "rl.parquet.nla_meta.yaml")
        tokenizer = AutoTokenizer.from_pretrained(walkthrough_lm)
        assert tokenizer.encode(sidecar.injection_char, add_special_tokens=False) == [sidecar.injection_token_id]
        # The sites pass and the labelled run name the same automatic marker.
        named = {line.split("injection char ")[1][:3] for line in out.splitlines() if "injection char " in line}
        assert named == {repr(sidecar.injection_char)}
    labels = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert len(labels) > 50 and all(" text; it ends '" in label["explanation"] for label in labels)
    import pyarrow.parquet as pq

    gold = pq.read_table(tmp_path / "data" / "av_sft.parquet", columns=["explanation"]).column(0).to_pylist()
    assert gold and set(gold) <= {label["explanation"] for label in labels}
    summary = json.loads((tmp_path / "eval" / "eval_summary.json").read_text())
    assert summary["n_rows"] > 0 and "av/fve" in summary and "gold/fve" in summary
    assert (tmp_path / "rl" / "curves.png").is_file() and (tmp_path / "rl" / f"step_{steps:06d}" / "adapter").is_dir()
    assert real or ("[nla train] done: 10 steps" in out and "The river" in out)
    # The export of an RL adapter (which holds no tokenizer) loads in plain transformers.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "release" / "av") is not None
    assert AutoTokenizer.from_pretrained(tmp_path / "release" / "av").encode("The river") != []


def test_readme_is_a_front_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/walkthrough.md" in links and "bench/RESULTS.md" in links
    for link in links:
        if not link.startswith("http"):
            assert (README.parent / link).exists(), link
    for page in DOCS.glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not link.startswith("http"):
                assert (page.parent / link).exists(), (page.name, link)
