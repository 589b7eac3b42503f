"""Compile Triton kernels for sm_90 (H100 / H200) on a machine without a GPU: Triton's front end,
its passes and the ptxas bundled with the triton wheel, no driver. Run as a script by
test_compiles_for_sm90.py, outside the interpreter (TRITON_INTERPRET unset: under it @triton.jit
makes interpreted functions, which do not compile). Prints one JSON line per kernel variant:
its name, whether it compiled, and the error or ptxas's registers and spill bytes.

The interpreter runs a kernel's Python; this catches what only compiling finds (constructs the
front end refuses, type and layout errors, register spills) in kernels not yet run on a GPU.
"""
from __future__ import annotations

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

from gemma4opt.kernels import (add_rms_norm, norm_fp8_linear, norm_linear, paged_decode, rope_cos_sin,  # noqa: E402
                               skinny_linear)

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
BF16 = "*bf16"
TAIL = dict(X=BF16, R=BF16, W1=BF16, SCALE=BF16, W2=BF16, S=BF16, eps1="fp32", eps2="fp32")


def _variants():
    """(name, kernel, pointer / scalar types, constexprs, num_warps or compile options) for each variant
    checked (the decode attention's as kernels/paged_decode.py's launch_config launches it)."""
    nl = dict(TAIL, W=BF16, Y=BF16, P="*fp32", M="i32", N="i32", K="i32", swn="i32", sym="i32")
    for nxt in (True, False):
        for has_scale in (True, False):
            for bn, bk, split, warps in ((4, 512, 1, 4), (1, 4096, 1, 8), (4, 512, 2, 4)):
                yield (f"norm_linear next={nxt} scale={has_scale} tile={bn}x{bk}/{split} w{warps}",
                       norm_linear._norm_linear_kernel, nl,
                       dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SWAP=False, BLOCK_D=4096, NEXT=nxt,
                            HAS_SCALE=has_scale, COMPILED=True, PDL=True, CAP=0.0), warps)
    nf = dict(TAIL, W="*fp8e4nv", WS="*fp32", Y=BF16, N="i32", K="i32", swn="i32")
    for has_scale in (True, False):
        for bn, bk, warps in ((8, 2048, 4), (4, 2048, 8)):
            yield (f"norm_fp8_linear scale={has_scale} tile={bn}x{bk} w{warps}", norm_fp8_linear._norm_fp8_linear_kernel,
                   nf, dict(BLOCK_N=bn, BLOCK_K=bk, BLOCK_D=4096, HAS_SCALE=has_scale, COMPILED=True, PDL=True), warps)
    for has_scale in (True, False):
        yield (f"add_rms_norm scale={has_scale}", add_rms_norm._add_rms_norm_kernel,
               dict(X=BF16, R=BF16, W1=BF16, SCALE=BF16, W2=BF16, S=BF16, N=BF16, sx="i32", sr="i32", ss="i32",
                    sn="i32", D="i32", eps1="fp32", eps2="fp32"), dict(HAS_SCALE=has_scale, BLOCK=4096, PDL=True), 8)
    yield ("rope_cos_sin", rope_cos_sin._rope_cos_sin_kernel,
           dict(POS="*i64", INV="*fp32", COS=BF16, SIN=BF16, scaling="fp32", HALF="i32"),
           dict(BLOCK=128, COMPILED=True, PDL=True), 2)
    decode = dict(Q=BF16, KV=BF16, KV_SCALE="*fp32", TABLE="*i32", LENS="*i32", O=BF16, OP="*fp32", LSE="*fp32",
                  **{n: "i32" for n in ("sq_b", "sq_h", "s_page", "s_kv", "s_tok", "s_head", "s_table", "ring", "so_b",
                                        "so_h", "sp_b", "sp_h", "sp_s", "sl_b", "sl_h", "window")}, scale="fp32")
    for early in (True, False):
        for fp8 in (False, True):
            yield (f"decode attention split early={early} fp8={fp8}", paged_decode._decode_split_kernel,
                   dict(decode, KV="*fp8e4nv" if fp8 else BF16),
                   dict(GROUP=4, G_PAD=16, D=256, PS=16, BLOCK_N=32, NSPLIT=64, TOKENS=1, COMPILED=True, IEEE=False,
                        FP8=fp8, F16=fp8, V_WIDE=True, EARLY=early, PDL=True),
                   dict(num_warps=4, num_stages=2, **({"maxnreg": 128} if fp8 else {})))
    for bn, bk, split in ((4, 512, 2), (8, 1024, 4)):
        yield (f"skinny one-row split {bn}x{bk}/{split}", skinny_linear._skinny_kernel,
               dict(X=BF16, U=BF16, W=BF16, Y=BF16, P="*fp32", M="i32", N="i32", K="i32", sxm="i32", sum_="i32",
                    swn="i32", sym="i32"),
               dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, COMPILED=True, IEEE=False, SWAP=False, PDL=True,
                    CAP=0.0, GELU=False), 4)


def _ptxas(ptx: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    return dict(regs=int(regs[0]) if regs else None, spill_bytes=int(spills[0]) if spills else None)


def main() -> None:
    for name, fn, types, constexprs, warps in _variants():
        names = fn.arg_names
        try:
            src = ASTSource(fn=fn, signature={n: types[n] for n in names if n not in constexprs},
                            constexprs={(names.index(n),): v for n, v in constexprs.items()})
            options = warps if isinstance(warps, dict) else dict(num_warps=warps)
            compiled = triton.compile(src, target=TARGET, options=options)
            row = dict(name=name, ok=True, **_ptxas(compiled.asm["ptx"]))
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            row = dict(name=name, ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
