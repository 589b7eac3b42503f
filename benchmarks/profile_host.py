"""The host's share of a decode step: how long HF generate's loop and gemma4opt's step take in Python.

    python benchmarks/profile_host.py --preset e2b --layers 2 --new 64 [--full]

A decode step is one CUDA-graph replay, so with few layers the GPU finishes each step long before
the host has the next one ready: the wall time per token of a ``--layers 2`` model is the host's
time per step, the floor under every preset's ms/token at batch 1 (HF's deferred stop check lets
the host queue step t+1 while step t runs, so a step costs max(host, device)). ``--full`` also
times the preset at full depth for comparison; with ``--skip-replay`` the captured graphs are not
replayed after the warm-up, so any depth's ms per step is the host's work alone (Dynamo's entry over
all the parameters included, cudaGraphLaunch's own cost not: bench_generate's ``graph_launch_ms``
has that). (Not cProfile: Dynamo's frame hooks hide most of
generate's frames from it; on the H200 its listing missed generate itself.)

Without a GPU, ``--stand-ins`` runs the same paged path on the CPU with CUDA graphs and FlashInfer
stood in (the tests' stand-ins) and every captured graph's replay a no-op: the host's work per step
of the CUDA path, at any depth, in fp32 (``--preset tiny --layers 42``: the e4b's depth).

How many torch calls HF generate's loop and gemma4opt's step make per decode step outside the
captured graph (on a GPU each launches a kernel or more; ``--ops``): the aten operators torch.profiler
sees, and the named torch calls by the transformers or gemma4opt line that makes them, the same generate
of ``--new`` tokens minus one of 2 tokens, per decode step (bench_generate's min_new_tokens off, on with
``--min-new-tokens``).

Where the host's time goes: sample the run with py-spy (a sampling profiler: it reads the stacks
from outside, Dynamo or not), then summarize its stacks of the timed generate calls:

    py-spy record --format raw -o host.folded --rate 500 -- python benchmarks/profile_host.py ...
    python benchmarks/profile_host.py --stacks host.folded
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import gemma4opt  # noqa: E402
from bench_generate import _gen, _sync, measure  # noqa: E402
from gemma4opt.presets import ALL_PRESETS, build_model  # noqa: E402


def ms_per_step(model, ids, new, device, repeats=3) -> float:
    """bench_generate's measure (best of ``repeats`` after a warm-up): ms per decode step."""
    return measure(model, ids, new, device, repeats)[1]


def ops_per_step(model, ids, new: int, min_new: bool = False) -> tuple[collections.Counter, collections.Counter]:
    """(top-level aten operators, named torch calls by (call, file:line) in transformers or gemma4opt
    code) per decode step: a generate of ``new`` tokens minus one of 2 (module doc). Operators Python
    reaches through its number slots (``a * b``) are among the first, not the second."""
    def gen(n):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n if min_new else None, do_sample=False)

    def aten(n):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            gen(n)
        return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))

    def calls(n):
        got = collections.Counter()

        def hook(frame, event, fn):
            if event != "c_call":
                return
            owner = getattr(fn, "__self__", None)
            if not ("torch" in (getattr(fn, "__module__", None) or "") or isinstance(owner, torch.Tensor)
                    or type(owner).__module__.startswith("torch")):
                return
            where = frame.f_code.co_filename.replace(os.sep, "/")
            for root in ("transformers/", "gemma4opt/"):
                if root in where:
                    where = root + where.rsplit(root, 1)[1]
                    got[(getattr(fn, "__qualname__", str(fn)), f"{where}:{frame.f_lineno}")] += 1
                    return

        sys.setprofile(hook)
        try:
            gen(n)
        finally:
            sys.setprofile(None)
        return got

    gen(new)
    steps = new - 2
    per = [collections.Counter({k: v / steps for k, v in (f(new) - f(2)).items()}) for f in (aten, calls)]
    return per[0], per[1]


def summarize_stacks(path: str, top: int = 40, within: str = "ms_per_step (") -> list[tuple[str, float, float]]:
    """py-spy's raw (folded) stacks -> [(function, inclusive share, self share)] of the samples
    taken inside the timed generate calls (stacks through ``within``), biggest inclusive first. A
    function counts once per stack however often it recurses; line numbers are dropped."""
    incl, own, total = {}, {}, 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if within not in stack or not n.isdigit():
                continue
            n = int(n)
            total += n
            frames = [_frame(fr) for fr in stack.split(";")]
            for fr in set(frames):
                incl[fr] = incl.get(fr, 0) + n
            own[frames[-1]] = own.get(frames[-1], 0) + n
    if not total:
        return []
    rows = sorted(incl, key=incl.get, reverse=True)[:top]
    return [(fr, incl[fr] / total, own.get(fr, 0) / total) for fr in rows]


