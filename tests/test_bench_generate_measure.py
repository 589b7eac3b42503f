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


def test_rebuild_optimizes_the_model_itself_and_rebuilds_the_same_weights_after():
    """--rebuild (two copies of the 26b-a4b's weights do not fit an H100): each optimized system but the
    last runs on the model itself and the next gets the same seed's model again, unoptimized; the tokens
    then equal eager's as a copy's would (tiny, fp32, CPU)."""
    bench = _bench()
    built = []
    real = bench.build_model
    bench.build_model = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    try:
        rows = bench.main(["--preset", "tiny", "--prompt", "6", "--new", "4", "--repeats", "1", "--rebuild",
                           "--systems", "eager", "gemma4opt", "gemma4opt", "--device", "cpu"])
    finally:
        bench.build_model = real
    assert len(built) == 2              # the first, then one rebuild for the last system (none after it)
    assert hasattr(built[0], "_gemma4opt") and hasattr(built[1], "_gemma4opt")
    assert [r["tokens_equal_eager"] for r in rows] == [True, True, True]
