import pytest
import torch
import torch.nn.functional as F
import triton

from gemma4opt.kernels.skinny_linear import MAX_ROWS, skinny_linear_triton
from gemma4opt.ops.gelu_tanh_mul import gelu_tanh_mul_reference as gelu_tanh_mul_ref
from tests.kernels.conftest import DEVICE, DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 5, 37), (1, 33, 100), (3, 17, 64), (16, 20, 45), (17, 33, 70),
                                      (MAX_ROWS, 7, 33)])
def test_matches_f_linear(dtype, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    close(skinny_linear_triton(x, w), F.linear(x.float(), w.float()).to(dtype), dtype)


def test_keeps_leading_dims_and_reads_strided_rows():
    # A decode step's [batch, 1, hidden] input, taken as a column slice of a wider buffer.
    buf = torch.randn(4, 1, 90, device=DEVICE)
    x = buf[..., 10:60]
    w = torch.randn(12, 50, device=DEVICE)
    got = skinny_linear_triton(x, w)
    assert got.shape == (4, 1, 12)
    close(got, F.linear(x, w), torch.float32)


def test_merged_weight_slice_rows():
    """The merged q/k/v weight's row block (a view with the full weight's row stride)."""
    merged = torch.randn(30, 40, device=DEVICE)
    x = torch.randn(2, 40, device=DEVICE)
    close(skinny_linear_triton(x, merged[8:20]), F.linear(x, merged[8:20]), torch.float32)


def test_refuses_too_many_rows_and_mismatched_weight():
    with pytest.raises(ValueError, match="at most 32"):
        skinny_linear_triton(torch.randn(MAX_ROWS + 1, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="does not match"):
        skinny_linear_triton(torch.randn(2, 8, device=DEVICE), torch.randn(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        skinny_linear_triton(torch.randn(2, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE).t())


def test_empty_inputs():
    assert skinny_linear_triton(torch.randn(0, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.parametrize("split", [1, 2, 3, 4])
@pytest.mark.parametrize("rows,n,k", [(2, 19, 100), (17, 33, 70), (MAX_ROWS, 16, 260)])
def test_split_k_sums_every_chunk(monkeypatch, split, rows, n, k):
    """Splits of K (the last ones short or empty when K does not divide) summed by the second kernel."""
    import gemma4opt.kernels.skinny_linear as sl

    if sl._COMPILED:
        pytest.skip("the interpreter's fixed config; compiled runs autotune the split")
    monkeypatch.setattr(sl, "_INTERPRETER_SPLIT", split)
    g = torch.Generator().manual_seed(split * 100 + rows)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    close(skinny_linear_triton(x, w), F.linear(x, w), torch.float32)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("rows,n,k", [(2, 70, 100), (17, 33, 70), (MAX_ROWS, 64, 260)])
def test_explicit_tiles_transposed_or_split(swap, split, rows, n, k):
    """Every tile the benchmark sweeps may pick: W rows as the dot's M side (SWAP) or x's rows,
    K unsplit or split (uneven chunks), N not a multiple of the tile."""
    g = torch.Generator().manual_seed(split * 10 + rows + swap)
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE)
    cfg = dict(BLOCK_N=16 if n < 64 else 64, BLOCK_K=32, SPLIT_K=split, SWAP=swap)
    close(skinny_linear_triton(x, w, cfg), F.linear(x, w), torch.float32)


@pytest.mark.parametrize("block_n,split", [(16, 8), (16, 16), (32, 8)])
@pytest.mark.parametrize("rows,n,k", [(2, 37, 300), (9, 50, 130), (MAX_ROWS, 33, 1000)])
def test_narrow_tiles_split_k_many_ways(block_n, split, rows, n, k):
    """The narrow GEMMs' tiles: 16-32 W rows, K in up to 16 chunks (many of them empty when K is short),
    N not a multiple of the tile."""
    g = torch.Generator().manual_seed(block_n + split + rows)
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE)
    cfg = dict(BLOCK_N=block_n, BLOCK_K=32, SPLIT_K=split, SWAP=True)
    close(skinny_linear_triton(x, w, cfg), F.linear(x, w), torch.float32)


def test_narrow_tiles_are_offered_to_narrow_n_at_two_rows_and_more():
    from gemma4opt.kernels import skinny_linear as sl

    def splits(N, bm):
        return {c.kwargs["SPLIT_K"] for c in sl._keep(sl._CONFIGS, dict(K=2560, N=N, BLOCK_M=bm))}
    assert max(splits(256, 32)) == 16 and max(splits(sl.NARROW_N, 16)) == 16
    assert max(splits(sl.NARROW_N + 1, 32)) == sl.WIDE_SPLIT == sl.max_split(sl.NARROW_N + 1)
    assert splits(256, 1) == {1}            # one row, a short K: the row sums, unsplit
    sl.use_tiles(narrow=False)
    try:
        assert max(splits(256, 32)) == sl.WIDE_SPLIT
    finally:
        sl.use_tiles()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n", [1, 2])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("n,k", [(7, 37), (33, 64), (5, 100)])
def test_whole_k_tile_at_one_row(dtype, block_n, gelu, n, k):
    """The one-row tiles that load all of K at once (BLOCK_K >= K, masked, one stage), N odd, with
    and without the gelu·mul input: the same sums as F.linear."""
    g = torch.Generator().manual_seed(n * 7 + k + block_n + gelu)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    up = torch.randn(1, k, generator=g).to(dtype).to(DEVICE) if gelu else None
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    cfg = dict(BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k), num_stages=1)
    a = gelu_tanh_mul_ref(x, up) if gelu else x
    close(skinny_linear_triton(x, w, cfg, up=up), F.linear(a.float(), w.float()).to(dtype), dtype)


def test_whole_k_tiles_are_offered_for_the_k_they_cover():
    from gemma4opt.kernels import skinny_linear as sl

    def offered(K, bm=1):
        return {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages)
                for c in sl._keep(sl._CONFIGS, dict(K=K, N=300, BLOCK_M=bm)) if c.kwargs["BLOCK_K"] in sl.WHOLE_K}
    assert {bk for _, bk, _ in offered(2560)} == {4096}        # e4b's q/k/v, PLE gate: K 2560
    assert {bk for _, bk, _ in offered(2048)} == {2048}
    assert {bk for _, bk, _ in offered(10240)} == {16384}      # e4b's MLP down
    assert all(st == 1 for _, _, st in offered(2560))
    assert offered(256) == set() and offered(40000) == set()    # nothing covers 256 alone, or 40000
    assert offered(2560, bm=16) == set()                        # the tensor-core path keeps its tiles
    sl.use_tiles(whole_k=False)
    try:
        assert offered(2560) == set()
    finally:
        sl.use_tiles()


def test_explicit_tile_refuses_what_it_cannot_run():
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="at most 16 splits"):
        skinny_linear_triton(x, w, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=32))
    wide = torch.randn(8193, 8, device=DEVICE)     # past NARROW_N: room for 4 splits only
    with pytest.raises(ValueError, match="at most 4 splits"):
        skinny_linear_triton(x, wide, dict(BLOCK_N=64, BLOCK_K=32, SPLIT_K=8, SWAP=True))
    with pytest.raises(ValueError, match="SWAP needs 2"):
        skinny_linear_triton(x[:1], w, dict(BLOCK_N=16, BLOCK_K=32, SWAP=True))


