"""benchmarks/bench_generate.py's diagnosis of token differences: the first differing generated step
and eager's top-2 logit margin there."""
import importlib.util
import os
import sys

import torch

_DIR = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _bench():
    sys.path.insert(0, _DIR)
    spec = importlib.util.spec_from_file_location("bench_generate", os.path.join(_DIR, "bench_generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_first_divergence_finds_the_earliest_step_over_rows():
    bench = _bench()
    eager = torch.tensor([[9, 9, 1, 2, 3, 4], [9, 9, 5, 6, 7, 8]])
    margins = torch.arange(8, dtype=torch.float32).view(2, 4)
    assert bench.first_divergence(eager.clone(), eager, margins, 4) is None
    other = eager.clone()
    other[0, 5] = 0                 # row 0: generated step 3
    other[1, 3] = 0                 # row 1: generated step 1, the earliest
    assert bench.first_divergence(other, eager, margins, 4) == (1, 5.0)


def test_eager_margins_are_top1_minus_top2_of_the_teacher_forced_logits():
    from tests.models import prompt, tiny

    bench = _bench()
    model = tiny("tiny")
    ids = prompt(3, 5)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        logits = model(out[:, :-1]).logits[:, -4:].float()
    top2 = logits.topk(2, dim=-1).values
    got = bench.eager_margins(model, out, 4, rows_per_pass=2)
    assert got.shape == (3, 4) and (got >= 0).all()
    torch.testing.assert_close(got, top2[..., 0] - top2[..., 1])