def _frame(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (path/file.py)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


@contextlib.contextmanager
def replays_skipped(skip: bool):
    """With ``skip``: every captured CUDA graph's replay a no-op (launch and device work gone, the
    tokens then meaningless), so a full-depth model's ms per step is the host's work alone, Dynamo's
    entry over all its parameters included, without cudaGraphLaunch's cost."""
    if not skip or not torch.cuda.is_available():
        yield
        return
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = lambda self: None
    try:
        yield
    finally:
        torch.cuda.CUDAGraph.replay = replay


def build(preset, layers, device, args):
    model = build_model(preset, layers, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    opts = dict(quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                direct_decode=not args.no_direct)
    if device == "cuda":
        opts.update(attention="paged", max_batch_size=args.batch, max_seq_len=args.prompt + args.new + 16)
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(**opts))
    return model


def build_with_stand_ins(preset, layers, args, patches=None):
    """The paged path with CUDA graphs on a CPU, FlashInfer and the graphs stood in as the tests
    do, each replay a no-op (module doc). Needs the repository's tests/ and pytest. ``patches``: a
    pytest MonkeyPatch to undo the stand-ins with (a test's); by default they stay for the process."""
    import types

    import pytest

    sys.path.insert(0, ROOT)
    from gemma4opt.runtime import decode_graphs
    from tests.runtime.test_paged_graphs import PAGED, _optimize_with_stand_ins

    model = build_model(preset, layers, dtype=torch.float32)
    patches = patches if patches is not None else pytest.MonkeyPatch()
    config = dataclasses.replace(PAGED, max_batch_size=args.batch, max_seq_len=args.prompt + args.new + 16,
                                 direct_decode=not args.no_direct)
    _optimize_with_stand_ins(patches, model, config)

    def capture(graphed, inputs):
        outputs = list(graphed.gm(*inputs))        # run once: the outputs a replay would write
        moving = {i: inputs[i].clone() for i in graphed.moving}
        return decode_graphs._Captured(types.SimpleNamespace(replay=lambda: None), moving, outputs)

    patches.setattr(decode_graphs.GraphedDecode, "_capture", capture)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="e2b", choices=sorted(ALL_PRESETS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--full", action="store_true", help="also time the preset at full depth")
    ap.add_argument("--skip-replay", action="store_true",
                    help="after the warm-up, captured decode graphs are not replayed: the host's work alone at any depth")
    ap.add_argument("--no-direct", action="store_true",
                    help="every decode step enters Dynamo (direct_decode=False): what skipping its entry saves")
    ap.add_argument("--stand-ins", action="store_true",
                    help="on a CPU: the paged CUDA path with graphs and FlashInfer stood in, replays no-ops (module doc)")
    ap.add_argument("--ops", action="store_true",
                    help="torch calls per decode step outside the captured graph, by where they are made (module doc)")
    ap.add_argument("--min-new-tokens", action="store_true", help="with --ops: generate with min_new_tokens")
    ap.add_argument("--json", default=None, help="append one result row to this JSON-lines file")
    ap.add_argument("--stacks", default=None, help="only summarize this py-spy raw profile of a run of this script")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    if args.stacks:
        print(f"{'incl':>6} {'self':>6}  function (share of the samples in the timed generate calls)")
        for fr, inc, slf in summarize_stacks(args.stacks, args.top):
            print(f"{inc:6.1%} {slf:6.1%}  {fr}")
        return
    device = "cuda" if torch.cuda.is_available() and not args.stand_ins else "cpu"
    model = build_with_stand_ins(args.preset, args.layers, args) if args.stand_ins else \
        build(args.preset, args.layers, device, args)
    ids = torch.randint(3, min(1000, model.config.vocab_size), (args.batch, args.prompt), device=device)
    t = time.perf_counter()
    _gen(model, ids, args.new)
    _sync(device)
    print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    if args.ops:
        ops, calls = ops_per_step(model, ids, args.new, args.min_new_tokens)
        print(f"{args.preset} x {args.layers} layers, batch {args.batch}"
              f"{', min_new_tokens' if args.min_new_tokens else ''}: {sum(ops.values()):.1f} aten operators per decode "
              f"step outside the captured graph (torch {torch.__version__})")
        for name, n in ops.most_common():
            print(f"  {n:5.2f}  {name}")
        by = collections.Counter()
        for (_, where), n in calls.items():
            by[where.split("/")[0]] += n
        print("named torch calls per decode step (kernel launches and host-side calls such as data_ptr) by where "
              "they are made: "
              + ", ".join(f"{k} {v:.1f}" for k, v in by.most_common()))
        for (name, where), n in sorted(calls.items(), key=lambda kv: kv[0][1]):
            print(f"  {n:5.2f}  {name:40s} {where}")
        return
    with replays_skipped(args.skip_replay):
        host_ms = ms_per_step(model, ids, args.new, device)
    what = ("graphs not replayed: the host's work alone" if args.skip_replay
            else "the host's time per step: the device's is a fraction of it")
    if args.stand_ins:
        what = f"the CPU path with CUDA graphs and FlashInfer stood in, replays no-ops: the host's work alone (torch {torch.__version__})"
    if args.no_direct:
        what += "; every step through Dynamo's entry"
    print(f"{args.preset} x {args.layers} layers, batch {args.batch}: {host_ms:.3f} ms per decode step ({what})",
          flush=True)
    row = dict(preset=args.preset, layers=args.layers, batch=args.batch, prompt=args.prompt, new=args.new,
               quantization=args.quantization, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               host_ms_per_step=host_ms, replay_skipped=args.skip_replay, direct_decode=not args.no_direct,
               stand_ins=args.stand_ins, torch=torch.__version__)
    if args.full:
        del model
        torch._dynamo.reset()
        full = build(args.preset, None, device, args)
        if args.skip_replay:
            _gen(full, ids, args.new)       # captures its graphs while replays still run
        with replays_skipped(args.skip_replay):
            row["full_ms_per_step"] = ms_per_step(full, ids, args.new, device)
        print(f"{args.preset} full depth, batch {args.batch}: {row['full_ms_per_step']:.3f} ms per decode step",
              flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
