"""bench/rl_variants.py: RL again from a demo's SFT checkpoints with keys changed, and the paired table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from nla_shell import cli

ROOT = Path(__file__).resolve().parents[2]


def _rl_variants():
    spec = importlib.util.spec_from_file_location("rl_variants", ROOT / "bench" / "rl_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("av_flags", [[], ["--no-av-lora"]])  # the AV's SFT: a LoRA, or the whole LM
def test_a_variant_trains_from_the_demos_sft_with_its_keys_and_joins_the_table(tmp_path, av_flags):
    run_dir = tmp_path / "demo"
    assert cli.main(["demo", "--tiny", "--run-dir", str(run_dir), *av_flags]) == 0
    rl_variants = _rl_variants()
    report = rl_variants.run_variant(run_dir, "cispo", ["policy_loss=cispo", "clip_eps=1.0", "clip_eps_high=4.0",
                                                         "tis=none"])
    variant = run_dir / "variants" / "cispo"
    config = yaml.safe_load((variant / "rl" / "config.yaml").read_text())
    demo_config = yaml.safe_load((run_dir / "rl" / "config.yaml").read_text())
    # The keys given changed; everything else is the demo's RL, from the demo's SFT checkpoints.
    assert (config["policy_loss"], config["clip_eps_high"], config["tis"]) == ("cispo", 4.0, "none")
    assert demo_config["policy_loss"] == "grpo"
    same = {k: v for k, v in demo_config.items() if k not in {"policy_loss", "clip_eps", "clip_eps_high", "tis",
                                                               "save_dir"}}
    assert {k: config[k] for k in same} == same
    assert config["av_ckpt"] == str(run_dir / "av_sft" / "step_000002")
    assert (variant / "eval" / "after_rl" / "eval_summary.json").is_file()
    assert report["seconds_per_rl_step"] > 0 and report["seed"] == 0

    result = rl_variants.table([run_dir], tmp_path / "table")
    names = [row["name"] for row in result["variants"]]
    assert names == [rl_variants.BASE, "cispo"]
    assert result["variants"][1]["overrides"] == report["overrides"]
    table = (tmp_path / "table" / "rl_variants.md").read_text()
    assert "| cispo | policy_loss=cispo clip_eps=1.0 clip_eps_high=4.0 tis=none | 1 |" in table
    assert json.loads((tmp_path / "table" / "rl_variants.json").read_text())["after_sft_fve"].keys() == {"0"}
