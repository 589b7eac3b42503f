"""Compile Triton kernels for sm_90 (H100 / H200) on a machine without a GPU: Triton's front end,
its passes and the ptxas bundled with the triton wheel, no driver. Run as a script by
test_compiles_for_sm90.py, outside the interpreter (TRITON_INTERPRET unset: under it @triton.jit
makes interpreted functions, which do not compile). Prints one JSON line per kernel variant:
its name, whether it compiled, and the error or ptxas's registers and spill bytes.

The interpreter runs a kernel's Python; this catches what only compiling finds (constructs the
front end refuses, type and layout errors, register spills) in kernels not yet run on a GPU.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET") != "1", "run outside Triton's interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.sass_decode_attention import compile_split_kernel  # noqa: E402
from gemma4opt.kernels import (add_rms_norm, fp8_block_linear, fp8_linear, gate_up_gelu, moe_experts,  # noqa: E402
                               norm_fp8_linear, norm_linear, rope_cos_sin, skinny_linear)

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
BF16 = "*bf16"
TAIL = dict(X=BF16, R=BF16, W1=BF16, SCALE=BF16, W2=BF16, S=BF16, eps1="fp32", eps2="fp32")


def _variants():
    """(name, kernel, pointer / scalar types, constexprs, num_warps) for each variant checked. Integer
    arguments are the e4b's (N, K and row strides multiples of 16), specialized as Triton does at run time."""
    nl = dict(TAIL, W=BF16, Y=BF16, P="*fp32", M="i32", N="i32", K="i32", swn="i32", sym="i32")
    for nxt, has_scale in ((True, True), (True, False), (False, False)):     # as the pattern makes them
            for bn, bk, split, warps in ((4, 512, 1, 4), (1, 4096, 1, 8), (4, 512, 2, 4)):
                yield (f"norm_linear next={nxt} scale={has_scale} tile={bn}x{bk}/{split} w{warps}",
                       norm_linear._norm_linear_kernel, nl,
                       dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SWAP=False, BLOCK_D=4096, NEXT=nxt,
                            HAS_SCALE=has_scale, COMPILED=True, PDL=True, CAP=0.0), warps)
    # The 31b's row (5376 in a block of 8192), on the tiles whose registers it raises most.
    for bn, bk, warps in ((16, 512, 4), (1, 8192, 4), (2, 8192, 8)):
        yield (f"norm_linear 31b row tile={bn}x{bk} w{warps}", norm_linear._norm_linear_kernel, nl,
               dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, SWAP=False, BLOCK_D=8192, NEXT=True,
                    HAS_SCALE=True, COMPILED=True, PDL=True, CAP=0.0), warps)
    nf = dict(TAIL, W="*fp8e4nv", WS="*fp32", Y=BF16, N="i32", K="i32", swn="i32")
    for has_scale in (True, False):
        for bn, bk, warps in ((8, 2048, 4), (4, 2048, 8)):
            yield (f"norm_fp8_linear scale={has_scale} tile={bn}x{bk} w{warps}", norm_fp8_linear._norm_fp8_linear_kernel,
                   nf, dict(BLOCK_N=bn, BLOCK_K=bk, BLOCK_D=4096, HAS_SCALE=has_scale, COMPILED=True, PDL=True), warps)
    for bn, bk, warps in ((8, 2048, 4), (8, 2048, 8)):
        yield (f"norm_fp8_linear 31b row tile={bn}x{bk} w{warps}", norm_fp8_linear._norm_fp8_linear_kernel, nf,
               dict(BLOCK_N=bn, BLOCK_K=bk, BLOCK_D=8192, HAS_SCALE=True, COMPILED=True, PDL=True), warps)
    for has_scale in (True, False):
        yield (f"add_rms_norm scale={has_scale}", add_rms_norm._add_rms_norm_kernel,
               dict(X=BF16, R=BF16, W1=BF16, SCALE=BF16, W2=BF16, S=BF16, N=BF16, sx="i32", sr="i32", ss="i32",
                    sn="i32", D="i32", eps1="fp32", eps2="fp32"), dict(HAS_SCALE=has_scale, BLOCK=4096, PDL=True), 8)
    yield ("rope_cos_sin", rope_cos_sin._rope_cos_sin_kernel,
           dict(POS="*i64", INV="*fp32", COS=BF16, SIN=BF16, scaling="fp32", HALF="i32"),
           dict(BLOCK=128, COMPILED=True, PDL=True), 2)
    sk = dict(X=BF16, U=BF16, W=BF16, Y=BF16, P="*fp32", M="i32", N="i32", K="i32", sxm="i32", sum_="i32",
              swn="i32", sym="i32")
    for bn, bk, split in ((4, 512, 2), (8, 1024, 4)):
        yield (f"skinny one-row split {bn}x{bk}/{split}", skinny_linear._skinny_kernel, sk,
               dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, COMPILED=True, IEEE=False, SWAP=False, PDL=True,
                    CAP=0.0, GELU=False), 4)
    # The one-row row sums' K loop, plain and pipelined (PIPE): "row sums" / "pipelined" in the name.
    for pipe in (0, 3):
        kind = f"pipelined {pipe}" if pipe else "row sums"
        for bn, bk, split, warps, gelu in ((4, 512, 1, 4, False), (16, 512, 1, 8, False), (8, 512, 4, 4, False),
                                           (4, 512, 1, 4, True)):
            yield (f"skinny {kind} {bn}x{bk}/{split} w{warps} gelu={gelu}", skinny_linear._skinny_kernel, sk,
                   dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, COMPILED=True, IEEE=False, SWAP=False,
                        PDL=True, CAP=0.0, GELU=gelu, PIPE=pipe), warps)
        for bn, bk in ((8, 512), (8, 2048)):
            yield (f"fp8_linear {kind} {bn}x{bk}", fp8_linear._fp8_linear_kernel,
                   dict(X="*fp8e4nv", XS="*fp32", W="*fp8e4nv", WS="*fp32", Y=BF16, P="*fp32", M="i32", N="i32", K="i32",
                        sxm="i32", swn="i32", sym="i32", ROWS="i32"),
                   dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, COMPILED=True, SWAP=False, PDL=True, CAP=0.0,
                        PIPE=pipe), 4)
        yield (f"norm_linear {kind} 4x512", norm_linear._norm_linear_kernel, nl,
               dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, SWAP=False, BLOCK_D=4096, NEXT=True, HAS_SCALE=True,
                    COMPILED=True, PDL=True, CAP=0.0, PIPE=pipe), 4)
        yield (f"norm_fp8_linear {kind} 8x512", norm_fp8_linear._norm_fp8_linear_kernel, nf,
               dict(BLOCK_N=8, BLOCK_K=512, BLOCK_D=4096, HAS_SCALE=True, COMPILED=True, PDL=True, PIPE=pipe), 4)
        # The MoE decode kernels at the 26b-a4b's shapes (H 2816, I 704), bf16 and fp8 experts, their tiles.
        for fp8, (gu_n, gu_k, gu_w, dn_n, dn_w) in ((False, (8, 256, 8, 2, 4)), (True, (8, 512, 8, 2, 2))):
            wdt = "*fp8e4nv" if fp8 else BF16
            yield (f"moe gate_up {kind} fp8={fp8}", moe_experts._gate_up_kernel,
                   dict(X=BF16, IDX="*i64", GU=wdt, GS="*fp32", ACT=BF16, H="i32", I="i32", sxt="i32", sge="i32",
                        sgn="i32"),
                   dict(TOPK=8, BLOCK_N=gu_n, BLOCK_K=gu_k, COMPILED=True, FP8=fp8, PDL=True, PIPE=pipe), gu_w)
            yield (f"moe down {kind} fp8={fp8}", moe_experts._down_kernel,
                   dict(ACT=BF16, IDX="*i64", WT="*fp32", D=wdt, DS="*fp32", OUT=BF16, H="i32", I="i32", sde="i32",
                        sdn="i32"),
                   dict(TOPK=8, J=8, BLOCK_N=dn_n, BLOCK_K=256, COMPILED=True, FP8=fp8, PDL=True, PIPE=pipe), dn_w)
    # FineGrainedFP8 linears: every autotuned tile (128 x 128 blocks), bf16 activations quantized in the kernel.
    fb = dict(X=BF16, W="*fp8e4nv", WS="*fp32", Y=BF16, P="*fp32", IDX="*i64", M="i32", N="i32", K="i32", sxm="i32",
              swn="i32", swsn="i32", sym="i32", swe="i32", swse="i32", ROWS="i32")
    for c in fp8_block_linear._configs():
        kw = c.kwargs
        yield (f"fp8_block_linear {kw['BLOCK_M']}x{kw['BLOCK_N']}/{kw['SPLIT_K']} swap={kw.get('SWAP', False)} "
               f"g{kw.get('GROUPS', 1)} w{c.num_warps} s{c.num_stages}", fp8_block_linear._fp8_block_linear_kernel, fb,
               dict(kw, BN_W=128, BLOCK_K=128, COMPILED=True, PDL=True), c.num_warps, c.num_stages)
    # UE8M0 tile scales (their exponent bytes), at decode and prefill rows
    for bm, bn, w in ((16, 64, 4), (64, 128, 8)):
        yield (f"fp8_block_linear {bm}x{bn}/1 ue8m0", fp8_block_linear._fp8_block_linear_kernel, dict(fb, WS="*u8"),
               dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, SWAP=bm <= 32, BN_W=128, BLOCK_K=128, COMPILED=True, PDL=True,
                    E8M0=True), w, 3)
    # its MoE pairs (one (token, expert) pair a program, top-8 as the 26b-a4b routes), e4m3 experts and a
    # stack left in bf16 (the 26b-a4b's down at 128 x 128 blocks)
    for fp8_w in (True, False):
        yield (f"fp8_block_linear pairs 16x64 w4 s3 fp8_w={fp8_w}", fp8_block_linear._fp8_block_linear_kernel,
               dict(fb, W="*fp8e4nv" if fp8_w else BF16),
               dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, SWAP=True, BN_W=128, BLOCK_K=128, COMPILED=True, PDL=True,
                    TOPK=8, FP8_W=fp8_w), 4, 3)
        yield (f"fp8_block_linear pairs 1x4 g8 w4 s3 fp8_w={fp8_w}", fp8_block_linear._fp8_block_linear_kernel,
               dict(fb, W="*fp8e4nv" if fp8_w else BF16),
               dict(BLOCK_M=1, BLOCK_N=4, GROUPS=8, SPLIT_K=1, BN_W=128, BLOCK_K=128, COMPILED=True, PDL=True,
                    TOPK=8, FP8_W=fp8_w), 4, 3)

    # The fp8 GEMM quantizing a bf16 input itself (QUANT: o_proj, the MLP's down): a one-row row sum, the
    # dot tiles at 1 (padded), 16 and 32 rows, split and not; the e4b's dense gate/up GEMV on e4m3 weights.
    fq = dict(X=BF16, XS="*fp32", W="*fp8e4nv", WS="*fp32", Y=BF16, P="*fp32", M="i32", N="i32", K="i32",
              sxm="i32", swn="i32", sym="i32", ROWS="i32")
    yield ("fp8_linear quant one-row 8x2048", fp8_linear._fp8_linear_kernel, fq,
           dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=2048, SPLIT_K=1, COMPILED=True, SWAP=False, PDL=True, CAP=0.0, QUANT=True), 4)
    for bm, bn, bk, split, warps in ((16, 64, 256, 1, 4), (16, 64, 128, 4, 4), (32, 128, 256, 1, 8), (32, 64, 256, 2, 4)):
        yield (f"fp8_linear quant dot {bm}x{bn}x{bk}/{split}", fp8_linear._fp8_linear_kernel, fq,
               dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, COMPILED=True, SWAP=True, PDL=True, CAP=0.0,
                    QUANT=True), warps)
    for bn, bk, warps in ((8, 512, 8), (16, 512, 8)):
        yield (f"gate_up_gelu fp8 {bn}x{bk} w{warps}", gate_up_gelu._gate_up_gelu_kernel,
               dict(X="*fp8e4nv", W="*fp8e4nv", OUT=BF16, H="i32", I="i32", sxt="i32", swn="i32", sot="i32", XS="*fp32",
                    WS="*fp32", AMAX="*fp32"),
               dict(BLOCK_N=bn, BLOCK_K=bk, COMPILED=True, PDL=True, FP8=True, HAS_AMAX=True), warps)
    yield ("fp8_linear quant from-parts one-row 8x2048", fp8_linear._fp8_linear_kernel, dict(fq, PARTS="*fp32", NPARTS="i32"),
           dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=2048, SPLIT_K=1, COMPILED=True, SWAP=False, PDL=True, CAP=0.0, QUANT=True,
                FROM_PARTS=True), 4)


