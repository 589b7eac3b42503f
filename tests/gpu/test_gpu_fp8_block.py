"""On the GPU machine: FineGrainedFP8 checkpoints. gemma4opt::fp8_block_linear's Triton GEMM
(its activations quantized inside it, the fp8 MMA) against the fp32 reference at the real models'
projection shapes and decode / prefill row counts, and an optimized FineGrainedFP8 model (made by
transformers' own replace_with_fp8_linear and Fp8Quantize, 128 x 128 blocks) against the same
modules run unoptimized with the reference as their forward: transformers' own kernel loads from the
`kernels` hub, which the GPU machine cannot reach."""
import copy

import pytest
import torch

import gemma4opt
import gemma4opt.ops  # noqa: F401
from gemma4opt.ops.fp8 import FP8_DTYPE
from gemma4opt.ops.fp8_block import (fp8_block_linear_reference, moe_experts_fp8_block_reference,
                                     quantize_blocks_reference)
from gemma4opt.ops.fp8_checkpoint import adopted, is_hf_fp8_linear
from gemma4opt.presets import build_model, finegrained_fp8_
from tests.models import fp8_checkpoint_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 8, 32, 200])
def test_fp8_experts_op_equals_reference(tokens):
    """The 26b-a4b's experts (128 of H 2816, I 704, top 8) in 64 x 64 blocks: decode's pairs GEMMs (up
    to 1024 pairs) and prefill's loop of the Triton GEMM per expert, against the reference."""
    from gemma4opt.ops.moe_experts_fp8_block import MAX_PAIRS

    torch.manual_seed(tokens)
    E, H, I, k = 128, 2816, 704, 8

    def stack(n, kk):
        qs = [quantize_blocks_reference(torch.randn(n, kk, device="cuda") / kk ** 0.5, 64, 64) for _ in range(E)]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])

    (gu, gus), (dn, dns) = stack(2 * I, H), stack(H, I)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, device="cuda")
    got = torch.ops.gemma4opt.moe_experts_fp8_block(x, idx, w, gu, gus, dn, dns, 64, 64)
    want = moe_experts_fp8_block_reference(x, idx, w, gu, gus, dn, dns, 64, 64)
    err, scale = (got.float() - want.float()).abs(), want.float().abs()
    print(f"fp8 experts {tokens} tokens ({'pairs' if tokens * k <= MAX_PAIRS else 'per expert'}): max |err| "
          f"{err.max():.4g} of max {scale.max():.4g}, mean {err.mean():.4g} of {scale.mean():.4g}")
    # bf16 roundings in another order carried by down's input quantization (kernel test's docstring)
    assert err.max() <= 2 ** -4 * scale.max() and err.mean() <= 2 ** -5 * scale.mean()


@pytest.mark.parametrize("rows", [1, 2, 8, 32, 40, 2048])
@pytest.mark.parametrize("n,k", [(8192, 5376), (5376, 8192), (2560, 10240), (20480, 2560), (512, 2560)])
def test_block_gemm_equals_reference(rows, n, k):
    """The 31b's q and o_proj, the e4b's down, gate/up and a narrow k_proj."""
    torch.manual_seed(rows + n)
    x = (torch.randn(rows, k, device="cuda") * torch.linspace(0.1, 3, k, device="cuda")).to(torch.bfloat16)
    wq, ws = quantize_blocks_reference(torch.randn(n, k, device="cuda") / k ** 0.5, 128, 128)
    got = torch.ops.gemma4opt.fp8_block_linear(x, wq, ws, 128, 128)
    want = fp8_block_linear_reference(x.float(), wq, ws, 128, 128)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # bf16 output rounding on values of size ~1, and fp32 sum-order differences
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)


# The 26b-a4b at 128 x 128: transformers leaves its experts' 704-wide down_proj (and the dense MLP's
# 2112 rows) in bf16, the experts op multiplies that stack as it is; at 64 x 64 every stack is e4m3.
@pytest.mark.parametrize("preset,block", [("e4b", 128), ("31b", 128), ("26b-a4b", 128), ("26b-a4b", 64)])
def test_optimized_finegrained_fp8_model_against_the_reference_path(preset, block):
    """Paged decode in CUDA graphs over the FP8Linear projections (and FP8Experts: the pairs GEMMs):
    the logits of a prefill and the greedy tokens of a short generate against the unoptimized modules
    with the reference forward."""
    model = build_model(preset, layers=4, dtype=torch.bfloat16, device="cuda")
    bf16 = copy.deepcopy(model)
    finegrained_fp8_(model, (block, block))
    ref = fp8_checkpoint_reference(model)
    ids = torch.randint(3, 1000, (2, 64), device="cuda")
    with torch.no_grad():
        want_bf16 = bf16(ids).logits.float()
        eager = ref(ids).logits.float()
        gemma4opt.optimize(model)
        fused = model(ids).logits.float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    err_eager, err_fused = (eager - want_bf16).abs().mean().item(), (fused - want_bf16).abs().mean().item()
    same = (out == want).all(1).float().mean().item()
    print(f"{preset} FineGrainedFP8: mean |logit - bf16| reference path {err_eager:.4f}, gemma4opt {err_fused:.4f}; "
          f"greedy sequences equal {same:.0%}; {gemma4opt.report(model, print_table=False).weights}")
    assert model._gemma4opt.config.attention == "paged"
    assert all(adopted(m) for m in model.modules()
               if (is_hf_fp8_linear(m) and m.weight.dtype == FP8_DTYPE) or type(m).__name__ == "FP8Experts")
    assert err_eager > 0 and err_fused <= 1.5 * err_eager + 1e-3
    assert out.shape == (2, 80)