def _one_row_split(rows: int, split: int) -> dict | None:
    """The tile that splits K at one row (the interpreter's own one-row tile never splits, whatever
    _INTERPRETER_SPLIT says); None (that setting) for more rows."""
    return dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=split) if rows == 1 else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows,n,k", [(1, 37, 50), (3, 41, 70), (MAX_ROWS, 9, 33)])
def test_softcap_epilogue_matches_linear_then_softcap(monkeypatch, dtype, split, rows, n, k):
    """The lm_head's GEMM with the softcap in its store (and in the split sum's, split K)."""
    import gemma4opt.kernels.skinny_linear as sl
    from gemma4opt.ops.linear_softcap import linear_softcap_reference

    monkeypatch.setattr(sl, "_INTERPRETER_SPLIT", split)
    g = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 4).to(dtype).to(DEVICE)    # logits past the cap: tanh saturates
    got = skinny_linear_triton(x, w, _one_row_split(rows, split), cap=30.0)
    want = linear_softcap_reference(x, w, 30.0)
    if dtype == torch.bfloat16:     # logits of 8-32: a GEMM sum order off by one bf16 ulp is 0.06-0.125, x3 roundings
        torch.testing.assert_close(got.float(), want.float(), rtol=0.03, atol=0.4)
    else:
        close(got, want, dtype)
    assert got.abs().max() <= 30.0 and (want.abs() > 20).any()      # the cap is applied, and it matters
    assert not torch.allclose(skinny_linear_triton(x, w).float(), want.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("rows,n,k", [(1, 9, 70), (3, 17, 64), (20, 33, 45)])
def test_gelu_input_is_the_gelu_kernels_bits(monkeypatch, dtype, split, rows, n, k):
    """With ``up``, the GEMM of gelu_tanh(x) * up made tile by tile: bit for bit the GEMM of what the
    gelu·mul kernel writes (the same roundings, the same tile), on halves of a merged output."""
    import gemma4opt.kernels.skinny_linear as sl
    from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton

    monkeypatch.setattr(sl, "_INTERPRETER_SPLIT", split)
    g = torch.Generator().manual_seed(rows + n + split)
    gu = (torch.randn(rows, 2 * k, generator=g) * 2).to(dtype).to(DEVICE)
    gate, up = gu[:, :k], gu[:, k:]
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    cfg = _one_row_split(rows, split)
    got = skinny_linear_triton(gate, w, cfg, up=up)
    act = gelu_tanh_mul_triton(gate, up)        # tested against HF's gelu·mul in its own file
    assert torch.equal(got, skinny_linear_triton(act, w, cfg))
    close(got, F.linear(act.float(), w.float()).to(dtype), dtype)


def test_gelu_input_needs_up_of_the_same_shape():
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="is not x's shape"):
        skinny_linear_triton(x, w, up=x[:1])


