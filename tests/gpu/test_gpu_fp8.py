"""On the GPU machine: the FP8 ops at the real models' sizes, and the optimized fp8 model.
gemma4opt::fp8_linear's two CUDA branches — the skinny Triton GEMM (<= 32 rows) and
torch._scaled_mm with row-wise scales (more rows) — each against the fp32 reference, and the
fused producer + quantize ops against quantize_rows of the unfused Triton producer, bit for bit."""
import pytest
import torch

import gemma4opt.ops  # noqa: F401
from gemma4opt.ops import fp8_linear as fp8_op
from gemma4opt.ops.fp8 import fp8_linear_reference, quantize_rows_reference, quantize_weight_reference

pytestmark = pytest.mark.gpu


def _operands(rows, n, k):
    torch.manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_reference(w)
    return xq, xs, wq, ws


def _close(got, xq, xs, wq, ws):
    want = fp8_linear_reference(xq, xs, wq, ws, torch.float32)
    # bf16 output rounding (2^-8 relative) on values of size ~1, plus fp32 sum-order differences
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 2, 8, 32, 40, 256])
@pytest.mark.parametrize("n,k", [(5376, 8192), (2560, 2048), (16384, 5376)])
def test_fp8_linear_op_equals_reference(rows, n, k):
    xq, xs, wq, ws = _operands(rows, n, k)
    got = torch.ops.gemma4opt.fp8_linear(xq, xs, wq, ws, torch.bfloat16)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert fp8_op.triton_fits(xq, wq) == (rows <= fp8_op.MAX_ROWS)
    assert fp8_op.runs_scaled_mm(xq, wq, torch.bfloat16)
    _close(got, xq, xs, wq, ws)
    if rows <= fp8_op.MAX_ROWS:     # the first call timed both and kept a pick for the shape
        key = (rows, n, k, torch.bfloat16, xq.device.index)
        assert key in fp8_op.picks() or key in fp8_op.failures()
        print(f"fp8_linear {rows}x{n}x{k}: {'Triton' if fp8_op.picks().get(key) else '_scaled_mm'}")


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_both_branches_equal_the_reference_at_decode_rows(rows):
    """The Triton GEMM and torch._scaled_mm on the same decode-sized input (the op picks Triton)."""
    from gemma4opt.kernels.fp8_linear import fp8_linear_triton

    xq, xs, wq, ws = _operands(rows, 5376, 5376)
    _close(fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16), xq, xs, wq, ws)
    _close(fp8_op.scaled_mm(xq, xs, wq, ws, torch.bfloat16), xq, xs, wq, ws)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_other_output_dtypes_above_32_rows_take_the_reference(out_dtype):
    xq, xs, wq, ws = _operands(40, 256, 512)
    assert not fp8_op.runs_scaled_mm(xq, wq, out_dtype)
    got = torch.ops.gemma4opt.fp8_linear(xq, xs, wq, ws, out_dtype)
    assert got.dtype == out_dtype
    _close(got, xq, xs, wq, ws)


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_fused_quant_ops_equal_the_unfused_kernels_quantized(rows):
    """rms_norm_quant (31b hidden 5376), add_rms_norm_quant, gelu_tanh_mul_quant at the 31b's FFN
    width 21504 (in chunks, two passes) and the e4b's 10240: the same bytes and scales as
    quantize_rows of the unfused kernel's output at 1 and 32 rows (32 warps per row). At 300 rows
    (8 warps) rms_norm_quant's bytes differed from it on the H200 (1 of 1.6M, one fp8 ulp), and
    add_rms_norm_quant's residual sum from add_rms_norm's in places: two
    separately compiled kernels need not round alike (ptxas may contract a multiply and an add into
    one FMA in one and not the other), so there a norm value may land one bf16 ulp away, its byte one
    fp8 ulp away, and the row's scale one bf16 ulp of its amax away; the counts are printed."""
    from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton
    from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton
    from gemma4opt.kernels.rms_norm import rms_norm_triton

    def same(got, want):
        g, w = got[0].view(torch.uint8).to(torch.int16), want[0].view(torch.uint8).to(torch.int16)
        ulps = ((g & 0x7F) * (1 - 2 * (g >> 7)) - (w & 0x7F) * (1 - 2 * (w >> 7))).abs()
        scale_rel = ((got[1] - want[1]).abs() / want[1]).max().item()
        print(f"rows {rows}: {int((ulps > 0).sum())} of {ulps.numel()} bytes differ (max {int(ulps.max())} ulp), "
              f"{int((got[1] != want[1]).sum())} of {got[1].numel()} scales (max rel {scale_rel:.2g})")
        if rows <= 32:
            assert torch.equal(g, w) and torch.equal(got[1], want[1])
        else:
            assert int(ulps.max()) <= 1 and scale_rel <= 2 ** -7

    torch.manual_seed(rows)
    ops = torch.ops.gemma4opt
    x, r = torch.randn(rows, 5376, device="cuda", dtype=torch.bfloat16), torch.randn(rows, 5376, device="cuda",
                                                                                      dtype=torch.bfloat16)
    w1, w2 = torch.rand(2, 5376, device="cuda", dtype=torch.bfloat16) + 0.5
    same(ops.rms_norm_quant(x, w1, 1e-6), quantize_rows_reference(rms_norm_triton(x, w1, 1e-6)))
    scale = torch.tensor([0.7], device="cuda", dtype=torch.bfloat16)
    s, q, qs = ops.add_rms_norm_quant(x, r, w1, 1e-6, scale, w2, 1e-6)
    us, un = add_rms_norm_triton(x, r, w1, 1e-6, scale, w2, 1e-6)
    # The residual sum: equal at 1 and 32 rows. At 300 rows (8 warps) on the H200 6 of 1.6M sums
    # differed, by up to 11 bf16 ulps of a result near zero: one fp32 rounding apart before the
    # cancellation (separately compiled kernels contract differently), so bounded absolutely.
    diff = (s.float() - us.float()).abs()
    print(f"rows {rows}: {int((diff > 0).sum())} of {s.numel()} residual sums differ (max |diff| {diff.max():.2e})")
    assert torch.equal(s, us) if rows <= 32 else diff.max().item() <= 2 ** -8 * us.float().abs().max().item()
    same((q, qs), quantize_rows_reference(un))
    for d in (21504, 10240):
        gu = torch.randn(rows, 2 * d, device="cuda", dtype=torch.bfloat16) * 3
        g, u = gu[:, :d], gu[:, d:]
        same(ops.gelu_tanh_mul_quant(g, u), quantize_rows_reference(gelu_tanh_mul_triton(g, u)))


