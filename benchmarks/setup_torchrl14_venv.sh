#!/usr/bin/env bash
# Create (or refresh) the TorchRL 0.14 venv: the second TorchRL side of the benchmarks
# (benchmarks/torchrl_side.py), for AsyncBatchedCollector, new in TorchRL 0.14.
#
# Usage: benchmarks/setup_torchrl14_venv.sh [VENV_DIR]     (default: <repo>/.venv-torchrl14)
#
# Idempotent: creates the venv only if it is missing and runs pip only when the
# pinned versions are not already importable.  torch is pinned to 2.13.0, the
# CPU build available locally; any other version would pull a multi-GB CUDA
# build.  torchrl 0.14.1 is pinned with tensordict 0.14.3, the release measured.
# rlharvest's own side also runs in this venv for the workloads whose env
# factories are TorchRL's (it imports rlharvest from the checkout).
# Override the interpreter with PYTHON=/path/to/python3.11.
set -euo pipefail

TORCH_VERSION="2.13.0"
TORCHRL_VERSION="0.14.1"
TENSORDICT_VERSION="0.14.3"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="${1:-$repo_root/.venv-torchrl14}"
python="${PYTHON:-$(command -v python3)}"

check_imports() {
    "$venv_dir/bin/python" - "$TORCH_VERSION" "$TORCHRL_VERSION" "$TENSORDICT_VERSION" <<'EOF'
import sys

import cloudpickle  # noqa: F401  (rlharvest's side runs here too)
import gymnasium
import tensordict
import torch
import torchrl

want_torch, want_torchrl, want_tensordict = sys.argv[1:4]
print(
    f"torch {torch.__version__}, torchrl {torchrl.__version__}, "
    f"tensordict {tensordict.__version__}, gymnasium {gymnasium.__version__}"
)
ok = (
    torch.__version__.split("+")[0] == want_torch
    and torchrl.__version__ == want_torchrl
    and tensordict.__version__ == want_tensordict
)
sys.exit(0 if ok else 1)
EOF
}

if [[ ! -x "$venv_dir/bin/python" ]]; then
    echo "creating venv $venv_dir with $python"
    "$python" -m venv "$venv_dir"
fi

if check_imports 2>/dev/null; then
    echo "venv $venv_dir is ready"
    exit 0
fi

"$venv_dir/bin/python" -m pip install --quiet \
    "torch==$TORCH_VERSION" "torchrl==$TORCHRL_VERSION" "tensordict==$TENSORDICT_VERSION" gymnasium cloudpickle
check_imports
echo "venv $venv_dir is ready"
