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


def test_full_depth_fp8_report_is_complete():
    """quantization="fp8" on the full 31b (meta): every projection fp8, 3 fused quantizations per layer."""
    model = build_model("31b", dtype=torch.bfloat16, device="meta")
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8"))
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long, device="meta"), use_cache=False)
    rep = gemma4opt.report(model, print_table=False)
    assert rep.rows and all(r.complete and not r.unfused for r in rep.rows), str(rep)
    assert rep.row("fp8_quant").matched == 3 * model.config.num_hidden_layers
    assert "410 linears" in rep.weights and "27.3 GiB (54.6 GiB in bfloat16)" in rep.weights
