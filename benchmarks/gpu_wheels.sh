#!/usr/bin/env bash
# Download the wheels the GPU machines' image lacks (CPython 3.12, manylinux x86_64) into .gpu-wheels/ (git-ignored),
# for the device command of docs/gpu.md to install offline:
#   python3 -m pip install --no-index --no-deps --find-links .gpu-wheels .gpu-wheels/*.whl
# What lightning-par imports at run time that the image (torch 2.11, Lightning 2.6, transformers 5.17) does not hold:
# jsonargparse[signatures] (lightning_par/_compat.py and the CLI) with docstring-parser and typeshed-client; datasets
# (TextDataModule) with dill and multiprocess. The image has the rest of datasets' needs (pyarrow, pandas, xxhash,
# fsspec, huggingface-hub, requests, httpx, tqdm, filelock) and tensorboard. Versions: those of the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-wheels}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
WHEELS=(
  "jsonargparse==4.53.0"
  "docstring-parser==0.18.0"
  "typeshed-client==2.15.0"
  "datasets==5.2.0"
  "dill==0.4.1"
  "multiprocess==0.70.19"
)
PIP_CONFIG_FILE=/dev/null "$PY" -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
du -sh "$DEST"
