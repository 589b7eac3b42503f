"""FastReplan's self-check, without FlashInfer: a wrapper whose planner answers differently from
FlashInfer's plan() (another version), or whose attributes are not FlashInfer 0.6's, keeps the
full plan(), runs it again last, and the reason is counted. The comparison with the real
FlashInfer plan() is tests/attention/test_flashinfer_replan.py."""
import types

import torch

from gemma4opt.paged.backends.flashinfer_replan import FastReplan


def _wrapper(planner_info):
    w = types.SimpleNamespace(
        _backend="fa2", is_cuda_graph_enabled=True, _plan_info=None, _max_total_num_rows=None,
        _float_workspace_buffer=torch.zeros(4), _int_workspace_buffer=torch.zeros(4, dtype=torch.uint8),
        _pin_memory_int_workspace_buffer=torch.zeros(16, dtype=torch.uint8),
        _paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32), _paged_kv_indices_buf=torch.zeros(8, dtype=torch.int32),
        _paged_kv_last_page_len_buf=torch.zeros(2, dtype=torch.int32), _kv_lens_buffer=torch.zeros(8, dtype=torch.int32),
        _cached_module=types.SimpleNamespace(plan=lambda *args: planner_info(args)))
    w.full_plans = 0

    def full_plan():
        w.full_plans += 1
        w._plan_info = [7, 7]                # what FlashInfer's plan() leaves
    return w, full_plan


def _step(r, w, full_plan):
    i32 = torch.int32
    r.plan(w, full_plan, (4, 2, 8, 16, -1), torch.tensor([0, 1, 2], dtype=i32), torch.tensor([0, 1, 2], dtype=i32),
           torch.tensor([3, 5], dtype=i32),
           torch.tensor([4, 9], dtype=i32), torch.tensor([4, 9], dtype=i32))


def test_agreeing_planner_goes_fast_after_one_checked_plan():
    r = FastReplan()
    w, full_plan = _wrapper(lambda args: [7, 7])
    for _ in range(5):
        _step(r, w, full_plan)
    assert (r.fast_plans, r.full_plans, w.full_plans) == (4, 1, 1) and not r.off
    assert w._paged_kv_last_page_len_buf.tolist() == [4, 9] and w._max_kv_len == 9
    assert "4 fast, 1 full" in r.summary()


def test_disagreeing_planner_stays_on_flashinfers_plan_which_runs_last():
    r = FastReplan()
    w, full_plan = _wrapper(lambda args: [7, 8])
    for _ in range(3):
        _step(r, w, full_plan)
    assert r.fast_plans == 0 and w.full_plans == 4 and w._plan_info == [7, 7]   # 3 steps + the re-run
    assert r.off == {"plan info differs from FlashInfer's plan()": 1}


def test_unknown_wrapper_or_failing_planner_stays_full():
    r = FastReplan()
    w, full_plan = _wrapper(lambda args: 1 / 0)
    _step(r, w, full_plan)
    _step(r, w, full_plan)
    assert r.fast_plans == 0 and any("ZeroDivisionError" in k for k in r.off)
    r2 = FastReplan()
    w2, full2 = _wrapper(lambda args: [7, 7])
    del w2._kv_lens_buffer
    _step(r2, w2, full2)
    assert r2.fast_plans == 0 and any("lacks ['_kv_lens_buffer']" in k for k in r2.off)
    assert w2.full_plans == 1                 # nothing was replanned, so nothing to plan again
