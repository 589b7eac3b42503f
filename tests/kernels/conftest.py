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


def close_fp8_mma(got, want, xd, wd, dtype):
    """An fp8 GEMM's output against its fp32 reference ``want`` = xd @ wd^T (both dequantized): the
    dtype's tolerance, and where compiled for the GPU the fp8 MMA's bound on top. The MMA adds the 32
    products of one instruction with fewer bits than fp32 (~14, DeepSeek-V3 §3.3.2); the kernels
    promote each instruction's partial to fp32, so the error is within 2^-12 of sum |x||w| of each output.
    Under the interpreter the e4m3 products are exact in fp32 and only the dtype's tolerance applies."""
    if DEVICE != "cuda":
        return close(got, want, dtype)
    mma = 2 ** -12 * (xd.float().abs() @ wd.float().abs().t())
    tol = TOL[dtype]
    err = (got.float() - want.float()).abs()
    bad = err > tol["atol"] + tol["rtol"] * want.float().abs() + mma
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outside the bound, max |err| {err.max():.3g}"


@pytest.fixture
def device():
    return DEVICE


def record_tuned_launches(monkeypatch, module, tuned) -> list[dict]:
    """An autotuned kernel's launches without a GPU: ``module``'s kernels marked compiled, ``tuned``'s
    cache emptied, its launch and timing replaced. Each launch (every candidate the autotuner times,
    then the chosen one) is recorded as {parameter: value} after checking that it binds every
    parameter of the kernel that has no default."""
    import inspect

    params = inspect.signature(tuned.fn.fn).parameters
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    launches = []

    def fake_run(*args, **kwargs):
        bound = dict(zip(params, args), **{n: v for n, v in kwargs.items() if n in params})
        assert required <= set(bound), sorted(required - set(bound))
        launches.append(bound)

    monkeypatch.setattr(module, "_COMPILED", True)
    monkeypatch.setattr(tuned, "cache", {})
    monkeypatch.setattr(tuned.fn, "run", fake_run)
    monkeypatch.setattr(tuned, "do_bench", lambda fn, quantiles=None: (fn(), 1.0)[1])
    return launches
