import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Per-dtype tolerances for a fused kernel vs the op-by-op reference (fp32 accumulation in both;
# bf16/fp16 differ by a rounding or two where the kernel keeps fp32 between steps).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=3e-3, atol=3e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.fixture
def device():
    return DEVICE