def test_gelu_linear_op_is_the_two_ops_off_cuda():
    """The op's CPU path (the reference): gelu_tanh_mul then linear, exactly, broadcast ``up`` too."""
    import gemma4opt.ops  # noqa: F401

    g = torch.Generator().manual_seed(5)
    gate = torch.randn(2, 1, 24, generator=g).to(torch.bfloat16)
    w = torch.randn(10, 24, generator=g).to(torch.bfloat16)
    for up in (torch.randn(2, 1, 24, generator=g).to(torch.bfloat16), torch.randn(24, generator=g).to(torch.bfloat16)):
        want = F.linear(F.gelu(gate, approximate="tanh") * up, w)
        assert torch.equal(torch.ops.gemma4opt.gelu_linear(gate, up, w), want)


def test_gate_up_gelu_linear_op_is_the_mlp_off_cuda():
    """A dense MLP as one op (gate/up, gelu·mul, down): on CPU exactly HF's ops."""
    import gemma4opt.ops  # noqa: F401

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16)
    w_gu = torch.randn(2 * 24, 16, generator=g).to(torch.bfloat16)
    w_d = torch.randn(16, 24, generator=g).to(torch.bfloat16)
    y = F.linear(x, w_gu)
    want = F.linear(F.gelu(y[..., :24], approximate="tanh") * y[..., 24:], w_d)
    assert torch.equal(torch.ops.gemma4opt.gate_up_gelu_linear(x, w_gu, w_d), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("n,k", [(9, 70), (33, 260), (5, 33)])
def test_one_row_split_k(dtype, split, gelu, n, k):
    """At one row, K split (uneven chunks, some empty when K is short): the partials of the row sums
    added by the second kernel in split order, with the gelu·mul input made as it is read."""
    g = torch.Generator().manual_seed(split * 10 + n)
    gu = (torch.randn(1, 2 * k, generator=g) * 2).to(dtype).to(DEVICE)
    x, up = gu[:, :k], gu[:, k:]
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    cfg = dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=split)
    got = skinny_linear_triton(x, w, cfg, up=up if gelu else None)
    from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton

    act = gelu_tanh_mul_triton(x, up) if gelu else x        # the bits the GEMM makes (tested above)
    close(got, F.linear(act.float(), w.float()).to(dtype), dtype)
    if k > 32 * split:      # every split holds a tile: the unsplit tile's sum in another order
        close(got, skinny_linear_triton(x, w, dict(BLOCK_N=4, BLOCK_K=32), up=up if gelu else None), dtype)


