"""profile_host.py on CPU: the host-time row it writes (the tiny preset, a few tokens)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_host  # noqa: E402


def test_writes_the_step_time_of_the_shallow_model_and_of_the_full_one(tmp_path):
    out = tmp_path / "host.jsonl"
    profile_host.main(["--preset", "tiny", "--layers", "2", "--prompt", "8", "--new", "4", "--full",
                       "--json", str(out)])
    row = json.loads(out.read_text())
    assert (row["preset"], row["layers"], row["batch"], row["new"], row["device"]) == ("tiny", 2, 1, 4, "cpu")
    assert 0 < row["host_ms_per_step"] < float("inf") and 0 < row["full_ms_per_step"] < float("inf")
