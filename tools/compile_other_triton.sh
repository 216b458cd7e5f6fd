#!/usr/bin/env bash
# Compile the kernels (tools/compile_kernels.py --ptxas) with another Triton than this environment's, e.g. the device
# machine's (its KINDS.md: 3.6), before a GPU call finds out. Usage: bash tools/compile_other_triton.sh [VERSION]
# A virtualenv /tmp/triton-VERSION holds that Triton alone; this environment's torch stays on its path (a .pth file);
# the package is mapped as tools/gpu_suite.sh maps it on the device machine.
set -euo pipefail
version=${1:-3.6.0}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
venv=/tmp/triton-$version
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q "triton==$version" numpy
  "$py" -c "import site; print(site.getsitepackages()[0])" \
    > "$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/zz_torch_from_here.pth"
fi
cd "$repo"
PATH=$venv/bin:$PATH bash tools/gpu_suite.sh exec /tmp/elsa_out_compile true >/dev/null 2>&1 || true  # maps /tmp/elsa_pp
cd /tmp
PYTHONPATH=/tmp/elsa_pp:$repo "$venv/bin/python" -c "import triton; print('triton', triton.__version__)"
PYTHONPATH=/tmp/elsa_pp:$repo "$venv/bin/python" "$repo/tools/compile_kernels.py" --ptxas
