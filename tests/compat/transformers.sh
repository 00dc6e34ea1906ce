#!/usr/bin/env bash
# tests/compat/transformers.sh TRANSFORMERS_VERSION [PYTEST_ARGS...]
#
# The Hugging Face tests on one transformers release of the tested range (lightning_par/_compat.py OPTIONAL_TESTED,
# pyproject.toml's extras): a venv with the pinned CPU torch (torch==2.13.0, as the README installs it) and
# lightning-par installed as a user would (`pip install -e ".[dev]"`) with `transformers==VERSION`, then every test
# file that builds a transformers model, default set (add --full for the full set's cases): the style walk over every
# config of CONFIG_MAPPING, the published plans resolved and applied, the MoE models under tp / ZeRO-3 / ep, the
# pipeline and tensor-parallel runs of Hugging Face models, export, pretrained experts, the planner on their configs.
# The result line is appended to tests/compat/results.txt (docs/compat.md quotes it). Run the oldest and the newest
# release of the range at least before widening it.
#
# Environment: COMPAT_VENVS (where the venvs live; default ~/.cache/lightning-par/compat).
set -euo pipefail
version=${1:?usage: tests/compat/transformers.sh TRANSFORMERS_VERSION [PYTEST_ARGS...]}
shift
cd "$(dirname "$0")/../.."
venv=${COMPAT_VENVS:-$HOME/.cache/lightning-par/compat}/transformers-$version
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
fi
printf 'torch==2.13.0\ntransformers==%s\n' "$version" > "$venv/pins.txt"
"$venv/bin/pip" install -q -c "$venv/pins.txt" -e ".[dev]"
versions=$("$venv/bin/python" -c "import torch, lightning, transformers; print(f'transformers {transformers.__version__}, torch {torch.__version__}, lightning {lightning.__version__}')")
echo "Hugging Face tests on $versions"
hf_tests=$(grep -l "transformers" tests/unit/test_*.py tests/launch/test_*.py | grep -v test_install.py)
start=$(date +%s)
set +e
env -u LIGHTNING_PAR_ALLOW_UNTESTED "$venv/bin/python" -m pytest -q -p no:cacheprovider $hf_tests "$@" 2>&1 | tee "$venv/hf.log"
rc=${PIPESTATUS[0]}
set -e
summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|^[0-9]+ (passed|failed)| in [0-9.]+s" "$venv/hf.log" | tail -1)
echo "$(date -u +%Y-%m-%d) $versions: rc=$rc, $summary ($(( $(date +%s) - start )) s)" | tee -a tests/compat/results.txt
exit "$rc"
