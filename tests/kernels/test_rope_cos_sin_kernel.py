"""rope_cos_sin: the Triton kernel against HF's ops, and the per-device bit check that gates it."""
import pytest
import torch

import gemma4opt.ops.rope_cos_sin as rope_op
from gemma4opt.kernels.rope_cos_sin import rope_cos_sin_triton
from gemma4opt.ops.rope_cos_sin import kernel_matches, rope_cos_sin_reference, uses_kernel, verdicts
from tests.kernels.conftest import DEVICE, DTYPES, close


def _inv_freq(half, zeros=0, dtype=torch.float32):
    """Default RoPE frequencies; ``zeros`` trailing zeros as proportional RoPE pads them."""
    inv = 1.0 / (10000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
    inv[half - zeros:] = 0
    return inv.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,half", [((1, 1), 64), ((3, 5), 13), ((2, 7), 1), ((2, 0), 8), ((1, 3), 128)])
@pytest.mark.parametrize("scaling", [1.0, 0.7])
def test_matches_reference(dtype, shape, half, scaling):
    g = torch.Generator().manual_seed(half)
    pos = torch.randint(0, 131072, shape, generator=g).to(DEVICE)
    inv = _inv_freq(half, zeros=half // 4)
    cos, sin = rope_cos_sin_triton(pos, inv, scaling, dtype)
    want_cos, want_sin = rope_cos_sin_reference(pos, inv, scaling, dtype, False)
    assert cos.shape == want_cos.shape == (*shape, 2 * half) and cos.dtype == sin.dtype == dtype
    # The interpreter's cos/sin are numpy's, PyTorch's CPU ones may differ by an fp32 ulp (the
    # bits are compared on the GPU: tests/gpu); the halves, the product, the scaling are checked here.
    close(cos, want_cos, dtype)
    close(sin, want_sin, dtype)


def test_low_precision_inv_freq_is_widened_as_hf_widens_it():
    pos = torch.tensor([[0, 1, 4097]], device=DEVICE)
    inv = _inv_freq(16, dtype=torch.bfloat16)
    got = rope_cos_sin_triton(pos, inv, 1.0, torch.float32)
    want = rope_cos_sin_reference(pos, inv, 1.0, torch.float32, False)
    for g, w in zip(got, want):
        close(g, w, torch.float32)


def test_matmul_form_reference_is_hfs_517_computation():
    pos = torch.tensor([[3, 9, 200], [1, 2, 70000]])
    inv = _inv_freq(8, zeros=2).cpu()
    got = rope_cos_sin_reference(pos, inv, 0.5, torch.bfloat16, True)
    # transformers 5.17's Gemma4TextRotaryEmbedding.forward, op for op
    inv_e = inv[None, :, None].expand(pos.shape[0], -1, 1).to(dtype=torch.float)
    freqs = (inv_e @ pos[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    want = ((emb.cos() * 0.5).to(torch.bfloat16), (emb.sin() * 0.5).to(torch.bfloat16))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _perturbed_at(position):
    """A kernel giving the reference's bits except one element at ``position``."""
    def kernel(pos, inv, scaling, dtype):
        cos, sin = rope_cos_sin_reference(pos, inv, scaling, dtype, False)
        hit = (pos == position).nonzero()
        if len(hit):
            b, s = hit[0].tolist()
            sin[b, s, 1] = torch.nextafter(sin[b, s, 1].float(), torch.tensor(2.0)).to(dtype)
        return cos, sin
    return kernel


@pytest.mark.parametrize("chunk", [7, 16384])
def test_bit_check_covers_every_position_below_the_bound(monkeypatch, chunk):
    monkeypatch.setattr(rope_op, "_CHUNK", chunk)
    inv = _inv_freq(4).cpu()
    exact = lambda p, i, s, d: rope_cos_sin_reference(p, i, s, d, False)     # noqa: E731
    assert kernel_matches(inv, 1.0, torch.float32, False, 50, kernel=exact)
    for position in (0, 6, 7, 49):
        assert not kernel_matches(inv, 1.0, torch.float32, False, 50, kernel=_perturbed_at(position)), position
    assert kernel_matches(inv, 1.0, torch.float32, False, 50, kernel=_perturbed_at(50))   # past the bound


@pytest.fixture
def counted(monkeypatch):
    """uses_kernel's checks counted, with verdicts from a fresh table; check() answers ``answer``."""
    calls = []
    answer = {"ok": True}

    def check(inv, scaling, dtype, matmul, max_positions, kernel=None):
        calls.append((scaling, dtype, matmul, max_positions))
        return answer["ok"]

    monkeypatch.setattr(rope_op, "_VERDICTS", {})
    monkeypatch.setattr(rope_op, "kernel_matches", check)
    return calls, answer


def test_verdict_is_checked_once_per_inv_freq_and_again_after_an_edit(counted):
    calls, _ = counted
    inv = _inv_freq(4).cpu()
    assert uses_kernel(inv, 1.0, torch.bfloat16, False, 64) is True
    assert uses_kernel(inv, 1.0, torch.bfloat16, False, 64) is True
    assert len(calls) == 1
    inv.mul_(1.0)                                   # in place: a new version of the same tensor
    uses_kernel(inv, 1.0, torch.bfloat16, False, 64)
    assert len(calls) == 2
    uses_kernel(inv, 0.5, torch.bfloat16, False, 64)           # another scaling, dtype or bound: its own
    uses_kernel(inv, 1.0, torch.float16, False, 64)
    uses_kernel(inv, 1.0, torch.bfloat16, False, 128)
    assert len(calls) == 5
    other = inv.clone()
    uses_kernel(other, 1.0, torch.bfloat16, False, 64)
    assert len(calls) == 6


def test_verdict_follows_the_tf32_flag(counted):
    calls, _ = counted
    inv = _inv_freq(4).cpu()
    before = torch.backends.cuda.matmul.allow_tf32     # (torch 2.11: not monkeypatch-able)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        uses_kernel(inv, 1.0, torch.bfloat16, True, 64)
        torch.backends.cuda.matmul.allow_tf32 = True
        uses_kernel(inv, 1.0, torch.bfloat16, True, 64)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert len(calls) == 2


def test_no_check_while_capturing_and_the_reference_runs(counted, monkeypatch):
    calls, _ = counted
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    inv = _inv_freq(4).cpu()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))      # as a CUDA tensor would
    assert uses_kernel(inv, 1.0, torch.bfloat16, False, 64) is None
    assert calls == []


def test_a_failed_check_is_reported_while_its_inv_freq_lives(counted):
    _, answer = counted
    answer["ok"] = False
    inv = _inv_freq(4).cpu()
    assert uses_kernel(inv, 1.0, torch.bfloat16, False, 64) is False
    assert len(verdicts()) == 1 and "cos/sin differ from PyTorch's; PyTorch's ops run" in verdicts()[0]
    del inv
    assert verdicts() == []


def test_report_lists_a_failed_check_of_its_own_models_rotary_only(counted):
    from gemma4opt.report import Report

    _, answer = counted
    answer["ok"] = False
    mine, other = _inv_freq(4).cpu(), _inv_freq(4).cpu()
    uses_kernel(mine, 1.0, torch.bfloat16, False, 64)
    uses_kernel(other, 1.0, torch.bfloat16, False, 64)
    assert len(verdicts()) == 2 and len(verdicts([mine])) == 1
    text = str(Report("M", "causal_lm", None, 1, 1, 0, {}, kernel_checks=verdicts([mine])))
    assert "rope_cos_sin: the Triton kernel is not used on cpu" in text


def test_a_kernel_that_fails_to_build_leaves_the_reference(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no libdevice here\nmore")

    monkeypatch.setattr(rope_op, "_VERDICTS", {})
    monkeypatch.setattr(rope_op, "kernel_matches", broken)
    inv = _inv_freq(4).cpu()
    assert uses_kernel(inv, 1.0, torch.bfloat16, False, 64) is False
    assert "it failed (RuntimeError: no libdevice here)" in verdicts([inv])[0]
