"""The fast decode replan against FlashInfer's own plan(), where FlashInfer's Python is installed
(the GPU machine; a CPU machine with the [gpu] extra). On a CPU its pinned memory and its JIT
kernel module are stood in: the stand-in planner writes a digest of every argument it gets into
the staging buffer and returns it as plan info, so any argument the fast path passes differently
from FlashInfer's plan() shows. The GPU test (tests/gpu/test_gpu_paged.py) runs the real planner
and kernels."""
import numpy as np
import pytest
import torch

flashinfer = pytest.importorskip("flashinfer")

from gemma4opt.paged.backends.base import KindGeometry  # noqa: E402
from gemma4opt.paged.backends.flashinfer import FlashInferBackend  # noqa: E402


class _Planner:
    """FlashInfer's C++ plan(), stood in: a digest of its arguments, staged and returned."""

    calls = []

    def plan(self, *args):
        digest = []
        for a in args[3:]:                          # after the three workspace buffers
            digest += a.tolist() if torch.is_tensor(a) else [int(a)]
        _Planner.calls.append(digest)
        staged = args[2]
        staged[: len(digest)] = torch.tensor([x % 251 for x in digest], dtype=torch.uint8)
        return [len(digest), sum(digest)]


@pytest.fixture
def cpu_flashinfer(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the real planner runs (tests/gpu/test_gpu_paged.py)")
    from flashinfer import prefill

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(prefill, "get_batch_prefill_module", lambda *a, **k: _Planner())
    _Planner.calls = []


@pytest.mark.parametrize("window", [None, 24])
def test_fast_replan_passes_what_flashinfer_plan_passes(cpu_flashinfer, window):
    ws = torch.zeros(8 << 20, dtype=torch.uint8)
    geometry = KindGeometry("sliding_attention", 8, 2, 64, 16, window, torch.bfloat16, torch.bfloat16)
    fast = FlashInferBackend(geometry, ws, max_pages=64)
    full = FlashInferBackend(geometry, ws, max_pages=64, fast_replan=False)
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 200, size=3)
    for step in range(40):                          # lengths crossing pages; a bucket of 4 with a padding row
        lens = lens + 1
        pages = -(-lens // 16)
        kv_indptr = np.concatenate([[0], np.cumsum(pages), [pages.sum() + 1]]).astype(np.int32)
        last = np.concatenate([(lens - 1) % 16 + 1, [1]]).astype(np.int32)
        indices = torch.from_numpy(rng.permutation(64)[: kv_indptr[-1]].astype(np.int32))
        planned = {}
        for name, p in (("full", full), ("fast", fast)):
            _Planner.calls = []
            p.plan(np.arange(5), kv_indptr, last, indices, bucket=4)
            planned[name] = _Planner.calls[-1]      # the planner's arguments of this step
        assert planned["fast"] == planned["full"], step
        w_full, w_fast = full.graph_wrappers[4], fast.graph_wrappers[4]
        for buf in ("_paged_kv_indptr_buf", "_paged_kv_last_page_len_buf"):
            assert torch.equal(getattr(w_fast, buf), getattr(w_full, buf)), (step, buf)
        n = int(kv_indptr[-1])
        assert torch.equal(w_fast._paged_kv_indices_buf[:n], w_full._paged_kv_indices_buf[:n])
        assert torch.equal(w_fast._kv_lens_buffer[:4], w_full._kv_lens_buffer[:4])
        assert w_fast._plan_info == w_full._plan_info and w_fast._max_kv_len == w_full._max_kv_len
    r = fast.replan
    assert not r.off, r.off
    assert r.fast_plans == 40 - 1 and r.full_plans == 1    # FlashInfer's plan() once, checked against ours
