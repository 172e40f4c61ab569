"""Which source line or backward node launched the device's time: a torch.profiler profile's kernel time
grouped by the op that launched each kernel, where in the code that op ran, and its first input's shape.

A profiler table groups by op name only, so "aten::copy_ 0.16 s" does not say which copy. Here every
kernel's time is charged to the CPU op that launched it (its own kernels, not its children's), and that op
to a site: the innermost two frames of its Python stack in this repository, transformers or peft (forward
ops); for ops the autograd engine runs (no Python stack) the backward node they ran in, e.g.
`CompiledFunctionBackward` (a compiled region's backward) or `CatBackward0`. Forward ops in a compiled
region name it ("Torch-Compiled Region: 0/0") where no frame does: torch 2.11 with CUDA activity links no
Python frames to ops (on the H200, run AJ: `stack` empty and no Python-function ancestors), torch 2.13 on
the CPU does.

    with torch.profiler.profile(activities=[CPU, CUDA], record_shapes=True, with_stack=True) as prof:
        work()
    sites = kernel_sites(prof)     # {"total_s": all kernel seconds, "rows": [{"op", "site", "shape", "s", "kernels"}, ...]}
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

SITE_MARKERS = ("nla_shell/", "nla_core/", "bench/", "transformers/", "peft/")
"""Stack frames from these paths name a site; torch's own frames never do."""
BACKWARD_NODE = "autograd::engine::evaluate_function: "
COMPILED_REGION = "Torch-Compiled Region"


def kernel_sites(prof, *, top: int = 40) -> dict[str, Any]:
    """All kernel seconds, and the `top` (op, site, first input shape) groups by kernel seconds, largest first.

    Args: prof: a finished torch.profiler.profile run with CUDA activity, record_shapes and with_stack.
    Returns: {"total_s": every kernel's seconds, "rows": [{"op": launching op, "site": "file(line): function" or
      "backward: Node", "shape": first input's shape, "s": kernel seconds, "kernels": kernel launches}, ...]}.
    """
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        kernels = getattr(event, "kernels", None) or []
        if not kernels:
            continue
        shapes = getattr(event, "input_shapes", None) or []
        key = (event.name, _site(event), str(list(shapes[0])) if shapes and shapes[0] else "")
        groups[key][0] += sum(k.duration for k in kernels) / 1e6
        groups[key][1] += len(kernels)
    rows = [{"op": op, "site": site, "shape": shape, "s": seconds, "kernels": count}
            for (op, site, shape), (seconds, count) in groups.items()]
    return {"total_s": sum(row["s"] for row in rows), "rows": sorted(rows, key=lambda row: -row["s"])[:top]}


def _site(event, *, frames: int = 2) -> str:
    """The op's innermost `frames` repository / transformers / peft frames (innermost first, joined by " < "),
    else the innermost backward node or compiled region it ran in, else "?". The frames are the op's
    Python-function ancestors (what torch.profiler's with_stack records) or, where a profiler fills it, its `stack`."""
    found, enclosing = [], None
    parent = event.cpu_parent
    names = list(getattr(event, "stack", None) or [])
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    for name in names:
        starts = [name.rfind(marker) for marker in SITE_MARKERS if marker in name]
        if starts and len(found) < frames:
            found.append(name[max(starts):])
        if enclosing is None and name.startswith(BACKWARD_NODE):
            enclosing = "backward: " + name[len(BACKWARD_NODE):]
        if enclosing is None and name.startswith(COMPILED_REGION):
            enclosing = name
    return " < ".join(found) if found else enclosing or "?"


def format_sites(sites: dict[str, Any]) -> str:
    """A plain-text table of `kernel_sites`' rows, each with its share of all kernel seconds."""
    lines = [f"kernel seconds in all: {sites['total_s']:.4f}",
             f"{'seconds':>8} {'share':>6} {'kernels':>7}  op | site | first input"]
    for row in sites["rows"]:
        lines.append(f"{row['s']:8.4f} {row['s'] / sites['total_s']:6.1%} {row['kernels']:7d}  "
                     f"{row['op']} | {row['site']} | {row['shape']}")
    return "\n".join(lines)
