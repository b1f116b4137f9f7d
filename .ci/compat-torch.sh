#!/usr/bin/env bash
# The compile, model and integration tests under another torch than CI's pinned one.
#
#   bash .ci/compat-torch.sh 2.11.0 [pytest args...]
#
# kvfuse supports torch 2.11 to 2.13; CI runs 2.13, and the GPU machine runs 2.11. Dynamo differs
# between them (what it traces without a graph break), and a graph break inside a kvfuse layer
# costs its fusion and CUDA graphs without failing any CPU test on 2.13. Run this before landing
# changes to code that Dynamo traces (kvfuse/layers.py, kvfuse/integrations/, kvfuse/models/).
# It installs that torch into its own virtual environment, which reuses this interpreter's other
# packages (transformers, triton, pytest); torch releases other than CI's pin bring their CUDA
# wheels (some GB; the local index serves them).
set -euo pipefail
version=${1:?usage: .ci/compat-torch.sh TORCH_VERSION [pytest args...]}
shift
venv=${KVFUSE_COMPAT_VENV:-${TMPDIR:-/tmp}/kvfuse-torch-$version}
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
"$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null \
  || "$venv/bin/pip" install -q "torch==$version"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD KVFUSE_NATIVE_BUILD_DIR="$venv/kvfuse-native"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/compile tests/integrations tests/models "$@"
