"""A quantized checkpoint's own linear modules (transformers' FP8Linear, bitsandbytes' Linear4bit,
...) keep their packed weights and their own forward: never merged, split or swapped; the report
says so, and generate's tokens equal HF eager's on the same model. Stand-in here: an int8
weight-only nn.Linear subclass that dequantizes in its forward (the real ones need a GPU)."""
import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import prompt, tiny


class Int8Linear(torch.nn.Linear):
    """int8 weight + per-row scale as buffers; the forward dequantizes (a quantized checkpoint's module)."""

    def __init__(self, lin: torch.nn.Linear):
        super().__init__(lin.in_features, lin.out_features, bias=False, device="meta")
        scale = lin.weight.detach().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        del self.weight
        self.register_buffer("weight", torch.round(lin.weight.detach() / scale).to(torch.int8))
        self.register_buffer("weight_scale", scale)

    def forward(self, x):
        return x @ (self.weight.to(x.dtype) * self.weight_scale.to(x.dtype)).t()


def _quantized(variant="tiny"):
    model = tiny(variant)
    for module in model.modules():
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            lin = getattr(module, name, None)
            if type(lin) is torch.nn.Linear:
                setattr(module, name, Int8Linear(lin))
    return model


@pytest.mark.parametrize("variant", ["tiny", "tiny-ple-shared"])
def test_quantized_projections_run_their_own_forward(variant):
    model = _quantized(variant)
    ids = prompt(2, 9)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    packed = {n: b.clone() for n, b in model.named_buffers() if n.endswith(".weight")}
    gemma4opt.optimize(model)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    for n, b in model.named_buffers():      # the int8 weights: same dtype, values and own storage
        if n in packed:
            assert b.dtype == torch.int8 and torch.equal(b, packed[n])
    rep = gemma4opt.report(model, print_table=False)
    assert "quantized checkpoint's own modules" in rep.weights and "Int8Linear" in rep.weights
    row = rep.row("merged_projections")
    assert any("Int8Linear (not an nn.Linear): left to its own forward" in u for u in row.unfused), row.unfused


def test_fp8_quantization_skips_them_and_says_why():
    model = _quantized()
    ids = prompt(1, 7)
    gemma4opt.optimize(model, Gemma4OptConfig(quantization="fp8"))
    with torch.no_grad():
        model(ids)
    rep = gemma4opt.report(model, print_table=False)
    assert "not quantized, Int8Linear is not an nn.Linear" in rep.weights
    assert any(type(m).__name__ == "Int8Linear" for m in model.modules())


def test_tensor_parallel_refuses_them_before_changing_anything():
    model = _quantized()
    with pytest.raises(ValueError, match="splits plain nn.Linear projections only.*Int8Linear"):
        gemma4opt.optimize(model, Gemma4OptConfig(tensor_parallel=True))
    assert not hasattr(model, "_gemma4opt")
