"""The block-scaled FP8 GEMM (kernels/fp8_block_linear.py) against ops/fp8_block.py's reference.
The kernel quantizes x's groups itself: the same fp32 division and e4m3 rounding as the reference,
so the quantized bytes agree and the two differ only in fp32 sum order and where the scales are
applied (per group tile against once per dequantized element). Under the interpreter the e4m3
products are exact in fp32; compiled for sm_90 the fp8 MMA's partials are promoted per
instruction, within conftest.close_fp8_mma's bound (test_compiles_for_sm90.py checks the e4m3 wgmma).
The MoE pairs compiled: that bound on gate_up's outputs moves down's input quantization as a bf16
rounding does, so the fp32 case there is held to the bf16 bound."""
import pytest
import torch

from gemma4opt.kernels import fp8_block_linear as k
from gemma4opt.kernels.fp8_block_linear import fp8_block_linear_triton
from gemma4opt.ops.fp8_block import (dequantize_blocks_reference, dequantized_groups_reference,
                                     fp8_block_linear_reference, quantize_blocks_reference)
from tests.kernels.conftest import DEVICE, DTYPES, close, close_fp8_mma, record_tuned_launches


def _operands(rows, n, k_, block_n, block_k, dtype=torch.float32, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed + rows * 1000 + n + k_)
    x = torch.randn(*lead, rows, k_, generator=g) * torch.rand(*lead, rows, 1, generator=g) * 4
    # columns of very different sizes: each group's scale differs from the row's
    x = x * torch.linspace(0.05, 3, k_)
    w = torch.randn(n, k_, generator=g) / k_ ** 0.5 * torch.linspace(0.2, 2, n)[:, None]
    wq, ws = quantize_blocks_reference(w, block_n, block_k)
    return x.to(dtype).to(DEVICE), wq.to(DEVICE), ws.to(DEVICE)


def _check(got, x, wq, ws, bn, bk):
    n = wq.shape[0]
    close_fp8_mma(got.reshape(-1, n), fp8_block_linear_reference(x.float(), wq, ws, bn, bk).reshape(-1, n),
                  dequantized_groups_reference(x.float(), bk).reshape(-1, x.shape[-1]),
                  dequantize_blocks_reference(wq, ws, bn, bk), x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k_,bn,bk", [(1, 72, 100, 16, 32), (3, 40, 96, 32, 32), (16, 33, 130, 128, 128),
                                              (17, 50, 70, 32, 64), (40, 24, 64, 24, 32), (70, 45, 200, 128, 64)])
def test_matches_reference(dtype, rows, n, k_, bn, bk):
    """Decode and prefill row counts, N and K not multiples of the tiles or blocks, block_n above,
    equal to and below the kernel's BLOCK_N (and not a power of two: 24)."""
    x, wq, ws = _operands(rows, n, k_, bn, bk, dtype)
    got = fp8_block_linear_triton(x, wq, ws, bn, bk)
    assert got.shape == (rows, n) and got.dtype == dtype
    _check(got, x, wq, ws, bn, bk)


@pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=1, SWAP=True),
                                    dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=3, SWAP=True),
                                    dict(BLOCK_M=32, BLOCK_N=16, SPLIT_K=4, SWAP=True),
                                    dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=8, SWAP=True),
                                    dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2, SWAP=False),
                                    dict(BLOCK_M=16, BLOCK_N=16),
                                    dict(BLOCK_M=1, BLOCK_N=16, GROUPS=1),
                                    dict(BLOCK_M=1, BLOCK_N=4, GROUPS=2, SPLIT_K=2),
                                    dict(BLOCK_M=1, BLOCK_N=8, GROUPS=8, SPLIT_K=3)])
@pytest.mark.parametrize("rows", [1, 5])
def test_explicit_tiles_transposed_or_split(config, rows):
    """W rows as the dot's M side or x's rows, or one row a program in FMAs (BLOCK_M 1), its groups
    GROUPS an iteration (8 groups of 32 over 4 and a bit: the last iteration masks a short group and
    three whole ones); K split in whole groups (K = 100 is 4 groups of 32, the last short; 3 splits
    leave one empty, 8 leave four), summed in split order by the split-sum kernel."""
    x, wq, ws = _operands(rows, 50, 100, 16, 32, seed=config.get("SPLIT_K", 1))
    _check(fp8_block_linear_triton(x, wq, ws, 16, 32, config), x, wq, ws, 16, 32)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_ue8m0_scales(rows):
    """Tile scales as UE8M0 (powers of two, one exponent byte each: scale_fmt="ue8m0"), as the kernel
    reads them (2^(b - 127)), for decode and prefill tiles."""
    x, wq, ws = _operands(rows, 50, 96, 16, 32)
    w = (wq.float() * ws.repeat_interleave(16, 0)[:50].repeat_interleave(32, 1)).cpu()
    s = torch.exp2(torch.ceil(torch.log2(ws.cpu())))              # each tile's scale, rounded up
    q = (w / s.repeat_interleave(16, 0)[:50].repeat_interleave(32, 1)).to(torch.float8_e4m3fn)
    s8 = s.to(torch.float8_e8m0fnu)
    assert torch.equal(s8.float(), s)
    q, s8 = q.to(DEVICE), s8.to(DEVICE)
    _check(fp8_block_linear_triton(x, q, s8, 16, 32), x, q, s8, 16, 32)


