"""`import nla_core` pulls in torch and the standard library only, and exports the public API."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import nla_core

PUBLIC_API = [
    "group_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_categorical",
    "token_logprobs",
    "grpo_loss",
    "GRPOLossOutput",
    "aggregate_loss",
    "policy_loss",
    "PolicyLossOutput",
    "POLICY_LOSSES",
    "AGGREGATIONS",
    "sequence_log_ratio",
    "gspo_token_log_ratio",
    "ratio_band_mask",
    "group_has_variance",
    "best_in_group",
    "token_entropy",
    "top_entropy_mask",
    "LogprobsAndEntropy",
    "find_injection_sites",
    "inject_norm_matched",
    "karvonen_inject",
    "marker_well_formed",
    "hf_param_name",
    "layer_buckets",
    "merge_lora_weight",
    "FAILED_EXTRACTION_REWARD",
    "extract_explanation",
    "resolve_target_scale",
    "normalize_activation",
    "reconstruction_mse",
    "reward_from_mse",
    "predict_mean_baselines",
    "Baselines",
    "fve",
    "denormalize_activation",
    "random_at_same_error",
    "NLAConfig",
    "parse_sidecar",
    "canonical_neighbors",
    "doc_disjoint_rows",
    "quantize_rowwise",
    "fp8_linear",
    "fp8_linear_ste",
]

PACKAGE_DIR = Path(nla_core.__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent

PROBE = r"""
import json, sys
roots = lambda names: sorted({m.split(".")[0] for m in names})
before = set(sys.modules)
import torch
mid = set(sys.modules)
import nla_core
after = set(sys.modules)
print(json.dumps({
    "torch_alone": roots(mid - before),
    "added_by_nla_core": roots(after - mid),
    "all_new": roots(after - before),
}))
"""

COLD_PROBE = r"""
import json, sys
before = set(sys.modules)
import nla_core
print(json.dumps(sorted({m.split(".")[0] for m in set(sys.modules) - before})))
"""


def _run(code):
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def _probe():
    return _run(PROBE)


def _allowed():
    # torch, the standard library, nla_core itself, and whatever torch imports on its own
    return set(sys.stdlib_module_names) | {"torch", "nla_core"} | set(_probe()["torch_alone"])


def test_public_api_exported():
    missing = [name for name in PUBLIC_API if not hasattr(nla_core, name)]
    assert not missing, missing
    assert nla_core.FAILED_EXTRACTION_REWARD == -2.0


def _defined_public_names(mod) -> set[str]:
    """The functions and classes `mod` defines (not imports), and the constants assigned at its top level."""
    source = Path(mod.__file__).read_text()
    names = set()
    for name, value in vars(mod).items():
        if name.startswith("_") or name == "annotations" or inspect.ismodule(value):
            continue
        if inspect.isfunction(value) or inspect.isclass(value):
            if value.__module__ == mod.__name__:
                names.add(name)
        elif re.search(rf"^{name}\s*[:=]", source, re.M):
            names.add(name)
    return names


def test_every_module_lists_its_public_names():
    # Each topic file names exactly the public API it defines in __all__, and the package re-exports all of it.
    modules = [m.name for m in pkgutil.iter_modules(nla_core.__path__) if not m.name.startswith("_")]
    assert {"advantages", "losses", "sidecar", "injection"} <= set(modules)
    for module in modules:
        mod = importlib.import_module(f"nla_core.{module}")
        assert set(getattr(mod, "__all__", ())) == _defined_public_names(mod), module
        for name in mod.__all__:
            assert name in nla_core.__all__ and getattr(nla_core, name) is getattr(mod, name), (module, name)


def test_import_pulls_in_only_torch_and_stdlib():
    # In a fresh interpreter, torch is imported alone first (what it brings is torch's
    # business); every top-level module new after `import nla_core` must be allowed.
    data = _probe()
    assert "nla_core" in data["added_by_nla_core"]
    extra = set(data["all_new"]) - _allowed()
    assert not extra, f"import nla_core pulled in {sorted(extra)}"


def test_cold_import_pulls_in_only_torch_and_stdlib():
    # nla_core imported first thing (torch not loaded yet) adds nothing else either
    cold = _run(COLD_PROBE)
    assert "torch" in cold and "nla_core" in cold
    extra = set(cold) - _allowed()
    assert not extra, f"import nla_core (cold) pulled in {sorted(extra)}"


def _imported_roots(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: inside nla_core
                yield node.lineno, "nla_core"
            else:
                yield node.lineno, node.module.split(".")[0]
        elif isinstance(node, ast.Call):
            # importlib.import_module("x") / __import__("x") with a literal name
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                yield node.lineno, str(node.args[0].value).split(".")[0]


def test_source_imports_only_torch_stdlib_and_itself():
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert files and any(f.name == "__init__.py" for f in files)
    allowed = set(sys.stdlib_module_names) | {"torch", "nla_core", "__future__"}
    bad = []
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        for lineno, root in _imported_roots(tree):
            if root not in allowed:
                bad.append(f"{f.relative_to(REPO_ROOT)}:{lineno}: {root}")
    assert not bad, bad


def _module_imports(root: Path) -> dict[str, set[str]]:
    """Every nla_core / nla_shell module -> the package modules it imports, at module level or inside functions."""
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for package in ("nla_core", "nla_shell") for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def test_no_two_modules_import_each_other_even_lazily():
    """The import graph of nla_core and nla_shell (function-level imports included) has no cycle."""
    graph = _module_imports(Path(__file__).resolve().parents[2])
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := cycle_from(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            assert (found := cycle_from(start, [start])) is None, " -> ".join(found)
    assert graph["nla_shell.explainers"] >= {"nla_shell.explainers.base", "nla_shell.explainers.context"}
