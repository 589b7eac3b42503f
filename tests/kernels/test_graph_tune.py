"""Graph-timed tile choice (kernels/graph_tune.py) and its wiring into the skinny GEMMs' wrappers.
The timing itself needs a GPU (tests/gpu/test_gpu_linear.py runs it); here it is replaced by fake
times, and the kernel launches by recorders, so the choice logic and what each wrapper offers and
then launches are checked on CPU."""
import inspect

import pytest
import torch

from gemma4opt.kernels import graph_tune as gt


@pytest.fixture
def fake_timing(monkeypatch):
    """graph_ms runs the call once and returns the time table's entry for current["tile"], the tile
    that call ran (a tile missing from the table raises, as a tile the GPU refuses would)."""
    table = {}
    current = {}

    def fake_graph_ms(fn, weights, calls, reps):
        fn(weights[0])
        return table[current["tile"]]

    monkeypatch.setattr(gt, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(gt, "weight_set", lambda w: [w, w.clone()])
    monkeypatch.setattr(gt, "_timeable", lambda w: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    gt.use_graph_tuning(True)
    return table, current


def _runner(current, ran):
    def run(tile, w):
        current["tile"] = gt.tile_name(tile)
        ran.append(current["tile"])
    return run


def test_choose_takes_the_fastest_remembers_it_and_skips_failing_tiles(fake_timing):
    table, current = fake_timing
    tiles = [dict(BLOCK_N=4), dict(BLOCK_N=8), dict(BLOCK_N=16), dict(BLOCK_N=32)]
    table.update({gt.tile_name(tiles[0]): 3.0, gt.tile_name(tiles[1]): 1.0, gt.tile_name(tiles[3]): 2.0})
    tuner, ran = gt.GraphTuner("test"), []
    w = torch.zeros(4, 4)
    assert tuner.choose(("k",), tiles, _runner(current, ran), w) == dict(BLOCK_N=8)
    assert len(ran) == 4                        # each candidate ran once (BLOCK_N=16's timing raised)
    assert set(tuner.timings[("k",)]) == {gt.tile_name(t) for t in (tiles[0], tiles[1], tiles[3])}
    assert tuner.choose(("k",), tiles, _runner(current, ran), w) == dict(BLOCK_N=8)
    assert len(ran) == 4                        # remembered: not timed again
    table[gt.tile_name(tiles[1])] = 9.0
    assert tuner.choose(("other",), tiles, _runner(current, ran), w) == dict(BLOCK_N=32)   # per key


def test_choose_declines_while_capturing_when_off_and_when_nothing_ran(fake_timing, monkeypatch):
    table, current = fake_timing
    tuner, ran, w = gt.GraphTuner("test"), [], torch.zeros(2, 2)
    tiles = [dict(BLOCK_N=4)]
    assert tuner.choose(("k",), tiles, _runner(current, ran), w) is None       # its timing raised
    table[gt.tile_name(tiles[0])] = 1.0
    gt.use_graph_tuning(False)
    try:
        assert tuner.choose(("k",), tiles, _runner(current, ran), w) is None
    finally:
        gt.use_graph_tuning(True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tuner.choose(("k",), tiles, _runner(current, ran), w) is None
    assert not tuner.best                        # nothing remembered from a capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert tuner.choose(("k",), tiles, _runner(current, ran), w) == tiles[0]
    gt.use_graph_tuning(True)                    # switching forgets every tuner's choices
    assert not tuner.best


def _recording_kernel(monkeypatch, module, kernel, current, names):
    """Launches of ``kernel`` recorded (each binding every parameter), current["tile"] set to the
    launched tile's ``names``; the split-sum kernel a split tile adds does nothing."""
    params = inspect.signature(kernel.fn).parameters
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    launches = []

    def fake_run(*args, **kwargs):
        bound = dict(zip(params, args), **{n: v for n, v in kwargs.items() if n in params})
        assert required <= set(bound), sorted(required - set(bound))
        launches.append(bound)
        current["tile"] = _key({**bound, **kwargs}, names)      # num_warps, num_stages: launch options

    monkeypatch.setattr(module, "_COMPILED", True)
    monkeypatch.setattr(kernel, "run", fake_run)
    monkeypatch.setattr(module._split_sum_kernel, "run", lambda *a, **kw: None)
    return launches


def _key(tile, names):
    return tuple(tile.get(n) for n in names)


@pytest.mark.parametrize("rows,block_m", [(1, {1, 16}), (9, {16}), (32, {32})])
def test_fp8_wrapper_offers_its_row_class_and_launches_the_choice(fake_timing, monkeypatch, rows, block_m):
    from gemma4opt.kernels import fp8_linear as k
    from gemma4opt.ops.fp8 import quantize_rows_reference, quantize_weight_reference

    table, current = fake_timing
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP", "num_warps", "num_stages")
    monkeypatch.setattr(k._TUNER, "best", {})
    launches = _recording_kernel(monkeypatch, k, k._fp8_linear_kernel, current, names)
    offered = gt.config_tiles(k._keep(k._CONFIGS, dict(ROWS=1 if rows == 1 else 16 if rows <= 16 else 32)))
    assert {t["BLOCK_M"] for t in offered} == block_m
    table.update({_key(t, names): 2.0 + i for i, t in enumerate(offered)})
    fastest = offered[-1]
    table[_key(fastest, names)] = 0.5
    xq, xs = quantize_rows_reference(torch.randn(rows, 72))
    wq, ws = quantize_weight_reference(torch.randn(40, 72))
    k.fp8_linear_triton(xq, xs, wq, ws, torch.bfloat16)
    assert len(launches) == len(offered) + 1                  # each candidate timed, then the choice
    last = launches[-1]
    assert {n: last[n] for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP")} == \
        {n: fastest[n] for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP")}
    assert last["M"] == rows


@pytest.mark.parametrize("rows", [1, 20])
def test_skinny_wrapper_offers_its_row_class_and_launches_the_choice(fake_timing, monkeypatch, rows):
    from gemma4opt.kernels import skinny_linear as k

    table, current = fake_timing
    names = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP", "num_warps", "num_stages")
    monkeypatch.setattr(k._TUNER, "best", {})
    launches = _recording_kernel(monkeypatch, k, k._skinny_kernel, current, names)
    bm = 1 if rows == 1 else 32
    offered = gt.config_tiles(k._keep(k._CONFIGS, dict(N=40, K=72, BLOCK_M=bm)))
    assert offered and all(t["SWAP"] is False for t in offered) == (rows == 1)
    table.update({_key(t, names): 2.0 for t in offered})
    fastest = offered[len(offered) // 2]
    table[_key(fastest, names)] = 0.5
    k.skinny_linear_triton(torch.randn(rows, 72, dtype=torch.bfloat16), torch.randn(40, 72, dtype=torch.bfloat16))
    assert len(launches) == len(offered) + 1
    last = launches[-1]
    assert {n: last[n] for n in ("BLOCK_N", "BLOCK_K", "SWAP")} == {n: fastest[n] for n in ("BLOCK_N", "BLOCK_K", "SWAP")}
    assert last["BLOCK_M"] == bm
