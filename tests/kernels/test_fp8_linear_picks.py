"""gemma4opt::fp8_linear's per-shape pick between the skinny Triton GEMM and torch._scaled_mm,
with the timing replaced (no GPU here): the faster by the margin wins, a failing Triton GEMM
leaves the shape on _scaled_mm, each model keeps its own picks, and a call _scaled_mm cannot run
takes Triton without timing."""
import torch

from gemma4opt.ops import fp8_linear as op
from gemma4opt.ops.state import OpState, active


class _Fake:
    """A stand-in fp8 tensor for the pick logic (shapes, strides, device index)."""

    def __init__(self, *shape):
        self.shape = shape
        self._t = torch.empty(shape)
        self.device = torch.device("cpu")

    def numel(self):
        return self._t.numel()

    def stride(self, d):
        return self._t.stride(d)


def test_pick_follows_the_timing_and_stays_per_model(monkeypatch):
    x, w = _Fake(4, 64), _Fake(32, 64)
    times = {"t": (1.0, 2.0)}
    calls = []

    def fake_time(*args):
        calls.append(1)
        return times["t"]

    monkeypatch.setattr(op, "_time_both", fake_time)
    a, b = OpState(), OpState()
    with active(a):
        assert op.runs_triton(x, w, x_scale=1, w_scale=1)              # Triton twice as fast
        assert op.runs_triton(x, w, x_scale=1, w_scale=1) and len(calls) == 1   # timed once
    times["t"] = (2.0, 2.0)                                            # a tie: _scaled_mm
    with active(b):
        assert not op.runs_triton(x, w, x_scale=1, w_scale=1)
    assert list(op.picks(a).values()) == [True] and list(op.picks(b).values()) == [False]


def test_a_failing_triton_gemm_leaves_the_shape_on_scaled_mm(monkeypatch):
    def boom(*args):
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(op, "_time_both", boom)
    state = OpState()
    with active(state):
        assert not op.runs_triton(_Fake(2, 64), _Fake(32, 64), x_scale=1, w_scale=1)
    assert "no such GPU" in next(iter(op.failures(state).values()))


def test_calls_scaled_mm_cannot_run_take_triton_untimed(monkeypatch):
    monkeypatch.setattr(op, "_time_both", lambda *a: (_ for _ in ()).throw(AssertionError("timed")))
    with active(OpState()):
        assert op.runs_triton(_Fake(2, 40), _Fake(24, 40), x_scale=1, w_scale=1)   # K not a multiple of 16
        assert op.runs_triton(_Fake(2, 64), _Fake(32, 64), x_scale=1, w_scale=1, out_dtype=torch.float32)
        assert not op.runs_triton(_Fake(33, 64), _Fake(32, 64), x_scale=1, w_scale=1)   # above 32 rows
