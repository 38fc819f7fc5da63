#!/usr/bin/env bash
# Create (or refresh) the TorchRL reference venv used by benchmarks/torchrl_side.py.
#
# Usage: benchmarks/setup_torchrl_venv.sh [VENV_DIR]     (default: <repo>/.venv-torchrl)
#
# Idempotent: creates the venv only if it is missing and runs pip only when the
# pinned versions are not already importable.  torch is pinned to 2.13.0, the
# CPU build available locally; any other version would pull a multi-GB CUDA
# build.  torchrl 0.12.0 brings its own tensordict 0.12.x, resolved by pip.
# Override the interpreter with PYTHON=/path/to/python3.11.
set -euo pipefail

TORCH_VERSION="2.13.0"
TORCHRL_VERSION="0.12.0"
# TorchRL 0.12's RayCollector calls ray.internal.free, which later Ray releases removed.
RAY_VERSION="2.52.1"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="${1:-$repo_root/.venv-torchrl}"
python="${PYTHON:-$(command -v python3)}"

check_imports() {
    "$venv_dir/bin/python" - "$TORCH_VERSION" "$TORCHRL_VERSION" "$RAY_VERSION" <<'EOF'
import sys

import gymnasium
import ray
import tensordict
import torch
import torchrl

want_torch, want_torchrl, want_ray = sys.argv[1:4]
print(
    f"torch {torch.__version__}, torchrl {torchrl.__version__}, "
    f"tensordict {tensordict.__version__}, gymnasium {gymnasium.__version__}"
)
ok = (torch.__version__.split("+")[0] == want_torch and torchrl.__version__ == want_torchrl
      and ray.__version__ == want_ray)
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
    "torch==$TORCH_VERSION" "torchrl==$TORCHRL_VERSION" gymnasium "ray==$RAY_VERSION"
check_imports
echo "venv $venv_dir is ready"
