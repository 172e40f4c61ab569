#!/usr/bin/env bash
# `.bnb`: bitsandbytes 0.50.2 for the GPU image (torch 2.11 + CUDA 13.0), unzipped with only its CPU and
# CUDA 13.0 libraries (4.5 MiB instead of the wheel's 124 MiB), so that it travels beside vLLM's fourth part
# in one `device` call's 64 MiB (`carry [".device-carry/vllm/p4", ".bnb"]`; bench/gpu_session.sh need_bnb).
#
#   bash bench/prepare_bnb.sh        # from the repository root; needs the package registry
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q bitsandbytes==0.50.2 --no-deps --only-binary=:all: \
  --platform manylinux_2_24_x86_64 --python-version 3.12 -d "$work/wheel"
mkdir -p "$work/unzipped" && (cd "$work/unzipped" && unzip -q "$work"/wheel/*.whl)
find "$work/unzipped/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete
rm -rf .bnb && mv "$work/unzipped" .bnb
du -sh .bnb