def test_one_row_split_tiles_are_offered_to_narrow_n_over_long_k():
    from gemma4opt.kernels import skinny_linear as sl

    def splits(N, K):
        return {c.kwargs["SPLIT_K"] for c in sl._keep(sl._CONFIGS, dict(K=K, N=N, BLOCK_M=1))}
    assert splits(2560, 10240) == {1, 2, 4}                     # the e4b's MLP down
    assert splits(2560, sl.ROW_SPLIT_MIN_K - 1) == {1}          # o_proj, q/k/v: K too short
    assert splits(sl.NARROW_N + 1, 10240) == {1}                # a wide N fills the GPU unsplit
    sl.use_tiles(row_split=False)
    try:
        assert splits(2560, 10240) == {1}
    finally:
        sl.use_tiles()


def test_pipelined_row_sums_are_offered_over_more_than_one_k_tile():
    """The pipelined row sums (PIPE), off by default: use_tiles(pipelined=True) offers them to the bf16,
    fp8 and residual-tail GEMMs alike, beside the one-row tiles, where K takes more than one of their
    tiles, split ones only where split tiles go."""
    from gemma4opt.kernels import fp8_linear as f8
    from gemma4opt.kernels import norm_fp8_linear as nf8
    from gemma4opt.kernels import norm_linear as nl
    from gemma4opt.kernels import skinny_linear as sl

    def piped(N, K, bm=1):
        return {(c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]) for c in sl._keep(sl._CONFIGS, dict(K=K, N=N, BLOCK_M=bm))
                if c.kwargs["PIPE"]}

    def fp8_piped(K):
        return {c.kwargs["BLOCK_K"] for c in f8._keep(f8._tuned.configs, dict(K=K, N=5376, ROWS=1))
                if c.kwargs.get("PIPE")}
    nf8_prune = nf8._tuned.early_config_prune
    assert piped(2560, 10240) == set() and fp8_piped(5376) == set()
    assert not any(c.kwargs.get("PIPE") for c in nf8_prune(nf8._CONFIGS, dict(K=2560, N=3072)))
    sl.use_tiles(pipelined=True)
    try:
        assert piped(2560, 10240) == {(512, 1), (1024, 1), (512, 2), (512, 4)}     # the e4b's MLP down: splits too
        assert piped(3072, 2560) == {(512, 1), (1024, 1)}                           # q/k/v: K too short to split
        assert piped(3072, 512) == set() and piped(3072, 2560, bm=16) == set()      # one tile; the tensor-core path
        assert all(c.kwargs["PIPE"] == c.num_stages for c in sl._CONFIGS if c.kwargs["PIPE"])
        assert {c.kwargs["PIPE"] > 0 for c in nl._keep(nl._CONFIGS, dict(K=2560, N=3072, BLOCK_M=1))} == {False, True}
        assert fp8_piped(5376) == {512, 1024, 2048} and fp8_piped(1024) == {512}
        assert any(c.kwargs.get("PIPE") for c in nf8_prune(nf8._CONFIGS, dict(K=2560, N=3072)))
    finally:
        sl.use_tiles()
