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


def test_idle_gaps_count_the_union_of_overlapping_kernels(capsys):
    """Idle time is the span minus the kernels' union: an overlapping kernel hides no gap, and the
    gap after it is measured from the later end."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def k(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [k("host_op", 0, 500, DeviceType.CPU), k("a", 0, 10), k("b", 5, 20), k("c", 22, 30), k("d", 50, 60)]
    profile_decode.idle_gaps(SimpleNamespace(events=lambda: events), launches_per_step=2, steps=2)
    out = capsys.readouterr().out
    assert "30.0 us per step, idle 11.0 us per step" in out      # span 60, gaps 2 + 20 over 2 steps
    assert "1-3us 1.0" in out and ">10us 10.0" in out
    assert "c -> d" in out.splitlines()[2]
    # The last step's kernels in order, each with the idle time before it (from the latest end).
    listing = out[out.index("the last decode step in order (2 kernels)"):].splitlines()[1:]
    assert [line.split() for line in listing] == [["0.0", "8.0", "c"], ["20.0", "10.0", "d"]]