def _ptxas(ptx: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    return dict(regs=int(regs[0]) if regs else None, spill_bytes=int(spills[0]) if spills else None)


def _compile(fn, types: dict, constexprs: dict, warps: int, stages: int = 3):
    names = fn.arg_names
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    constexprs = {**{n: v for n, v in defaults.items() if n not in types}, **constexprs}   # as a launch leaves them
    # Pointers (torch allocations) and the integers that are multiples of 16 at the e4b's shapes:
    # Triton specializes both at run time, and without it the code (and its registers) differ.
    divisible = [n for n in names if n not in constexprs and (types[n].startswith("*") or n in _DIVISIBLE_INTS)]
    src = ASTSource(fn=fn, signature={n: types[n] for n in names if n not in constexprs},
                    constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))


_DIVISIBLE_INTS = ("N", "K", "swn", "sym", "sot", "sx", "sr", "ss", "sn", "D", "sxm", "sum_", "H", "I", "sxt", "sge", "sgn",
                   "sde", "sdn", "swsn", "swe", "swse")


def _rows():
    for name, fn, types, constexprs, warps, *stages in _variants():
        yield name, lambda: _compile(fn, types, constexprs, warps, *stages)
    for fp8 in (False, True):           # the e4b's geometry (head_dim 256, 4 query heads a KV head), as launched
        yield (f"decode attention split fp8={fp8}", lambda fp8=fp8: compile_split_kernel(256, 4, fp8, rows=1)[0])


def main() -> None:
    for name, build in _rows():
        try:
            ptx = build().asm["ptx"]
            row = dict(name=name, ok=True, cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                       fp8_wgmma=len(re.findall(r"wgmma\.mma_async\.\S*e4m3\.e4m3", ptx)), **_ptxas(ptx))
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            row = dict(name=name, ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
