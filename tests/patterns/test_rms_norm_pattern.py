import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from tests.patterns.helpers import Compiled


class Norms(torch.nn.Module):
    """Three HF norms (weighted, weightless, on a 4-D head view) around other math."""

    def __init__(self, d=24, head=8):
        super().__init__()
        self.a = Gemma4RMSNorm(d, eps=1e-6)
        self.b = Gemma4RMSNorm(d, eps=1e-5, with_scale=False)
        self.h = Gemma4RMSNorm(head, eps=1e-6)
        with torch.no_grad():
            self.a.weight.normal_(1.0, 0.3)
            self.h.weight.normal_(1.0, 0.3)
        self.head = head

    def forward(self, x):
        y = self.a(x) * 2 + 1
        z = self.b(y)
        heads = self.h(z.view(*z.shape[:-1], -1, self.head))
        return heads.flatten(-2) + z


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_count_numerics_coverage(dtype):
    m = Norms().to(dtype)
    x = torch.randn(2, 5, 24, dtype=dtype)
    c = Compiled(m, ["rms_norm"])
    out = c(x)
    assert c.matched("rms_norm") == 3
    assert c.unfused("rms_norm") == []
    torch.testing.assert_close(out, m(x), rtol=0, atol=0)   # reference op == HF math, bit for bit
    ops = c.ops()
    # coverage: no op of a norm block is left around it
    for leftover in ("pow", "mean", "type_as", "float"):
        assert ops[leftover] == 0, (leftover, ops)
    assert c.gemma4opt_ops()["rms_norm"] == 3


class PlusOneNorm(Gemma4RMSNorm):
    """A Gemma-2/3 style (1 + weight) norm under the Gemma-4 class name: must not be matched."""

    def forward(self, x):
        xf = x.float()
        # transformers renamed the norm's eps attribute (eps, then variance_epsilon in 5.25)
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.good = Gemma4RMSNorm(16)
        self.odd = PlusOneNorm(16)

    def forward(self, x):
        return self.odd(self.good(x))


def test_unrecognized_norm_is_left_unfused_with_reason():
    PlusOneNorm.__name__ = "Gemma4RMSNorm"   # same type name as HF's: structure must decide
    m = Mixed()
    x = torch.randn(3, 16)
    c = Compiled(m, ["rms_norm"])
    out = c(x)
    assert c.matched("rms_norm") == 1
    reasons = c.unfused("rms_norm")
    assert len(reasons) == 1 and reasons[0].startswith("odd:") and "op sequence" in reasons[0]
    torch.testing.assert_close(out, m(x), rtol=0, atol=0)
