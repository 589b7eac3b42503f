"""Kernels not yet run on a GPU compile for sm_90 (H100 / H200) here, without one, and (but for the
decode attention's) do not spill (tests/kernels/sm90_compile.py, in a subprocess outside Triton's
interpreter)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def rows():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    if "No such file" in out.stderr and "ptxas" in out.stderr:
        pytest.skip("this triton has no bundled ptxas")
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_every_variant_compiles(rows):
    assert len(rows) >= 20
    assert any(r["name"].startswith("decode attention") for r in rows)
    failed = [(r["name"], r["error"]) for r in rows if not r["ok"]]
    assert not failed, failed


# Compiled, not held to no spills: the decode attention split kernel with an fp8 pool runs capped at 128
# registers (launch_config), where a change to it may spill; whether that costs time is the GPU's to say
# (bench_attention.py).
COMPILE_ONLY = ("decode attention",)


def test_no_variant_spills_registers(rows):
    spilled = [(r["name"], r["regs"], r["spill_bytes"]) for r in rows
               if r["ok"] and r["spill_bytes"] and not r["name"].startswith(COMPILE_ONLY)]
    assert not spilled, spilled
    assert all(r["regs"] for r in rows if r["ok"]), "ptxas printed no register count"


def test_row_sum_loads_are_pipelined_only_where_the_loop_asks(rows):
    """Triton pipelines (cp.async) the loads that feed tl.dot on its own; a row sum's K loop only with
    PIPE: the plain loop makes one trip to memory per tile, the pipelined one stages them."""
    plain = [r for r in rows if r["ok"] and " row sums " in r["name"]]
    piped = [r for r in rows if r["ok"] and " pipelined " in r["name"]]
    assert len(plain) == len(piped) >= 8
    assert all(r["cp_async"] == 0 for r in plain), [(r["name"], r["cp_async"]) for r in plain]
    assert all(r["cp_async"] > 0 for r in piped), [(r["name"], r["cp_async"]) for r in piped]


def test_block_scaled_fp8_gemm_multiplies_e4m3_on_the_tensor_cores(rows):
    """Every autotuned MMA tile of the FineGrainedFP8 GEMM, its x tile quantized in registers: the dot
    is an e4m3 wgmma (not an upcast), 4 instructions (K = 32 each) per 128-long group at least. The
    one-row tiles (FMAs, BLOCK_M 1) compile without one."""
    from gemma4opt.kernels.fp8_block_linear import _configs

    block = [r for r in rows if r["name"].startswith("fp8_block_linear") and not r["name"].endswith("fp8_w=False")]
    one_row = [r for r in block if r["name"].startswith(("fp8_block_linear 1x", "fp8_block_linear pairs 1x"))]
    assert len(block) == len(_configs()) + 4          # and UE8M0 scales at two row classes, the MoE pairs' two
    assert len(one_row) == sum(c.kwargs["BLOCK_M"] == 1 for c in _configs()) + 1 >= 2
    mma = [r for r in block if r not in one_row]
    assert all(r["ok"] and r["fp8_wgmma"] >= 4 for r in mma), [(r["name"], r.get("fp8_wgmma")) for r in mma]
    assert all(r["ok"] and r["fp8_wgmma"] == 0 for r in one_row), [(r["name"], r.get("fp8_wgmma")) for r in one_row]


def test_fp8_gemm_quantizing_its_input_keeps_the_e4m3_tensor_cores(rows):
    """QUANT's dot tiles quantize the bf16 x tile in registers and still multiply e4m3 on wgmma
    (4 instructions per 128 of K at least); its one-row row sum and the fp8 gate/up GEMV compile too."""
    quant = [r for r in rows if r["name"].startswith("fp8_linear quant")]
    assert len(quant) == 6 and all(r["ok"] for r in quant), quant
    dots = [r for r in quant if " dot " in r["name"]]
    assert len(dots) == 4 and all(r["fp8_wgmma"] >= 4 for r in dots), [(r["name"], r["fp8_wgmma"]) for r in dots]
    assert [r["ok"] for r in rows if r["name"].startswith("gate_up_gelu fp8")] == [True, True]