@pytest.mark.parametrize("preset", ["31b", "e4b", "26b-a4b"])
def test_optimized_fp8_error_no_worse_than_the_fp8_reference_path(preset):
    """quantization="fp8" at real dimensions: the optimized model (fused quantizing producers, the
    Triton / _scaled_mm fp8 GEMMs, CUDA graphs) against the same swap run by HF's eager forward,
    both measured against the bf16 model's logits; also greedy tokens of a short generate (on the
    26b-a4b its decode steps run the fp8 experts' Triton kernels, prefill their reference)."""
    import copy

    import gemma4opt
    from gemma4opt.ops.fp8_weights import quantize_linears
    from gemma4opt.presets import build_model

    model = build_model(preset, layers=8 if preset == "e4b" else 4, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(3, 1000, (2, 64), device="cuda")
    with torch.no_grad():
        bf16 = model(ids).logits.float()
        ref = copy.deepcopy(model)
        quantize_linears(ref)
        eager = ref(ids).logits.float()
        gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8"))
        fused = model(ids).logits.float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    err_eager, err_fused = (eager - bf16).abs().mean().item(), (fused - bf16).abs().mean().item()
    print(f"{preset}: mean |logit - bf16| fp8 reference path {err_eager:.4f}, gemma4opt fp8 {err_fused:.4f}")
    assert err_fused <= 1.5 * err_eager + 1e-3
    assert out.shape == (2, 72)
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows), str(rep)


def test_fp8_lm_head_decode_logits_no_worse_than_the_fp8_reference_path():
    """quantize_lm_head=True on the 31b's dimensions: the decode steps' logits (the lm_head's fp8
    GEMM with the softcap as its epilogue, in CUDA graphs) against the bf16 model's on the same
    tokens, no further off than the reference path's (the same swaps run by HF's eager forward)."""
    import copy

    import gemma4opt
    from gemma4opt.ops.fp8_weights import quantize_linears, quantize_lm_head
    from gemma4opt.presets import build_model

    model = build_model("31b", layers=2, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(3, 1000, (2, 64), device="cuda")
    with torch.no_grad():
        ref = copy.deepcopy(model)
        quantize_linears(ref)
        assert quantize_lm_head(ref) == {"Fp8Linear lm_head": 1}
        bf16 = copy.deepcopy(model)
        gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(quantization="fp8", quantize_lm_head=True))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        fused = torch.stack(out.logits, 1).float()[:, 1:]            # the decode steps' logits
        seq = out.sequences[:, :-1]
        pos = slice(ids.shape[1], seq.shape[1])
        eager = ref(seq).logits[:, pos].float()
        want = bf16(seq).logits[:, pos].float()
    err_eager, err_fused = (eager - want).abs().mean().item(), (fused - want).abs().mean().item()
    print(f"31b fp8 lm_head decode: mean |logit - bf16| reference path {err_eager:.4f}, gemma4opt {err_fused:.4f}")
    assert err_eager > 0 and err_fused <= 1.5 * err_eager + 1e-3
    rep = gemma4opt.report(model, print_table=False)
    assert all(r.complete for r in rep.rows), str(rep)
    assert rep.row("logit_softcap").matched == 1
