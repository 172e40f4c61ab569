"""bench/kernel_sites.py: kernel time charged to the op that launched it, that op to its source line in this
repository (or transformers / peft) or, run by the autograd engine, to its backward node."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from torch.autograd.profiler_util import Kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import kernel_sites  # noqa: E402

BACKWARD = SimpleNamespace(name="autograd::engine::evaluate_function: CompiledFunctionBackward", cpu_parent=None)


def op(name, durations_us, *, shape=None, frames=(), parent=None):
    """An op event whose ancestors are `frames` (innermost first: the Python-function events with_stack records)
    above `parent`."""
    for frame in reversed(frames):
        parent = SimpleNamespace(name=frame, cpu_parent=parent)
    return SimpleNamespace(name=name, kernels=[Kernel("k", 0, d) for d in durations_us],
                           input_shapes=[shape] if shape else [], cpu_parent=parent)


def profile(*events):
    return SimpleNamespace(events=lambda: list(events))


def test_kernels_are_charged_to_their_op_its_repository_frame_or_its_backward_node():
    forward_frames = ["/x/site-packages/torch/nn/modules/module.py(1): _call_impl",
                      "/x/site-packages/transformers/models/qwen3/modeling_qwen3.py(80): forward",
                      "/work/repo/nla_shell/training/prefix.py(120): response_forward",
                      "/work/repo/bench/bench_update.py(9): main"]
    clone = SimpleNamespace(name="aten::clone", cpu_parent=BACKWARD)
    sites = kernel_sites.kernel_sites(profile(
        op("aten::mm", [1000.0, 500.0], shape=[1024, 4096], frames=forward_frames),
        op("aten::mm", [250.0], shape=[1024, 4096], frames=forward_frames),
        op("aten::copy_", [40.0, 60.0], shape=[64, 32, 159, 128], parent=clone),
        op("aten::view", [], shape=[3]),
        op("aten::cat", [5.0]),
    ), top=2)
    assert abs(sites["total_s"] - 1855e-6) < 1e-12  # every kernel, the rows cut at top=2 included
    assert sites["rows"] == [
        {"op": "aten::mm", "site": "transformers/models/qwen3/modeling_qwen3.py(80): forward < "
                                   "nla_shell/training/prefix.py(120): response_forward", "shape": "[1024, 4096]",
         "s": 1750e-6, "kernels": 3},
        {"op": "aten::copy_", "site": "backward: CompiledFunctionBackward", "shape": "[64, 32, 159, 128]",
         "s": 100e-6, "kernels": 2},
    ]
    table = kernel_sites.format_sites(sites)
    assert "94.3%" in table and "5.4%" in table and table.count("\n") == 3


def test_without_frames_a_compiled_regions_op_names_the_region():
    region = SimpleNamespace(name="Torch-Compiled Region: 3/0", cpu_parent=None)
    graph = SimpleNamespace(name="## Call CompiledFxGraph abc ##", cpu_parent=region)
    sites = kernel_sites.kernel_sites(profile(op("aten::mm", [7.0], parent=graph)))
    assert sites["rows"][0]["site"] == "Torch-Compiled Region: 3/0"


def test_an_op_with_neither_a_known_frame_nor_a_backward_node_is_unplaced():
    sites = kernel_sites.kernel_sites(profile(op("aten::add", [10.0], frames=["/x/site-packages/torch/x.py(1): f"])))
    assert sites["rows"][0]["site"] == "?"
