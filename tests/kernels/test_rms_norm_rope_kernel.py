import pytest
import torch

from gemma4opt.kernels.rms_norm_rope import rms_norm_rope_triton
from gemma4opt.ops.rms_norm_rope import rms_norm_rope_reference
from tests.kernels.conftest import DEVICE, DTYPES, close


def _cos_sin(B, S, D, dtype, partial=1.0):
    rot = int(D * partial) // 2
    inv = torch.zeros(D // 2)
    inv[:rot] = 1.0 / (10000 ** (torch.arange(0, 2 * rot, 2).float() / D))
    pos = torch.arange(S).float()[None, :, None] + torch.arange(B).float()[:, None, None] * 3
    emb = torch.cat([pos * inv, pos * inv], -1)
    return emb.cos().to(dtype)[:, :, None, :].to(DEVICE), emb.sin().to(dtype)[:, :, None, :].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,H,D,partial", [(1, 1, 3, 16, 1.0), (2, 5, 4, 32, 0.25), (3, 7, 1, 256, 1.0),
                                             (1, 3, 2, 512, 0.25), (2, 1, 5, 24, 1.0)])
def test_matches_reference(dtype, B, S, H, D, partial):
    x = (torch.randn(B, S, H, D) * 2).to(dtype).to(DEVICE)
    w = (1 + 0.3 * torch.randn(D)).to(dtype).to(DEVICE)
    cos, sin = _cos_sin(B, S, D, dtype, partial)
    close(rms_norm_rope_triton(x, w, cos, sin, 1e-6), rms_norm_rope_reference(x, w, cos, sin, 1e-6), dtype)


def test_strided_head_view_of_merged_projection():
    qkv = torch.randn(2, 3, 4 * 16 + 2 * 16, device=DEVICE)
    q = qkv[..., : 4 * 16].view(2, 3, 4, 16)
    w = torch.randn(16, device=DEVICE)
    cos, sin = _cos_sin(2, 3, 16, torch.float32)
    close(rms_norm_rope_triton(q, w, cos, sin, 1e-6), rms_norm_rope_reference(q, w, cos, sin, 1e-6), torch.float32)


def test_broadcast_cos_over_batch():
    x = torch.randn(3, 4, 2, 16, device=DEVICE)
    w = torch.randn(16, device=DEVICE)
    cos, sin = _cos_sin(1, 4, 16, torch.float32)      # position_ids of batch 1, as HF passes
    close(rms_norm_rope_triton(x, w, cos, sin, 1e-6), rms_norm_rope_reference(x, w, cos, sin, 1e-6), torch.float32)


@pytest.mark.parametrize("hb,warps", [(1, 1), (4, 2), (32, 8)])
def test_swept_launch_configs_give_the_same_result(hb, warps):
    """bench_kernels --sweep-norm-rope forces other heads-per-program / warps: same output."""
    from gemma4opt.kernels import rms_norm_rope as nr

    launch = dict(hb=hb, warps=warps)
    assert nr.head_block(64, 5, 8, launch) == (min(hb, 8), 8, warps)
    x = torch.randn(2, 3, 5, 16, device=DEVICE)
    w = torch.randn(16, device=DEVICE)
    cos, sin = _cos_sin(2, 3, 16, torch.float32, 0.25)
    close(rms_norm_rope_triton(x, w, cos, sin, 1e-6, launch=launch), rms_norm_rope_reference(x, w, cos, sin, 1e-6),
          torch.float32)
