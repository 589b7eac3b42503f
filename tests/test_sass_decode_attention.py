"""The fp8 pool's decode kernel compiles, for sm_90, to the loop its comments describe (checked on
CPU through benchmarks/sass_decode_attention.py: Triton's own ptxas and cuobjdump, no GPU): v is
staged in fp16 and read with ldmatrix.trans, not byte by byte, and the register cap holds."""
import json
import os
import subprocess
import sys

import pytest

_TOOL = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "sass_decode_attention.py")


def _describe(*args):
    pytest.importorskip("triton")
    import triton.backends.nvidia as nv

    if not os.path.exists(os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")):
        pytest.skip("this triton wheel ships no cuobjdump")
    # A process of its own: the test session runs Triton's interpreter, which this tool cannot use.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, _TOOL, "--json", *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fp8_pool_v_read_by_ldmatrix_trans():
    d = _describe("--head-dim", "256", "--group", "2")
    ops = d["opcodes"]
    assert not [op for op in ops if op.startswith("LDS.U8")], ops
    assert any(op.startswith("LDSM") and ".MT88" in op for op in ops), ops      # the transposing ldmatrix
    assert any(op.startswith("F2FP") and "E4M3" in op for op in ops), ops       # e4m3 -> fp16 in the loop
    assert d["config"].get("maxnreg") == 128 and d["registers"] <= 128 and d["spilled"] == 0, d


def test_v_staged_in_fp8_is_read_byte_by_byte():
    """The layout the kernel's V_WIDE avoids, still what Triton does without it: if this starts
    failing, Triton vectorizes it and V_WIDE's select may be dropped."""
    d = _describe("--head-dim", "256", "--group", "2", "--v-staged-fp8")
    assert sum(n for op, n in d["opcodes"].items() if op.startswith("LDS.U8")) >= 32, d["opcodes"]
