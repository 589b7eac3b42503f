"""The decode GEMMs' weight prefetch before their PDL wait (kernels/_util.py): how many bytes of each
row a launch asks for, that the pieces its lanes issue cover exactly those bytes (in the
interpreter, odd shapes), that the compiled kernels issue the bulk L2 prefetch before
griddepcontrol.wait and only with PDL (ahead of time for sm_90, no GPU needed), and (on the GPU
machine) that a CUDA-graph chain of the GEMMs gives the same bits with and without it."""
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from gemma4opt.kernels import _util

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def restore_prefetch():
    yield
    _util.set_weight_prefetch(_util.PREFETCH_MB_DEFAULT)
    _util.set_pdl(_util.PDL_DEFAULT)


def test_bytes_per_row_spread_the_budget_and_refuse_misaligned_rows(restore_prefetch):
    _util.set_weight_prefetch(1)                        # 1 MiB over the rows
    w = torch.empty(1024, 2560, dtype=torch.bfloat16)   # 5120 B a row: 1 MiB / 1024 rows = 1024 B each
    assert _util.weight_prefetch(w, True) == 1024
    assert _util.weight_prefetch(w, False) == 0         # no PDL: nothing runs before the wait to hide
    assert _util.weight_prefetch(w[:3], True) == 5120   # few rows: whole rows
    assert _util.weight_prefetch(torch.empty(300, 2560, dtype=torch.bfloat16), True) == 3488   # 3495 -> 16s
    assert _util.weight_prefetch(torch.empty(4, 48, dtype=torch.float8_e4m3fn)[:, :40], True) == 32  # 40 B rows
    assert _util.weight_prefetch(torch.empty(4, 12, dtype=torch.bfloat16), True) == 0   # 24 B stride
    assert _util.weight_prefetch(torch.empty(8, 65, dtype=torch.bfloat16)[:, 1:], True) == 0  # 130 B stride
    assert _util.weight_prefetch(torch.empty(0, 64), True) == 0
    _util.set_weight_prefetch(0)
    assert _util.weight_prefetch(w, True) == 0


