"""profile_decode's per-step table: the prefill profile is subtracted kernel by kernel."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_decode  # noqa: E402


def test_prefill_kernels_are_subtracted_and_fully_spent_ones_dropped():
    full = {"nvjet_gemm": [300.0, 4], "_skinny_kernel": [100.0, 10], "copy_kernel": [10.0, 2]}
    prefill = {"nvjet_gemm": [280.0, 2], "copy_kernel": [10.0, 2], "only_in_prefill": [5.0, 1]}
    assert profile_decode.subtract(full, prefill) == {"nvjet_gemm": [20.0, 2], "_skinny_kernel": [100.0, 10]}


def test_gemma4opt_kernels_land_in_their_categories(capsys):
    kernels = {"_skinny_kernel": [60.0, 6], "_decode_split_kernel": [24.0, 12], "_merge_kernel": [6.0, 6]}
    profile_decode.print_categories(kernels, 2, "decode step")
    lines = capsys.readouterr().out.splitlines()
    gemm = next(line for line in lines if line.strip().startswith("gemm "))
    attention = next(line for line in lines if line.strip().startswith("attention "))
    assert gemm.split()[1] == "30.0" and attention.split()[1] == "15.0"
