"""bench_generate's hf-fp8 systems: transformers' own FineGrainedFP8 path (its FP8Linear forward),
with the finegrained-fp8 kernel loaded from a local package (benchmarks/hf_fp8_kernel.py). The real
kernel is Triton that needs a GPU; here a stand-in package with its entry points runs the block-scaled
reference (tests/conftest.py's stand_in_kernel), to check that HF's forward reaches the loaded kernel and
the system measures."""
import pytest

from tests.test_bench_generate_divergence import _bench


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