@triton.jit
def _pieces_kernel(ROW, OFF, SIZE, N, K, PF, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ELEM: tl.constexpr):
    # lo / hi of split sk as the GEMM kernels compute them
    sk = tl.program_id(1)
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = sk * chunk
    hi = tl.minimum(lo + chunk, K)
    row, off, size = _util.prefetch_pieces(tl.program_id(0) * BLOCK_N, N, lo, hi, PF // SPLIT_K, ELEM, BLOCK_N)
    LANES: tl.constexpr = 128 if BLOCK_N < 128 else BLOCK_N
    at = (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * LANES + tl.arange(0, LANES)
    tl.store(ROW + at, row)
    tl.store(OFF + at, off)
    tl.store(SIZE + at, size)


@pytest.mark.parametrize("N,K,elem,block_n,split,pf", [
    (7, 2560, 2, 1, 1, 5120), (13, 2560, 2, 4, 1, 816), (300, 96, 2, 16, 1, 4096), (37, 1000, 1, 8, 2, 512),
    (5, 640, 1, 64, 4, 640), (3, 40, 2, 4, 4, 1000), (200, 256, 2, 128, 1, 96), (9, 48, 4, 2, 1, 10000), (3, 512, 2, 256, 2, 0)])
def test_pieces_cover_each_rows_first_bytes_once(N, K, elem, block_n, split, pf):
    """Every row < N gets exactly the first min(PF / splits, its part's bytes) bytes (rounded down to
    16) of each split's part, as pieces that are 16-byte multiples, do not overlap and stay in the row."""
    lanes = max(128, block_n)
    programs = triton.cdiv(N, block_n)
    block_k = 32
    shape = (split * programs * lanes,)
    row, off, size = torch.empty(shape, dtype=torch.int64), torch.empty(shape, dtype=torch.int32), \
        torch.empty(shape, dtype=torch.int32)
    _pieces_kernel[(programs, split)](row, off, size, N, K, pf, SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k,
                                      ELEM=elem)
    chunk = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    got = {}
    for r, o, b in zip(row.tolist(), off.tolist(), size.tolist()):
        assert 0 <= r < N and b % 16 == 0 and b >= 0
        if b:
            got.setdefault(r, []).append((o * elem, o * elem + b))
    want = {}
    for r in range(N):
        for sk in range(split):
            lo, hi = sk * chunk, min(sk * chunk + chunk, K)
            span = min(pf // split, max(hi - lo, 0) * elem) // 16 * 16
            if span:
                want.setdefault(r, []).append((lo * elem, lo * elem + span))
    for r in set(got) | set(want):
        pieces = sorted(got.get(r, []))
        assert all(a >= b_prev for (_, b_prev), (a, _) in zip(pieces, pieces[1:])), f"row {r}: overlap {pieces}"
        assert _merged(pieces) == _merged(want.get(r, [])), f"row {r}"
        assert all(b <= K * elem for _, b in pieces)


def _merged(spans):
    out = []
    for a, b in sorted(spans):
        if out and a == out[-1][1]:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


_AOT = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gemma4opt.kernels.fp8_linear import _fp8_linear_kernel
from gemma4opt.kernels.gate_up_gelu import _gate_up_gelu_kernel
from gemma4opt.kernels.skinny_linear import _skinny_kernel
cases = {
    "skinny": (_skinny_kernel, dict(X="*bf16", U="*bf16", W="*bf16", Y="*bf16", P="*fp32", M="i32", N="i32", K="i32",
               sxm="i32", sum_="i32", swn="i32", sym="i32", PF="i32"),
               dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, COMPILED=True, IEEE=False, SWAP=False, CAP=0.0,
                    GELU=False)),
    "fp8": (_fp8_linear_kernel, dict(X="*fp8e4nv", XS="*fp32", W="*fp8e4nv", WS="*fp32", Y="*bf16", P="*fp32",
            M="i32", N="i32", K="i32", sxm="i32", swn="i32", sym="i32", ROWS="i32", PF="i32"),
            dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, COMPILED=True, SWAP=True, CAP=0.0)),
    "gate_up": (_gate_up_gelu_kernel, dict(X="*bf16", W="*bf16", OUT="*bf16", H="i32", I="i32", sxt="i32",
                swn="i32", sot="i32", PF="i32"), dict(BLOCK_N=4, BLOCK_K=512, COMPILED=True)),
}
for name, (fn, sig, consts) in cases.items():
    for pdl in (True, False):
        c = dict(consts, PDL=pdl)
        s = dict(sig, **{k: "constexpr" for k in c})
        try:
            ptx = triton.compile(ASTSource(fn=fn, signature=s, constexprs=c), target=GPUTarget("cuda", 90, 32),
                                 options=dict(num_warps=4, num_stages=3)).asm["ptx"]
        except Exception as e:
            print("SKIP", type(e).__name__, str(e).splitlines()[0])
            raise SystemExit
        pf = [m.start() for m in re.finditer(r"cp\\.async\\.bulk\\.prefetch\\.L2\\.global", ptx)]
        wait = ptx.find("griddepcontrol.wait")
        print(name, pdl, len(pf), int(bool(pf) and max(pf) < wait))
"""


def test_compiled_for_sm90_the_prefetch_comes_before_the_wait_and_only_with_pdl():
    """Ahead of time (a subprocess without the interpreter, no GPU needed): each GEMM kernel issues
    its bulk L2 prefetches (two in the gate/up GEMV: gate rows and up rows) before griddepcontrol.wait
    when launched with PDL, and none without."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(f"no sm_90 compile here: {out.stdout.strip()}")
    got = {tuple(line.split()[:2]): tuple(map(int, line.split()[2:])) for line in out.stdout.splitlines()}
    assert got == {("skinny", "True"): (1, 1), ("skinny", "False"): (0, 0), ("fp8", "True"): (1, 1),
                   ("fp8", "False"): (0, 0), ("gate_up", "True"): (2, 1), ("gate_up", "False"): (0, 0)}


def _chain(x, w, gu_w, down_w, gu_q, gu_s, buf):
    """norm -> gate/up GEMV + gelu -> down GEMM -> quantize -> fp8 GEMM, into a reused buffer."""
    from gemma4opt.kernels.fp8_linear import fp8_linear_triton
    from gemma4opt.kernels.gate_up_gelu import gate_up_gelu_triton
    from gemma4opt.kernels.rms_norm import rms_norm_triton
    from gemma4opt.kernels.skinny_linear import skinny_linear_triton
    from gemma4opt.ops.fp8 import quantize_rows_reference
    h = rms_norm_triton(x, w, 1e-6)
    act = gate_up_gelu_triton(h, gu_w) if h.shape[0] == 1 else skinny_linear_triton(h, gu_w)
    buf.copy_(skinny_linear_triton(act, down_w))
    q, s = quantize_rows_reference(buf)
    return fp8_linear_triton(q, s, gu_q, gu_s, torch.bfloat16), buf.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("mb", [0.5, 16, 4096])
def test_graph_chain_same_bits_with_and_without_prefetch(rows, mb, restore_prefetch):
    """With PDL on, a replayed CUDA-graph chain of the GEMMs gives the same bits whatever the budget
    (a part of each row, the default, more than L2 holds) as without the prefetch."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU (PDL and the bulk prefetch)")
    torch.manual_seed(rows)
    H, I = 1000, 1536
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    gu_w = (torch.randn(2 * I, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    down_w = (torch.randn(H, I if rows == 1 else 2 * I, device="cuda") / I ** 0.5).to(torch.bfloat16)
    gu_q = (torch.randn(2 * I, H, device="cuda") * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    gu_s = torch.rand(2 * I, device="cuda") / 100
    _util.set_pdl(True)
    outs = {}
    for budget in (0, mb):
        _util.set_weight_prefetch(budget)
        buf = torch.empty(rows, H, device="cuda", dtype=torch.bfloat16)
        _chain(x, w, gu_w, down_w, gu_q, gu_s, buf)          # compile and tune outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = _chain(x, w, gu_w, down_w, gu_q, gu_s, buf)
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        outs[budget] = [t.clone() for t in y]
    for a, b in zip(outs[0], outs[mb]):
        assert torch.equal(a, b)
