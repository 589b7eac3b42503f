import pytest
import torch

from gemma4opt.kernels.norm_add import norm_add_triton
from gemma4opt.ops.norm_add import norm_add_reference
from tests.kernels.conftest import DEVICE, DTYPES, close


def _weight(d, dtype):
    return (1 + 0.3 * torch.randn(d)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 40), (3, 7, 96), (5, 130), (2, 0, 32), (1, 1, 3, 24)])
@pytest.mark.parametrize("mode", ["residual", "two_norms", "two_norms_unweighted"])
def test_matches_reference(dtype, shape, mode):
    """Odd row lengths (masked lanes), several leading dims, empty input; y added as it is (the PLE
    tail's residual) or normed first, with or without its own weight."""
    torch.manual_seed(sum(shape))
    x, y = (torch.randn(shape) * 3).to(dtype).to(DEVICE), (torch.randn(shape) * 2).to(dtype).to(DEVICE)
    w = _weight(shape[-1], dtype)
    norm_y = mode != "residual"
    wy = _weight(shape[-1], dtype) if mode == "two_norms" else None
    got = norm_add_triton(x, w, 1e-6, y, wy, 1e-5, norm_y)
    want = norm_add_reference(x, w, 1e-6, y, wy, 1e-5, norm_y)
    assert got.shape == want.shape and got.dtype == dtype
    close(got, want, dtype)


def test_strided_rows():
    """x and y as column slices of wider buffers (the kernel takes row strides)."""
    x = torch.randn(3, 50, device=DEVICE)[:, 5:37]
    y = torch.randn(3, 40, device=DEVICE)[:, 8:40]
    w, wy = _weight(32, torch.float32), _weight(32, torch.float32)
    close(norm_add_triton(x, w, 1e-6, y, wy, 1e-6, True), norm_add_reference(x, w, 1e-6, y, wy, 1e-6, True),
          torch.float32)