def test_keeps_leading_dims_and_reads_a_strided_weight_row_block():
    """A decode step's [batch, 1, K] input; a weight whose rows are a block of a wider one (row stride
    of the whole) with that block's scales."""
    x, wq, ws = _operands(1, 64, 96, 16, 32, lead=(4,))
    got = fp8_block_linear_triton(x, wq[16:48], ws[1:3], 16, 32)
    assert got.shape == (4, 1, 32)
    _check(got, x, wq[16:48], ws[1:3], 16, 32)


def test_zero_groups_and_rows_give_exact_zeros():
    """An all-zero token, an all-zero group of another (its scale at the minimum: no 0 / 0) and an
    all-zero weight tile."""
    x, wq, ws = _operands(3, 40, 96, 16, 32)
    x[1] = 0
    x[2, 32:64] = 0
    wq[16:32] = 0
    got = fp8_block_linear_triton(x, wq, ws, 16, 32)
    assert (got[1] == 0).all() and (got[:, 16:32] == 0).all() and got.isfinite().all()
    _check(got, x, wq, ws, 16, 32)


def test_refuses_what_it_cannot_run_and_empty_inputs():
    x, wq, ws = _operands(2, 40, 96, 16, 32)
    with pytest.raises(ValueError, match="block_k=48; the kernel takes"):
        fp8_block_linear_triton(x, wq, ws, 16, 48)
    with pytest.raises(ValueError, match="does not match"):
        fp8_block_linear_triton(x[:, :64], wq, ws, 16, 32)
    with pytest.raises(ValueError, match=r"weight_scale_inv \(3, 3\).*want \(3, 3\) float32 or float8_e8m0fnu"):
        fp8_block_linear_triton(x, wq, ws[:, :3].double().contiguous(), 16, 32)
    with pytest.raises(ValueError, match="want"):
        fp8_block_linear_triton(x, wq, ws[:2], 16, 32)
    with pytest.raises(ValueError, match="at most 16 splits"):
        fp8_block_linear_triton(x, wq, ws, 16, 32, dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=32, SWAP=True))
    with pytest.raises(ValueError, match="GROUPS > 1 only with BLOCK_M 1"):
        fp8_block_linear_triton(x, wq, ws, 16, 32, dict(BLOCK_M=16, BLOCK_N=16, GROUPS=2, SWAP=True))
    with pytest.raises(ValueError, match="up to 32"):
        fp8_block_linear_triton(*_operands(40, 40, 96, 16, 32), 16, 32, dict(BLOCK_M=64, BLOCK_N=16, SPLIT_K=2))
    assert fp8_block_linear_triton(x[:0], wq, ws, 16, 32).shape == (0, 40)


@pytest.mark.parametrize("rows,classes", [(1, {1, 16}), (9, {16}), (32, {32}), (33, {64, 128})])
def test_autotuned_launch_binds_every_parameter_and_tunes_per_row_class(monkeypatch, rows, classes):
    """The autotuned entry, with the kernel launch and its timing replaced (they need a GPU): every
    candidate and the final launch bind each kernel parameter, ROWS keys the row class, and the
    candidates are that class's tiles (one row: the MMA's 16-row tiles and the FMA's one-row tiles;
    17-32 rows: at most 4 K splits, their partials being 32 rows of N)."""
    launches = record_tuned_launches(monkeypatch, k, k._tuned)
    x, wq, ws = _operands(rows, 40, 256, 128, 128)
    fp8_block_linear_triton(x, wq, ws, 128, 128)
    assert {b["ROWS"] for b in launches} == {k.row_class(rows)}
    assert {b["BLOCK_M"] for b in launches[:-1]} == classes
    assert all(b["BLOCK_K"] == 128 and b["BN_W"] == 128 for b in launches)
    split = 16 if rows <= 16 else 4 if rows <= 32 else 1
    assert all(b["SPLIT_K"] <= split for b in launches)
    assert len(launches) == 1 + sum(c.kwargs["BLOCK_M"] in classes and c.kwargs["SPLIT_K"] <= split
                                    for c in k._tuned.configs)


def _experts(E, n, k_, bn, bk, seed):
    g = torch.Generator().manual_seed(seed)
    qs = [quantize_blocks_reference(torch.randn(n, k_, generator=g) / k_ ** 0.5, bn, bk) for _ in range(E)]
    return torch.stack([q for q, _ in qs]).to(DEVICE), torch.stack([s for _, s in qs]).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,topk,E,H,I,bn,bk", [(1, 2, 5, 64, 48, 16, 32), (3, 2, 4, 70, 40, 32, 32),
                                                  (6, 3, 7, 96, 64, 64, 64)])
