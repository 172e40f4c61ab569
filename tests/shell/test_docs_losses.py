"""docs/losses.md and docs/api.md: their examples run from another loop, backpropagate and print what the
pages say they print; the tables name real options."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import torch

import nla_core

DOC = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
API = DOC.parent / "api.md"


def run_page_example(page: Path, tmp_path, capsys) -> dict:
    """Run the page's python block; its printed lines must be the page's text block, exactly."""
    text = page.read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    (expected,) = re.findall(r"```text\n(.*?)```", text, re.DOTALL)
    script = tmp_path / "example.py"
    script.write_text(code)
    ns = runpy.run_path(str(script))
    assert capsys.readouterr().out == expected
    return ns


def test_losses_page_example_runs_and_backpropagates(tmp_path, capsys):
    ns = run_page_example(DOC, tmp_path, capsys)
    out, hidden, mask = ns["out"], ns["hidden"], ns["mask"]
    assert torch.isfinite(out.loss) and out.per_token.shape == mask.shape
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert (hidden.grad[~mask] == 0).all()  # masked positions get no gradient
    assert ns["varied"].tolist() == [True] * 8 + [False] * 4  # the constant group is found
    assert ns["advantages"][8:].eq(0).all()
    assert 0 < out.token_mask_frac.item() < 1  # the entropy mask dropped some tokens, not all


def test_api_page_loop_built_from_the_pieces(tmp_path, capsys):
    ns = run_page_example(API, tmp_path, capsys)
    mask, grad = ns["mask"], ns["logits"].grad
    assert grad is not None and grad.abs().sum() > 0
    assert (grad[~mask] == 0).all()  # padding gets no gradient
    torch.testing.assert_close(ns["out"].loss, ns["loss"])  # policy_loss is the composition of the pieces
    assert "behaviour_logp" not in API.read_text()  # the argument is behavior_logp


def test_every_name_the_page_uses_is_public():
    text = DOC.read_text()
    called = set(re.findall(r"(?:nla_core\.|`)([a-z_]+)\(", text)) - {"clip", "sg"}
    named = {"policy_loss", "grpo_loss", "PolicyLossOutput", "sequence_log_ratio", "gspo_token_log_ratio",
             "ratio_band_mask", "group_has_variance", "best_in_group", "token_entropy", "top_entropy_mask",
             "token_logprobs_from_hidden", "group_advantages"}
    assert called <= named and all(f"`{n}`" in text or f"{n}(" in text for n in named)
    for name in named:
        assert name in nla_core.__all__, name
    for kind in nla_core.POLICY_LOSSES:
        assert f'kind="{kind}"' in DOC.read_text()
    for mode in nla_core.AGGREGATIONS:
        assert mode in DOC.read_text()
