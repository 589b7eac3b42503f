"""benchmarks/bench_tp.py under torchrun on CPU (gloo, two ranks, the tiny preset): gemma4opt's
split, and HF's own tp_plan="auto" where accelerate is installed, both with greedy tokens equal to
HF eager on one process."""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tp_rows(tmp_path):
    systems = ["gemma4opt-tp"] + (["hf-tp"] if importlib.util.find_spec("accelerate") else [])
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    os.path.join(ROOT, "benchmarks", "bench_tp.py"), "--preset", "tiny", "--device", "cpu",
                    "--prompt", "16", "--new", "8", "--repeats", "1", "--save-dir", str(tmp_path / "ckpt"),
                    "--systems", *systems, "--json", str(out)], check=True, cwd=ROOT, env=env, timeout=900)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["system"] for r in rows] == [{"gemma4opt-tp": "gemma4opt-tp2", "hf-tp": "hf-tp2-static-compile"}[s]
                                           for s in systems]
    assert all(r["tokens_equal_eager"] and r["machine"] == "2 x cpu" and r["ms_per_step"] > 0 for r in rows)