def test_moe_pairs_equal_the_experts_reference(dtype, T, topk, E, H, I, bn, bk):
    """FP8Experts at decode (ops/moe_experts_fp8_block.py's CUDA path, run here by the interpreter):
    the pairs GEMM for gate_up and down around gelu_tanh_mul, each (token, expert) pair reading its
    expert's tiles (experts shared by several tokens, H and I not whole blocks), against transformers'
    loop over experts in the reference; their fp32 sums differ in order only. In bf16 that order may
    round a gate_up output to the neighbouring bf16 value, and down's input quantization carries that
    to the whole group's scale or to the next e4m3 step of an element (2^-4 of it): outputs move by a
    bf16 step or two on average, none by more than 2^-4 of the largest (the fp32 case checks the math)."""
    from gemma4opt.ops.fp8_block import moe_experts_fp8_block_reference
    from gemma4opt.ops.moe_experts_fp8_block import moe_pairs

    gu, gus = _experts(E, 2 * I, H, bn, bk, seed=T)
    dn, dns = _experts(E, H, I, bn, bk, seed=T + 1)
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(T, H, generator=g) * 2).to(dtype).to(DEVICE)
    idx = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, topk, generator=g).to(DEVICE)
    got = moe_pairs(x, idx, w, gu, gus, dn, dns, bn, bk)
    want = moe_experts_fp8_block_reference(x, idx, w, gu, gus, dn, dns, bn, bk)
    assert got.shape == x.shape and got.dtype == dtype
    _check_experts(got, want)


def _check_experts(got, want):
    if got.dtype == torch.float32 and DEVICE != "cuda":
        return close(got, want, torch.float32)
    err, scale = (got.float() - want.float()).abs(), want.float().abs()
    assert err.max() <= 2 ** -4 * scale.max() and err.mean() <= 2 ** -5 * scale.mean(), (err.max(), err.mean())


def test_moe_pairs_with_a_stack_left_in_the_model_dtype():
    """down [E, H, I] left unquantized by the checkpoint (I = 40, not whole 32-blocks): the pairs GEMM
    multiplies it as it is (F.linear's math), its scales unread; gate_up in fp8 as above."""
    from gemma4opt.ops.fp8_block import moe_experts_fp8_block_reference
    from gemma4opt.ops.moe_experts_fp8_block import moe_pairs

    E, H, I, T, topk = 5, 64, 40, 3, 2
    gu, gus = _experts(E, 2 * I, H, 32, 32, seed=3)
    g = torch.Generator().manual_seed(4)
    dn = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(DEVICE)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    idx = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, topk, generator=g).to(DEVICE)
    none = torch.empty(0).to(DEVICE)
    got = moe_pairs(x, idx, w, gu, gus, dn, none, 32, 32)
    _check_experts(got, moe_experts_fp8_block_reference(x, idx, w, gu, gus, dn, none, 32, 32))


@pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=16, SWAP=True), dict(BLOCK_M=1, BLOCK_N=8, GROUPS=2),
                                    dict(BLOCK_M=1, BLOCK_N=16, GROUPS=4)])
@pytest.mark.parametrize("fp8", [True, False])
def test_moe_pairs_tiles_equal_each_pairs_linear(config, fp8):
    """Each pairs tile (the MMA's, padded to 16 rows; the FMA's, one row) against the block GEMM's
    reference per pair: pair p is x's row p // topk through expert idx[p] (K = 100: 3 whole groups
    of 32 and a short one; a stack in the model's dtype is F.linear's)."""
    E, N, K, T, topk = 4, 40, 100, 3, 2
    wq, ws = _experts(E, N, K, 16, 32, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, K, generator=g).to(DEVICE)
    idx = torch.tensor([3, 0, 1, 3, 2, 0]).to(DEVICE)
    w = wq if fp8 else (torch.randn(E, N, K, generator=g) / K ** 0.5).to(DEVICE)
    got = k.fp8_block_pairs_triton(x, idx, topk, w, ws, 16, 32, config)
    for p in range(T * topk):
        e = int(idx[p])
        if fp8:
            _check(got[p:p + 1], x[p // topk:p // topk + 1], wq[e], ws[e], 16, 32)
        else:
            close(got[p], x[p // topk] @ w[e].T, torch.float32)


def test_moe_pairs_refuse_mismatched_operands():
    gu, gus = _experts(3, 64, 64, 32, 32, seed=0)
    x = torch.randn(2, 64).to(DEVICE)
    idx = torch.tensor([0, 2, 1, 1]).to(DEVICE)
    with pytest.raises(ValueError, match="4 pairs of 2 rows x top-1"):
        k.fp8_block_pairs_triton(x, idx, 1, gu, gus, 32, 32)
    with pytest.raises(ValueError, match="scales"):
        k.fp8_block_pairs_triton(x, idx, 2, gu, gus[:, :1], 32, 32)
    with pytest.raises(ValueError, match="block_k 48"):
        k.fp8_block_pairs_triton(x, idx, 2, gu, gus, 32, 48)
