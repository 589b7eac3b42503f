"""Whether the decode attention's default launch compiles to the same sm_90 machine code as at another commit.

    python benchmarks/sass_unchanged.py f55d10b

On a CPU-only machine (Triton's bundled ptxas and cuobjdump), the split kernel at the e4b's two geometries
(head_dim 256 and 512, 4 query heads a KV head), bf16 and fp8 pools, and the merge kernel, compiled from
``git show <rev>:gemma4opt/kernels/paged_decode.py`` and from the working tree, their SASS compared
instruction by instruction. Parameter offsets in the constant bank (c[0x0][...]) and instruction encodings
are left out: a kernel argument added or removed moves them without changing what runs. Flags one version
has and the other lacks take their off values (compile_split_kernel). Prints "same" or the first
differences, so that GPU figures measured at <rev> can be said to hold for a change that touched the file.
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sass_decode_attention import compile_split_kernel, sass_of  # noqa: E402


def _module(path: str):
    spec = importlib.util.spec_from_file_location(f"pd_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _merge_kernel(pd):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(pd._merge_kernel.arg_names)
    const = dict(NSPLIT=64, S_PAD=64, BLOCK_D=64, PDL=True)
    sig = {n: "constexpr" if n in const else {"OP": "*fp32", "LSE": "*fp32", "O": "*bf16"}.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in const and n != "sl_h"}
    src = ASTSource(fn=pd._merge_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2))


def kernels(pd) -> dict:
    """name -> compiled kernel, for one version of kernels/paged_decode.py: as generate launches them at one
    row (64 splits, PDL on)."""
    out = {f"split head_dim={hd} fp8={fp8}": compile_split_kernel(hd, 4, fp8, rows=1, splits=64, pdl=True,
                                                                  module=pd)[0]
           for hd in (256, 512) for fp8 in (False, True)}
    out["merge"] = _merge_kernel(pd)
    return out


def instructions(kernel) -> list[str]:
    """The SASS instructions, without addresses, encodings or constant-bank offsets."""
    sass, _ = sass_of(kernel.asm["cubin"])
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    return [re.sub(r"/\*.*?\*/", "", re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", line)).strip() for line in lines]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the commit to compare the working tree's kernels with")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old_src = subprocess.run(["git", "show", f"{args.rev}:gemma4opt/kernels/paged_decode.py"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(old_src)
    try:
        old = kernels(_module(f.name))
    finally:
        os.unlink(f.name)
    new = kernels(_module(os.path.join(root, "gemma4opt", "kernels", "paged_decode.py")))
    differ = 0
    for name in new:
        a, b = instructions(old[name]), instructions(new[name])
        if a == b:
            print(f"{name}: same ({len(b)} instructions)")
            continue
        differ += 1
        diff = list(difflib.unified_diff(a, b, args.rev, "working tree", lineterm="", n=0))
        print(f"{name}: differs ({len(a)} -> {len(b)} instructions)", *diff[:20], sep="\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
