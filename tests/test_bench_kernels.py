"""The kernel benchmark's baselines are the subgraphs they claim to be, and its sweeps force the
launches they list (checked on CPU)."""
import importlib.util
import os
from types import SimpleNamespace

import torch

from gemma4opt.ops.moe_experts import moe_experts_reference
from tests.models import tiny

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_kernels.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sweep_bench(monkeypatch, kernel, names):
    """The benchmark module with ``kernel`` as every case of ``names`` and a graph timer that just
    calls once (no GPU)."""
    bench = _bench()

    def graph_us(fn, rep):
        fn()
        return 1.0

    monkeypatch.setattr(bench, "cases", lambda cfg, M: [(n, kernel, None, (torch.zeros(1),), 0) for n in names])
    monkeypatch.setattr(bench, "_graph_us", graph_us)
    return bench


def test_moe_baseline_is_hfs_batched_mm_path():
    """What Inductor compiles for the decode MoE row gives what HF's batched_mm experts give."""
    model = tiny("tiny-moe")
    model.set_experts_implementation("batched_mm")
    experts = model.model.layers[0].experts
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) / 8)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) / 4)
        T, k = 5, model.config.top_k_experts
        x = torch.randn(T, experts.hidden_dim, generator=g)
        idx = torch.stack([torch.randperm(experts.num_experts, generator=g)[:k] for _ in range(T)])
        w = torch.softmax(torch.randn(T, k, generator=g), -1)
        got = _bench()._moe_batched_ref(x, idx, w, experts.gate_up_proj, experts.down_proj)
        torch.testing.assert_close(got, experts(x, idx, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, moe_experts_reference(x, idx, w, experts.gate_up_proj, experts.down_proj),
                                   rtol=1e-5, atol=1e-5)
        assert got.abs().mean() > 1e-3


def test_sweep_passes_each_launch_to_the_kernel(monkeypatch):
    """--sweep times the kernel's own launch (no ``launch``), then each of the grid's as ``launch=``."""
    seen = []

    def kernel(x, launch=None):
        seen.append(launch)
        return x

    bench = _sweep_bench(monkeypatch, kernel, ("gelu_tanh_mul", "rms_norm"))
    bench.sweep(SimpleNamespace(presets=["tiny"], m=[1], json=None), "gelu")
    grid = bench._sweeps()["gelu"][1]
    # each launch run once as a warm-up, once timed; the case the sweep does not select never runs
    assert seen == [None, None] + [over for over in grid for _ in range(2)]


def test_fp8_moe_baseline_and_wrapper_match_the_fp8_reference(monkeypatch):
    """The fp8 MoE row's Inductor baseline is HF's batched_mm on the chosen experts dequantized, and its
    sweep wrapper hands ``grouped`` to moe_experts_triton apart from the tiles."""
    from gemma4opt.ops.fp8 import quantize_rows_reference
    from gemma4opt.ops.moe_experts_fp8 import moe_experts_fp8_reference

    bench = _bench()
    g = torch.Generator().manual_seed(3)
    T, k, E, I, H = 3, 2, 5, 12, 20
    x = torch.randn(T, H, generator=g)
    (gu_q, gu_s), (d_q, d_s) = (quantize_rows_reference(torch.randn(E, 2 * I, H, generator=g) / 4),
                                quantize_rows_reference(torch.randn(E, H, I, generator=g) / 3))
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    want = moe_experts_fp8_reference(x, idx, w, gu_q, gu_s, d_q, d_s)
    torch.testing.assert_close(bench._moe_fp8_batched_ref(x, idx, w, gu_q, gu_s, d_q, d_s), want,
                               rtol=1e-5, atol=1e-5)
    assert want.abs().mean() > 1e-3
    calls = []
    monkeypatch.setattr(bench, "moe_experts_triton", lambda *a, grouped=None: calls.append((a[5], grouped)))
    bench._moe_fp8(x, idx, w, gu_q, gu_s, d_q, d_s, launch=dict(grouped=True))
    bench._moe_fp8(x, idx, w, gu_q, gu_s, d_q, d_s, launch=dict(gu_k=512))
    assert calls == [(None, True), ({"gu_k": 512}, None)]


def test_rows_sweep_sets_every_row_kernels_warps_then_restores_the_rule(monkeypatch):
    """--sweep rows runs each selected case under each warps count (row_launch answers it at decode
    rows only), and row_launch's own rule is back once the sweep is done."""
    from gemma4opt.kernels import _util

    seen = []

    def kernel(x):
        seen.append((_util.row_launch(2560, 1)[1], _util.row_launch(2560, 512)[1]))
        return x

    bench = _sweep_bench(monkeypatch, kernel, ("add_rms_norm_quant", "gelu_tanh_mul"))
    rule = _util.row_launch(2560, 1)[1]
    bench.sweep(SimpleNamespace(presets=["tiny"], m=[1], json=None), "rows")
    warps = [over["warps"] for over in bench._sweeps()["rows"][1]]
    assert seen == [(rule, 8)] * 2 + [(w, 8) for w in warps for _ in range(2)]     # 512 rows: the rule's 8
    assert _util.row_launch(2560, 1)[1] == rule


def test_every_sweep_the_gpu_session_names_is_one_the_benchmark_takes():
    """gpu_session.sh's --sweep arguments against the benchmark's sweep table (its --sweep choices): a
    sweep missing from the table fails the GPU call's stage, where no CPU test would see it."""
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_session.sh")) as f:
        named = set(re.findall(r"bench_kernels\.py --sweep (\w+)", f.read()))
    assert {"moe_pipe", "moe_fp8_pipe", "rows"} <= named
    assert named <= set(_bench()._sweeps())
