#!/usr/bin/env bash
# tests/compat/run.sh TORCH_VERSION [PYTEST_ARGS...]
#
# The smoke set on one torch release of the tested range (lightning_par/_compat.py TESTED, pyproject.toml): a venv
# with that torch from the package index (PyPI's builds are CUDA builds; they run on a CPU, ~3 GB each), lightning-par
# installed into it as a user would (`pip install torch==X`, then `pip install -e ".[dev]"`), then the smoke tests:
# import and private names, every strategy family at plain-SGD parity with one process (ZeRO 0-3, TP, a pipeline,
# dp x tp and dp x pp on 4 ranks), ZeRO-1/2/3 and offload through the CLI, context parallel, 3D (tp2 x pp2) at
# parity with one process under plain SGD and a 3D run that resumes,
# and the CLI's documented commands parsing. The result line is appended to tests/compat/results.txt (docs/compat.md
# quotes it). The default CI stays on the pinned 2.13 CPU build; this is run by hand for each release.
#
# Environment: COMPAT_VENVS (where the venvs live; default ~/.cache/lightning-par/compat). pip's configuration is
# ignored for the torch install (PIP_CONFIG_FILE=/dev/null): a machine-wide cap such as torch<=2.14.1 would refuse
# 2.15, and this venv is not the project's.
set -euo pipefail
version=${1:?usage: tests/compat/run.sh TORCH_VERSION [PYTEST_ARGS...]}
shift
cd "$(dirname "$0")/../.."
venv=${COMPAT_VENVS:-$HOME/.cache/lightning-par/compat}/torch-$version
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$version'))"; then
    python3 -m venv "$venv"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q "torch==$version"
fi
echo "torch==$version" > "$venv/torch-pin.txt"
PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q -c "$venv/torch-pin.txt" -e ".[dev]"
versions=$("$venv/bin/python" -c "import torch, lightning, jsonargparse, transformers; print(f'torch {torch.__version__}, lightning {lightning.__version__}, jsonargparse {jsonargparse.__version__}, transformers {transformers.__version__}')")
echo "smoke set on $versions"
smoke=(
    tests/unit/test_compat.py
    tests/launch/test_engine.py
    "tests/launch/test_zero.py::test_stage_matches_single_process"
    "tests/launch/test_tensor_parallel.py::test_tensor_parallel_matches_single_process"
    "tests/launch/test_pipeline_strategy.py::test_schedule_matches_single_process"
    "tests/launch/test_context_parallel.py::test_attention_and_loss_over_two_shards_equal_the_whole_sequence"
    "tests/launch/test_hybrid3d.py::test_losses_and_gradient_norms_match_one_process[tp2_pp2_1f1b_selective_sgd]"
    "tests/launch/test_hybrid3d.py::test_a_3d_checkpoint_resumes_with_the_same_losses"
    "tests/launch/test_docs_commands.py::test_command_parses"
)
start=$(date +%s)
set +e
env -u LIGHTNING_PAR_ALLOW_UNTESTED "$venv/bin/python" -m pytest -q -p no:cacheprovider "${smoke[@]}" "$@" 2>&1 | tee "$venv/smoke.log"
rc=${PIPESTATUS[0]}
set -e
summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|^[0-9]+ (passed|failed)| in [0-9.]+s" "$venv/smoke.log" | tail -1)
echo "$(date -u +%Y-%m-%d) $versions: rc=$rc, $summary ($(( $(date +%s) - start )) s)" | tee -a tests/compat/results.txt
exit "$rc"
