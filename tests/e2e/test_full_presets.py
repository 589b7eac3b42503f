"""Full-depth real-dimension presets, captured on the meta device: every block fused, counts as the formulas say."""
import pytest
import torch

import gemma4opt
from gemma4opt.presets import PRESETS, build_model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_full_depth_report_is_complete(preset):
    model = build_model(preset, dtype=torch.bfloat16, device="meta")
    gemma4opt.optimize(model)
    with torch.no_grad():
        out = model(torch.zeros(1, 4, dtype=torch.long, device="meta"), use_cache=False)
    assert out.logits.shape == (1, 4, 262144)
    rep = gemma4opt.report(model, print_table=False)
    assert rep.rows and all(r.complete and not r.unfused for r in rep.rows), str(rep)
    assert rep.row("rms_norm").matched > 200     # a real model, not an empty graph
