"""The README's sample report: optimize the tiny preset on CPU, generate, print gemma4opt.report.

    python scripts/sample_report.py

tests/test_readme.py checks that the README's report block is this script's output.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("GEMMA4OPT_PROGRESS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gemma4opt  # noqa: E402
from gemma4opt.presets import build_model  # noqa: E402


def main() -> str:
    model = build_model("tiny", dtype=torch.float32, seed=0)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    gemma4opt.optimize(model)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False)
    return str(gemma4opt.report(model, print_table=False)).rstrip()


if __name__ == "__main__":
    print(main())
