"""profile_host.py on CPU: the host-time row it writes (the tiny preset, a few tokens)."""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_host  # noqa: E402


def test_writes_the_step_time_of_the_shallow_model_and_of_the_full_one(tmp_path):
    out = tmp_path / "host.jsonl"
    profile_host.main(["--preset", "tiny", "--layers", "2", "--prompt", "8", "--new", "4", "--full",
                       "--json", str(out)])
    row = json.loads(out.read_text())
    assert (row["preset"], row["layers"], row["batch"], row["new"], row["device"]) == ("tiny", 2, 1, 4, "cpu")
    # Differences of wall times on a shared CPU: their sign is not the test's business, their presence is.
    assert math.isfinite(row["host_ms_per_step"]) and math.isfinite(row["full_ms_per_step"])


def test_stack_summary_counts_the_timed_calls_once_per_stack(tmp_path):
    """Only stacks through the timed calls count; a recursing function counts once per stack, line
    numbers are dropped, and self time is the leaf's."""
    folded = tmp_path / "host.folded"
    folded.write_text(
        "main (p.py:1);ms_per_step (p.py:9);_sample (u.py:3);f (a.py:5);f (a.py:7) 6\n"
        "main (p.py:1);ms_per_step (p.py:9);_sample (u.py:3);g (b.py:2) 2\n"
        "main (p.py:1);warm (p.py:4);_sample (u.py:3);g (b.py:2) 50\n")
    got = {fr: (inc, own) for fr, inc, own in profile_host.summarize_stacks(str(folded))}
    assert got["_sample (u.py)"] == (1.0, 0.0)
    assert got["f (a.py)"] == (0.75, 0.75) and got["g (b.py)"] == (0.25, 0.25)
    assert "warm (p.py)" not in got


def test_skip_replay_is_recorded_and_restores_replay(tmp_path, monkeypatch):
    import torch

    out = tmp_path / "host.jsonl"
    profile_host.main(["--preset", "tiny", "--layers", "2", "--prompt", "8", "--new", "4", "--skip-replay",
                       "--json", str(out)])
    assert json.loads(out.read_text())["replay_skipped"] is True
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: calls.append(self))
    original = torch.cuda.CUDAGraph.replay
    with profile_host.replays_skipped(True):
        torch.cuda.CUDAGraph.replay("graph")
    assert calls == [] and torch.cuda.CUDAGraph.replay is original
    torch.cuda.CUDAGraph.replay("graph")
    assert calls == ["graph"]


def test_no_direct_optimizes_with_every_step_through_dynamo(monkeypatch):
    import types

    got = []
    monkeypatch.setattr(profile_host.gemma4opt, "optimize", lambda model, cfg: got.append(cfg))
    monkeypatch.setattr(profile_host, "build_model", lambda *a, **k: None)
    for flag in (False, True):
        args = types.SimpleNamespace(quantization=None, quantize_lm_head=False, no_direct=flag, batch=1, prompt=8, new=4)
        profile_host.build("tiny", 2, "cpu", args)
    assert [c.direct_decode for c in got] == [True, False]


def test_stand_ins_time_the_paged_cuda_path_on_a_cpu_with_and_without_direct_steps(monkeypatch):
    import types

    for direct in (True, False):
        args = types.SimpleNamespace(quantization=None, quantize_lm_head=False, no_direct=not direct, batch=1,
                                     prompt=8, new=6)
        model = profile_host.build_with_stand_ins("tiny", 2, args, monkeypatch)
        ids = profile_host.torch.randint(3, 100, (1, 8))
        assert math.isfinite(profile_host.ms_per_step(model, ids, 6, "cpu", repeats=1))
        st = model._gemma4opt
        assert st.graph_captures == 1 and st.graphed_calls > 0
        assert (st.direct.steps > 0) == direct


def test_ops_per_step_counts_the_loops_torch_calls_by_where_they_are_made(monkeypatch):
    """HF's greedy step (argmax, the token appended, the EOS check) and gemma4opt's (the step's inputs
    copied into the captured graph's) each once per decode step; min_new_tokens adds HF's processors."""
    import types

    args = types.SimpleNamespace(quantization=None, quantize_lm_head=False, no_direct=False, batch=1, prompt=8, new=8)
    model = profile_host.build_with_stand_ins("tiny", 2, args, monkeypatch)
    ids = profile_host.torch.randint(3, 100, (1, 8))
    ops, calls = profile_host.ops_per_step(model, ids, 8)
    assert ops["aten::argmax"] == 1 and ops["aten::cat"] >= 1
    where = {name: w for (name, w), n in calls.items() if n >= 1}
    assert where["_VariableFunctionsClass.argmax"].startswith("transformers/generation/")
    assert where["Tensor.copy_"].startswith("gemma4opt/runtime/decode_graphs.py")
    more, _ = profile_host.ops_per_step(model, ids, 8, min_new=True)
    assert sum(more.values()) > sum(ops.values())
