"""The portable Triton kernels compile for an sm_90 GPU without one (tools/compile_kernels.py: Triton's compiler from
source to PTX, no launch): the interpreter that runs them in CI checks their semantics, not what the compiler
accepts (types carried through loops, layouts) nor what it rewrites (it folds ``acc + tl.dot(a, b, 0)`` into the
tensor cores' chain, which ``BLOCKED_PV`` must avoid: the script fails when the blocked form's PTX lacks the
blocks' fp32 adds)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_kernels.py")], capture_output=True, text=True,
                       env=env, timeout=600)
    if p.returncode == 3:
        pytest.skip(p.stdout.strip() or p.stderr.strip())
    assert p.returncode == 0 and "FAIL" not in p.stdout, (p.stdout[-4000:], p.stderr[-4000:])
    assert p.stdout.count("ok   ") >= 20, p.stdout
