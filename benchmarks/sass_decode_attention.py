"""The paged decode kernel compiled for sm_90 without a GPU: its tile loop's SASS, counted by opcode.

    python benchmarks/sass_decode_attention.py                        # the 31b's sliding layer, fp8 pool
    python benchmarks/sass_decode_attention.py --head-dim 512 --group 8 --block-n 64 --warps 8
    python benchmarks/sass_decode_attention.py --v-staged-fp8         # v staged in fp8 (the kernel's V_WIDE off)

Triton compiles kernels/paged_decode.py's split kernel for an H100/H200 target (ptxas and cuobjdump
ship with Triton's wheel; no driver is needed), with the launch configuration that
``launch_config`` picks unless one is given. It prints the shared memory and registers a program
takes (with spilled bytes), and the instructions of the loop over KV tiles (the kernel's longest
backward branch) by opcode: a way to see, on a CPU-only machine, what a change does to the loop
before timing it on a GPU (benchmarks/bench_attention.py). Pointers and strides are assumed
16-byte divisible, as Triton specializes them at run time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_INT_ARGS = ("sq_b", "sq_h", "s_page", "s_kv", "s_tok", "s_head", "s_table", "ring", "so_b", "so_h", "sp_b", "sp_h",
             "sp_s", "sl_b", "sl_h", "window")
# Arguments Triton would find 16-divisible at run time (ring, window, s_table and sl_h need not be).
_DIVISIBLE = ("Q", "KV", "KV_SCALE", "TABLE", "LENS", "O", "OP", "LSE", "CNT", "sq_b", "sq_h", "s_page", "s_kv", "s_tok",
              "s_head", "so_b", "so_h", "sp_b", "sp_h", "sp_s", "sl_b")


def compile_split_kernel(head_dim: int, group: int, fp8: bool = True, config: dict | None = None, page_size: int = 16,
                         rows: int = 32, v_wide: bool = True, splits: int = 2, pdl: bool = False, module=None):
    """The split kernel compiled for sm_90 (a triton CompiledKernel: .asm holds ttgir, ptx, cubin), from
    ``module`` (another version of kernels/paged_decode.py; default: this one's). Arguments a version
    lacks are left out; flags it has that this one lacks take their off values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gemma4opt.kernels import paged_decode

    pd = module or paged_decode
    cfg = {**pd.launch_config(head_dim, rows, fp8), **(config or {})}
    sig = {"Q": "*bf16", "KV": "*fp8e4nv" if fp8 else "*bf16", "KV_SCALE": "*fp32", "TABLE": "*i32", "LENS": "*i32",
           "O": "*bf16", "OP": "*fp32", "LSE": "*fp32", "CNT": "*i32", **{n: "i32" for n in _INT_ARGS},
           "scale": "fp32"}
    const = dict(GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, PS=page_size,
                 BLOCK_N=cfg["block_n"], NSPLIT=splits, TOKENS=1, COMPILED=True, IEEE=False, FP8=fp8,
                 F16=bool(cfg.get("f16")) and fp8, V_WIDE=v_wide, PDL=pdl,
                 # flags of older versions, since removed, off: reads before the PDL wait (EARLY), the
                 # merge in the split kernel (MERGE, its counters CNT, S_PAD and BLOCK_D with it)
                 EARLY=False, MERGE=False, S_PAD=triton.next_power_of_2(splits), BLOCK_D=min(head_dim, 64))
    names = list(pd._decode_split_kernel.arg_names)
    const = {k: v for k, v in const.items() if k in names}
    sig.update({k: "constexpr" for k in const})
    sig = {n: sig[n] for n in names}
    src = ASTSource(fn=pd._decode_split_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in _DIVISIBLE if k in names})
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), cfg


def _cuobjdump() -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")


def sass_of(cubin: bytes) -> tuple[str, str]:
    """(SASS listing, resource usage line) of a cubin, through Triton's bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return sass, res


_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_.]+)")


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (with their modifiers) of the longest loop: the instructions between the target of
    the longest backward branch and that branch."""
    ins = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), line))
    loops = []
    for addr, op, line in ins:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", line.split("BRA", 1)[1])
            if t and int(t.group(1), 16) < addr:
                loops.append((int(t.group(1), 16), addr))
    if not loops:
        raise ValueError("no backward branch in the SASS: the tile loop was not found")
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    return collections.Counter(op for addr, op, _ in ins if lo <= addr <= hi)


def describe(head_dim: int, group: int, fp8: bool, config: dict | None, v_wide: bool, rows: int) -> dict:
    kernel, cfg = compile_split_kernel(head_dim, group, fp8, config, rows=rows, v_wide=v_wide)
    sass, res = sass_of(kernel.asm["cubin"])
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    ops = loop_opcodes(sass)
    return dict(config=cfg, shared=kernel.metadata.shared, registers=int(m.group(1)), spilled=int(m.group(2)),
                loop_instructions=sum(ops.values()), opcodes=ops)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--group", type=int, default=2, help="query heads per KV head (the 31b: 2 sliding, 8 full)")
    ap.add_argument("--kv-dtype", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--rows", type=int, default=32, help="the rows launch_config is asked for")
    ap.add_argument("--block-n", type=int)
    ap.add_argument("--warps", type=int)
    ap.add_argument("--stages", type=int)
    ap.add_argument("--maxnreg", type=int)
    ap.add_argument("--v-staged-fp8", action="store_true", help="the kernel's V_WIDE off")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sass_decode_attention: unset TRITON_INTERPRET (it compiles the kernel, not interprets it)")
    config = {k: v for k, v in dict(block_n=args.block_n, num_warps=args.warps, num_stages=args.stages,
                                    maxnreg=args.maxnreg).items() if v is not None}
    d = describe(args.head_dim, args.group, args.kv_dtype == "fp8", config, not args.v_staged_fp8, args.rows)
    if args.json:
        print(json.dumps({**d, "opcodes": dict(d["opcodes"])}))
        return
    print(f"# config {d['config']}; shared {d['shared']} B; registers {d['registers']}, spilled {d['spilled']} B")
    print(f"# tile loop: {d['loop_instructions']} instructions")
    for op, n in d["opcodes"].most_common(args.top):
        print(f"{n:6d}  {op}")


if __name__ == "__main__":
    main()
