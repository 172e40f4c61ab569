"""Cost of checkpoint integrity: a verified save and a resume-time verification, against plain writes.

    python bench/bench_checkpoint.py --gib 2 --files 4

Writes `--files` random files of `--gib` GiB in total, as a checkpoint's write callback
would, three ways in one run: plain writes + fsync (the baseline, what a save cost
before manifests), `save_checkpoint` (writes + one hash-and-fsync pass + manifest), and
`checkpoint_problem` (the full verification a resume does). Prints seconds and GB/s
and the ratios to the baseline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from nla_shell.training.checkpoint import checkpoint_problem, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="total checkpoint size in GiB")
    parser.add_argument("--files", type=int, default=4, help="number of files it is split into")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    size = int(args.gib * 2**30) // args.files
    blob = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    root = Path(tempfile.mkdtemp(dir=args.dir))

    def write(directory: Path) -> None:
        for i in range(args.files):
            (directory / f"part_{i}.bin").write_bytes(blob)

    try:
        plain = root / "plain"
        plain.mkdir()
        t0 = time.perf_counter()
        write(plain)
        for path in plain.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        t_plain = time.perf_counter() - t0

        t0 = time.perf_counter()
        path = save_checkpoint(root / "run", 1, write=write)
        t_save = time.perf_counter() - t0

        t0 = time.perf_counter()
        problem = checkpoint_problem(path)
        t_verify = time.perf_counter() - t0
        assert problem is None, problem
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = args.files * size / 1e9
    print(f"checkpoint of {gb:.2f} GB in {args.files} files, {os.cpu_count()} CPUs")
    print(f"plain write + fsync : {t_plain:7.2f} s  ({gb / t_plain:5.2f} GB/s)  1.00x")
    print(f"verified save       : {t_save:7.2f} s  ({gb / t_save:5.2f} GB/s)  {t_save / t_plain:.2f}x")
    print(f"verify on resume    : {t_verify:7.2f} s  ({gb / t_verify:5.2f} GB/s)  {t_verify / t_plain:.2f}x")


if __name__ == "__main__":
    main()
