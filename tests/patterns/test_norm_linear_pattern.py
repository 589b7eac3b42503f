"""norm_linear: the residual tails that feed a q/k/v or per-layer-input gate GEMM, on the real HF
modules (a prefill that slices before the KV-shared layers included), the op off CUDA, and refusals."""
import torch
from transformers.models.gemma4 import modeling_gemma4

import gemma4opt  # noqa: F401  (registers the ops)
from gemma4opt.compiler.regions import op_name
from gemma4opt.ops.norm_linear import norm_linear_reference
from gemma4opt.patterns import build_patterns
from tests.models import prompt, tiny
from tests.patterns.helpers import Compiled

# transformers >= 5.2x slices generate's prefill to its last position before the KV-shared layers;
# earlier ones (the GPU machine's 5.17) run them on every position.
SLICES_BEFORE_SHARED = hasattr(modeling_gemma4.Gemma4TextModel, "_maybe_slice_kv_shared_inputs")
BEFORE = ["rms_norm", "merged_projections", "residual_norm", "norm_add", "decode_linear"]


def test_prefill_slicing_before_kv_shared_layers_slices_the_tails_inputs():
    """With logits_to_keep (generate's prefill), transformers keeps only the last position before the
    first KV-shared layer: the tail there is fused on its sliced inputs, with the same logits (a
    transformers that does not slice there leaves no tail sliced)."""
    model = tiny("tiny-ple-shared")
    ids = prompt(2, 9)
    with torch.no_grad():
        want = model(ids, logits_to_keep=1).logits
    c = Compiled(model, BEFORE + ["norm_linear"], text_config=model.config)
    got = c(ids, logits_to_keep=1).logits
    assert c.matched("norm_linear") == build_patterns()["norm_linear"].expected(model.config, "causal_lm")
    assert c.unfused("norm_linear") == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fused = [n for n in c.graphs[-1].graph.nodes if "norm_linear" in str(n.target)]
    sliced = [n for n in fused if op_name(n.args[0]) == op_name(n.args[1]) == "getitem"]
    if SLICES_BEFORE_SHARED:
        assert len(sliced) == 1 and sliced[0].args[0].args[1][1] == slice(-1, None, None)
    else:
        assert sliced == []


class QProj(torch.nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k) / k ** 0.5)

    def forward(self, x):
        return torch.ops.gemma4opt.linear.default(x, self.weight)


class Tail(torch.nn.Module):
    """A residual tail feeding a module named q_proj, as residual_norm and decode_linear leave them
    (the ops' default overloads); ``leak`` also returns its normed output."""

    def __init__(self, leak=False, k=16):
        super().__init__()
        self.q_proj = QProj(8, k)
        self.w1, self.w2 = torch.nn.Parameter(1 + torch.rand(k)), torch.nn.Parameter(1 + torch.rand(k))
        self.leak = leak

    def forward(self, x, r):
        s, n = torch.ops.gemma4opt.add_rms_norm.default(x, r, self.w1, 1e-6, None, self.w2, 1e-6)
        y = self.q_proj(n)
        return (s, y, n) if self.leak else (s, y)


def test_fuses_a_tail_whose_norm_only_the_gemm_reads():
    x, r = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    m = Tail()
    want = m(x, r)
    c = Compiled(m, ["norm_linear"])
    got = c(x, r)
    assert c.matched("norm_linear") == 1 and c.gemma4opt_ops()["add_rms_norm"] == 0
    assert all(torch.equal(g, w) for g, w in zip(got, want))      # off CUDA: the two ops themselves


def test_refuses_a_tail_whose_norm_is_read_elsewhere():
    x, r = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    c = Compiled(Tail(leak=True), ["norm_linear"])
    c(x, r)
    assert c.matched("norm_linear") == 0 and c.gemma4opt_ops()["add_rms_norm"] == 1


def test_op_off_cuda_is_the_two_ops():
    x, r = torch.randn(1, 1, 16, dtype=torch.bfloat16), torch.randn(1, 1, 16, dtype=torch.bfloat16)
    w1, w2 = torch.rand(16, dtype=torch.bfloat16) + 1, torch.rand(16, dtype=torch.bfloat16) + 1
    w, scale = torch.randn(8, 16, dtype=torch.bfloat16), torch.tensor([0.5], dtype=torch.bfloat16)
    s, y = torch.ops.gemma4opt.norm_linear(x, r, w1, 1e-6, scale, w2, 1e-5, w)
    want_s, want_n = torch.ops.gemma4opt.add_rms_norm(x, r, w1, 1e-6, scale, w2, 1e-5)
    assert torch.equal(s, want_s) and torch.equal(y, torch.nn.functional.linear(want_n, w))
    s, y = torch.ops.gemma4opt.norm_linear(x, r, w1, 1e-6, None, None, 1e-6, w)
    want = torch.ops.gemma4opt.norm_add(x, w1, 1e-6, r, None, 1e-6, False)
    assert torch.equal(s, want) and torch.equal(y, torch.nn.functional.linear(want, w))
    assert all(torch.equal(a, b) for a, b in zip((s, y), norm_linear_reference(x, r, w1, 1e-6, None, None, 1e-6, w)))


def test_fp8_op_off_cuda_is_the_two_ops():
    from gemma4opt.ops.fp8 import quantize_rows_reference

    x, r = torch.randn(1, 1, 16, dtype=torch.bfloat16), torch.randn(1, 1, 16, dtype=torch.bfloat16)
    w1, w2 = torch.rand(16, dtype=torch.bfloat16) + 1, torch.rand(16, dtype=torch.bfloat16) + 1
    wq, ws = quantize_rows_reference(torch.randn(8, 16))
    s, y = torch.ops.gemma4opt.norm_fp8_linear(x, r, w1, 1e-6, None, w2, 1e-5, wq, ws, torch.bfloat16)
    want_s, q, qs = torch.ops.gemma4opt.add_rms_norm_quant(x, r, w1, 1e-6, None, w2, 1e-5)
    assert torch.equal(s, want_s) and torch.equal(y, torch.ops.gemma4opt.fp8_linear(q, qs, wq, ws, torch.bfloat16))


def test_a_refused_tail_says_why():
    c = Compiled(Tail(leak=True), ["norm_linear"])
    c(torch.randn(1, 3, 16), torch.randn(1, 3, 16))
    assert len(c.unfused("norm_linear")) == 1 and "q/k/v" in c.unfused("norm_linear")[0]
