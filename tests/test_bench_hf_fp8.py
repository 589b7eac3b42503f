"""bench_generate's hf-fp8 systems: transformers' own FineGrainedFP8 path (its FP8Linear forward),
with the finegrained-fp8 kernel loaded from a local package (benchmarks/hf_fp8_kernel.py). The real
kernel is Triton that needs a GPU; here a stand-in package with its entry points runs the block-scaled
reference, to check that HF's forward reaches the loaded kernel and the system measures."""
import textwrap

import pytest

from tests.test_bench_generate_divergence import _bench

_STAND_IN = '''
from gemma4opt.ops.fp8_block import fp8_block_linear_reference
from ._ops import add_op_namespace_prefix   # the loader provides the module kernel-builder generates

CALLS = []


def matmul_2d(A, B, Bs, block_size, output_dtype=None, activation_scale=None):
    CALLS.append((tuple(A.shape), tuple(B.shape), tuple(block_size)))
    return fp8_block_linear_reference(A, B, Bs, *block_size).to(output_dtype or A.dtype)


def matmul_batched(*args, **kwargs):
    raise NotImplementedError


def matmul_grouped(*args, **kwargs):
    raise NotImplementedError
'''


@pytest.fixture
def hf_kernel_slot(monkeypatch):
    """The loader sets transformers' kernel slot and an environment variable: both restored after."""
    from transformers.integrations import finegrained_fp8

    monkeypatch.setattr(finegrained_fp8, "_FINEGRAINED_FP8", finegrained_fp8._FINEGRAINED_FP8)
    monkeypatch.setenv("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR", "0")


@pytest.fixture
def stand_in_kernel(tmp_path, hf_kernel_slot):
    """The path of a finegrained_fp8 package holding the stand-in above."""
    pkg = tmp_path / "finegrained_fp8"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(_STAND_IN))
    return pkg


def test_hf_fp8_runs_transformers_fp8_linears_on_the_loaded_kernel(stand_in_kernel):
    pkg = stand_in_kernel
    bench = _bench()
    rows = bench.main(["--preset", "tiny", "--prompt", "6", "--new", "4", "--repeats", "1", "--device", "cpu",
                       "--fp8-block", "16", "--hf-fp8-kernel", str(pkg), "--systems", "eager", "hf-fp8"])
    import sys

    calls = sys.modules["finegrained_fp8_local"].CALLS
    assert calls and all(block == (16, 16) for _, _, block in calls)
    assert {(r["system"], r["batch"]) for r in rows} == {("eager", 1), ("hf-fp8", 1)}
    hf = next(r for r in rows if r["system"] == "hf-fp8")
    eager = next(r for r in rows if r["system"] == "eager")
    assert hf["ms_per_step"] > 0 and hf["roofline_ms"] < eager["roofline_ms"], "fp8 weights: fewer bytes"


def test_a_missing_kernel_package_says_where_to_get_it(tmp_path, hf_kernel_slot):
    bench = _bench()
    with pytest.raises(FileNotFoundError, match="kernels-community"):
        bench.main(["--preset", "tiny", "--prompt", "6", "--new", "2", "--repeats", "1", "--device", "cpu",
                    "--fp8-block", "16", "--hf-fp8-kernel", str(tmp_path / "absent"), "--systems", "hf-fp8"])
