"""benchmarks/bench_generate.py's measurement: every repeat's ms per step and the garbage
collector's time inside each timed generate come back beside the best; without CUDA graphs there
is no graph to time alone."""
import gc
import types


from tests.models import prompt, tiny
from tests.test_bench_generate_divergence import _bench


def test_measure_returns_every_repeat_and_the_collectors_time():
    bench = _bench()
    model = tiny()
    runs, collector = [], []
    ttft, ms, out, _ = bench.measure(model, prompt(1, 6), 5, "cpu", 3, runs, collector)
    assert len(runs) == 3 and ms == min(runs) and out.shape == (1, 11)
    assert len(collector) == 3 and all(t >= 0 and len(n) == 3 for t, n in collector)
    assert not any(isinstance(cb, bench._CollectorTime) for cb in gc.callbacks), "its gc callback is removed"


def test_collector_time_counts_collections_only_until_closed():
    bench = _bench()
    gc.collect(0)                       # before it exists: not counted
    timer = bench._CollectorTime()
    try:
        gc.collect(1)
        assert timer.by_gen == [0, 1, 0] and timer.ms >= 0
    finally:
        timer.close()
    gc.collect(0)
    assert timer.by_gen == [0, 1, 0], "closed: no longer counts"


def test_no_graph_no_replay_time():
    bench = _bench()
    assert bench.graph_replay_ms(types.SimpleNamespace(last_replayed=None)) is None
    assert bench.graph_replay_ms(types.SimpleNamespace()) is None
