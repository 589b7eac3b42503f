"""The fp8 GEMM inputs made inside the kernels at decode (no GPU here: the interpreter and the picks'
logic with the timing replaced): the fp8 MLP's two-launch path (gate/up GEMV on e4m3 weights writing
its programs' amaxes, the down GEMM quantizing the activation with their max) against its four-op
reference, and the per-shape picks of it and of quant_fp8_linear."""
import pytest
import torch

import gemma4opt.ops  # noqa: F401
from gemma4opt.kernels.fp8_linear import quant_fp8_linear_triton
from gemma4opt.kernels.gate_up_gelu import gate_up_gelu_fp8_triton
from gemma4opt.ops import gelu_linear as mlp_op
from gemma4opt.ops import quant_fp8_linear as quant_op
from gemma4opt.ops.fp8 import quantize_rows_reference, quantize_weight_reference
from gemma4opt.ops.state import OpState, active
from tests.kernels.conftest import DEVICE


def _mlp(I, H, seed=0):
    g = torch.Generator().manual_seed(seed + I + H)
    xq, xs = quantize_rows_reference(torch.randn(1, 1, H, generator=g) * 3)
    wgu, sgu = quantize_weight_reference(torch.randn(2 * I, H, generator=g) / H ** 0.5)
    wd, sd = quantize_weight_reference(torch.randn(H + 5, I, generator=g) / I ** 0.5)
    return tuple(t.to(DEVICE) for t in (xq, xs, wgu, sgu, wd, sd))


@pytest.mark.parametrize("I,H", [(24, 40), (300, 33), (2100, 16)])
def test_fp8_mlp_fused_equals_its_kernels_and_the_reference(I, H):
    """The down GEMM's scale from the GEMV's per-program amaxes (2100 / 8 programs: more than one
    2048-wide tile of them) is the one a pass over the activation finds: the same bytes, the same
    output; against the four reference ops, within a 16-bit rounding of the activation."""
    args = _mlp(I, H)
    got = mlp_op.fp8_mlp_fused(*args, torch.bfloat16)
    xq, xs, wgu, sgu, wd, sd = args
    act = gate_up_gelu_fp8_triton(xq, xs, wgu, sgu, torch.bfloat16)
    if DEVICE != "cuda":
        assert torch.equal(got, quant_fp8_linear_triton(act, wd, sd, torch.bfloat16))
    want = mlp_op.fp8_gate_up_gelu_linear_reference(*args, torch.bfloat16)
    assert got.shape == want.shape == (1, 1, H + 5)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, float(err)


def test_gemv_amax_parts_are_each_programs_max_of_what_it_stored():
    xq, xs, wgu, sgu, _, _ = _mlp(20, 24, seed=3)
    act, parts = gate_up_gelu_fp8_triton(xq, xs, wgu, sgu, torch.bfloat16, launch=dict(gu_n=8, gu_k=16), amax=True)
    assert parts.shape == (1, 3)
    flat = act.reshape(-1).float().abs()
    assert torch.equal(parts[0], torch.stack([flat[0:8].max(), flat[8:16].max(), flat[16:20].max()]))


def test_amax_parts_refused_for_more_rows_or_other_dtypes():
    wq, ws = quantize_weight_reference(torch.randn(8, 32))
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="for 2 rows: one row"):
        quant_fp8_linear_triton(x, wq, ws, torch.bfloat16, amax_parts=torch.ones(3))
    with pytest.raises(ValueError, match="torch.float16"):
        quant_fp8_linear_triton(x[:1], wq, ws, torch.bfloat16, amax_parts=torch.ones(3, dtype=torch.float16))


class _Fake:
    """A stand-in tensor for the picks' logic (shape, strides, dtype, device index)."""

    def __init__(self, *shape, dtype=torch.float8_e4m3fn):
        self._t = torch.empty(shape)
        self.shape, self.dtype, self.device = self._t.shape, dtype, torch.device("cpu")

    def numel(self):
        return self._t.numel()

    def stride(self, d):
        return self._t.stride(d)


def test_fp8_mlp_pick_times_once_per_shape_and_model(monkeypatch):
    times = {"t": (1.0, 2.0)}
    calls = []
    monkeypatch.setattr(mlp_op, "check_then_time", lambda *a: calls.append(a[2]) or times["t"])
    x, xs = _Fake(1, 1, 64), _Fake(1, 1, dtype=torch.float32)
    wgu, sgu, wd, sd = _Fake(256, 64), _Fake(256, dtype=torch.float32), _Fake(64, 128), _Fake(64, dtype=torch.float32)
    a, b = OpState(), OpState()
    with active(a):
        assert mlp_op.runs_fp8_fused(x, xs, wgu, sgu, wd, sd, torch.bfloat16)
        assert mlp_op.runs_fp8_fused(x, xs, wgu, sgu, wd, sd, torch.bfloat16)
    assert len(calls) == 1 and calls[0] == (wgu, wd)        # both weights timed together, once
    times["t"] = (2.0, 2.0)                                  # a tie: the reference
    with active(b):
        assert not mlp_op.runs_fp8_fused(x, xs, wgu, sgu, wd, sd, torch.bfloat16)
    assert list(mlp_op.fp8_picks(a).values()) == [True] and list(mlp_op.fp8_picks(b).values()) == [False]


def test_fp8_mlp_untimed_where_the_fused_path_cannot_run(monkeypatch):
    monkeypatch.setattr(mlp_op, "check_then_time", lambda *a: (_ for _ in ()).throw(AssertionError("timed")))
    xs, sgu, sd = _Fake(1, dtype=torch.float32), _Fake(256, dtype=torch.float32), _Fake(64, dtype=torch.float32)
    wgu, wd = _Fake(256, 64), _Fake(64, 128)
    with active(OpState()):
        assert not mlp_op.runs_fp8_fused(_Fake(2, 64), xs, wgu, sgu, wd, sd, torch.bfloat16)    # two rows
        assert not mlp_op.runs_fp8_fused(_Fake(1, 64, dtype=torch.bfloat16), xs, wgu, sgu, wd, sd, torch.bfloat16)
        assert not mlp_op.runs_fp8_fused(_Fake(1, 64), xs, wgu, sgu, wd, sd, torch.float32)   # fp32 output
        assert not mlp_op.runs_fp8_fused(_Fake(1, 64), xs, wgu, sgu, _Fake(64, 100), sd, torch.bfloat16)


def test_quant_fp8_linear_pick_and_what_it_never_times(monkeypatch):
    monkeypatch.setattr(quant_op, "_time_both", lambda *a: (1.0, 3.0))
    w, ws = _Fake(32, 64), _Fake(32, dtype=torch.float32)
    state = OpState()
    with active(state):
        assert quant_op.runs_triton(_Fake(4, 64, dtype=torch.bfloat16), w, ws, torch.bfloat16)
        assert not quant_op.runs_triton(_Fake(33, 64, dtype=torch.bfloat16), w, ws, torch.bfloat16)   # prefill
        assert not quant_op.runs_triton(_Fake(4, 64, dtype=torch.float32), w, ws, torch.float32)     # fp32 model
        assert not quant_op.runs_triton(_Fake(4, 64, dtype=torch.bfloat16), _Fake(32, 64, dtype=torch.bfloat16), ws,
                                        torch.bfloat16)                                            # bf16 weight
    assert list(quant_op.picks(state)) == [(4, 32, 64, torch.bfloat16, torch.bfloat16, None)]
