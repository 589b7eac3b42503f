"""plot_generate's data shaping (the plotting itself needs matplotlib, not installed in CI)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from plot_generate import series  # noqa: E402


def test_latest_row_per_system_and_batch_sorted_by_batch():
    rows = [dict(preset="31b", layers=12, prompt=128, system=s, batch=b, ms_per_step=ms, roofline_ms=b / 10)
            for s, b, ms in [("eager", 32, 20.0), ("eager", 1, 16.0), ("gemma4opt", 1, 9.0), ("gemma4opt", 1, 4.0)]]
    rows.append(dict(rows[0], preset="e4b", ms_per_step=1.0))
    lines, roof = series(rows, preset="31b")
    assert lines == {"eager": [(1, 16.0), (32, 20.0)], "gemma4opt": [(1, 4.0)]}
    assert roof == [(1, 0.1), (32, 3.2)]
