"""On the GPU machine: the MoE layers' experts branch on a side stream inside the decode graphs
(patterns/moe_streams.py, compiler/streams.py). The graphs must fork (one fork per MoE layer per
captured graph), and generate must give the same scores, bit for bit, as the same model without the
pass: the same kernels on the same inputs, only on two streams, so any race or missed dependency
shows as a difference. bf16 and fp8 weights, batch 1 and 8 (pair by pair and expert by expert)."""
import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.patterns import PATTERN_NAMES
from gemma4opt.presets import build_model
from gemma4opt.compiler import streams

pytestmark = pytest.mark.gpu

WITHOUT = tuple(p for p in PATTERN_NAMES if p != "moe_streams")


def _scores(model, ids, new=24):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("batch", [1, 8])
def test_two_streams_give_one_streams_bits(quantization, batch):
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (batch, 40), device="cuda")
    runs = {}
    for name, patterns in (("one stream", WITHOUT), ("two streams", PATTERN_NAMES)):
        model = build_model("26b-a4b", layers=3, dtype=torch.bfloat16, device="cuda", seed=1)
        forks = streams.FORKS["captured"]
        gemma4opt.optimize(model, Gemma4OptConfig(quantization=quantization, patterns=patterns))
        runs[name] = _scores(model, ids)
        rows = {r.pattern: r for r in gemma4opt.report(model, print_table=False).rows}
        if patterns == PATTERN_NAMES:
            assert rows["moe_streams"].complete and rows["moe_streams"].matched_per_graph[-1] == 3
            assert streams.FORKS["captured"] - forks >= 3, "no decode graph forked"
        else:
            assert "moe_streams" not in rows and streams.FORKS["captured"] == forks
        del model
    (seq1, sc1), (seq2, sc2) = runs["one stream"], runs["two streams"]
    assert torch.equal(seq1, seq2)
    assert torch.equal(sc1, sc2)
