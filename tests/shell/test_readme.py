"""The README's commands and its "Use the losses in your own RL loop" example stay honest."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_losses_example_runs_and_backpropagates(tmp_path, capsys):
    (code,) = re.findall(r"```python\n(.*?)```", _section("Use the losses in your own RL loop"), re.DOTALL)
    script = tmp_path / "example.py"
    script.write_text(code)
    namespace = runpy.run_path(str(script))
    assert namespace["out"].per_token.shape == (6, 5)
    grad = namespace["logits"].grad
    assert grad is not None and grad.abs().sum() > 0
    # The masked tail of row 0 gets no gradient; the constant group (prompt 2) gets advantage 0.
    assert grad[0, 3:].abs().sum() == 0
    assert namespace["advantages"][4:].eq(0).all()
    assert capsys.readouterr().out.startswith("loss ")


def test_readme_opens_with_the_demo_and_test_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1).splitlines()
    assert first_block[0].startswith("bash scripts/setup.sh && .venv/bin/nla demo")
    assert first_block[1].startswith("bash scripts/setup.sh && .venv/bin/python -m pytest tests -q")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest tests -q" in ci
