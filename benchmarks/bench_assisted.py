"""Assisted (speculative) decoding on optimized models: a small Gemma-4 drafting for a large one.

    python benchmarks/bench_assisted.py --preset 31b --layers 12 --assistant e2b     # the H200 run
    python benchmarks/bench_assisted.py --preset tiny --assistant tiny-ple-shared --device cpu

Runs, in one process and on the same prompts: the target alone (gemma4opt one-liner), the target
with the assistant (both optimized), and HF eager greedy as the reference; prints ms per new token,
the target's forward calls per generate (with an assistant, each verifies a draft: new tokens
per call - 1 is the mean number of draft tokens accepted), and whether the tokens equal HF eager's
(assisted greedy must give exactly the plain greedy tokens). With random weights the assistant's
drafts are mostly rejected, so the speed-up is a lower bound: the figures show the cost of the
machinery, not the gain a trained pair would see; ``--accept-all`` gives the other bound, a
perfect drafter.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4opt  # noqa: E402
from gemma4opt.presets import ALL_PRESETS, build_model  # noqa: E402


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device, fn):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - t) * 1e3


def _drafts_all_accepted(*models) -> None:
    """Zero what every layer adds to the residual stream (attention and MLP output projections,
    per-layer-input projections): each model's logits then come from the current token's
    embedding alone, whose largest logit (random embeddings) is that token's own, so target and
    assistant both repeat the last token and every draft is accepted. The weights are still
    read: a step costs what it costs with real weights. What it measures is the machinery with a
    perfect drafter, the bound of the speed-up at a given draft length."""
    with torch.no_grad():
        for m in models:
            for name, mod in m.named_modules():
                if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in (
                        "o_proj", "down_proj", "per_layer_projection"):
                    mod.weight.zero_()


def _assisted(model, assistant, ids, new):
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, assistant_model=assistant, **kw) if assistant is not None \
            else model.generate(ids, **kw)
    return out


def _phases(target, assistant, ids, new, device):
    """One assisted generate with the assistant's generate and the target's forward timed (each
    synchronized): how many rounds, how long each side takes per round, how many tokens a draft has,
    and whether Dynamo recompiled or graph captures happened inside the run."""
    import torch._dynamo.utils as dyn

    log = {"draft": [], "verify": []}

    def timed(kind, fn):
        @functools.wraps(fn)      # HF reads the forward's signature (logits_to_keep): keep it
        def wrapper(*a, **k):
            _sync(device)
            t = time.perf_counter()
            out = fn(*a, **k)
            _sync(device)
            ms = (time.perf_counter() - t) * 1e3
            n = k.get("input_ids", a[0] if a else None)
            log[kind].append((ms, None if n is None else tuple(n.shape), out))
            return out
        return wrapper

    saved = {"draft": assistant.__dict__.get("generate"), "verify": target.__dict__.get("forward")}
    assistant.generate = timed("draft", saved["draft"] or assistant.generate)
    target.forward = timed("verify", saved["verify"] or target.forward)
    before = {k: dict(v) for k, v in dyn.counters.items()}
    caps = (target._gemma4opt.graph_captures, assistant._gemma4opt.graph_captures)
    try:
        _sync(device)
        t = time.perf_counter()
        _assisted(target, assistant, ids, new)
        _sync(device)
        total = (time.perf_counter() - t) * 1e3
    finally:
        for kind, obj, name in (("draft", assistant, "generate"), ("verify", target, "forward")):
            if saved[kind] is None:
                del obj.__dict__[name]
            else:
                setattr(obj, name, saved[kind])
    draft_ms = sum(m for m, _, _ in log["draft"])
    verify_ms = sum(m for m, _, _ in log["verify"])
    rounds = max(len(log["draft"]), 1)
    drafted = [o.sequences.shape[-1] - s[-1] for _, s, o in log["draft"] if s is not None and hasattr(o, "sequences")]
    print(f"# phases of one assisted generate: {total:.1f} ms in all; {len(log['draft'])} assistant generates "
          f"({draft_ms:.1f} ms, {draft_ms / rounds:.2f} per round; drafted tokens per round: {drafted[:12]}...); "
          f"{len(log['verify'])} target forwards ({verify_ms:.1f} ms; input lengths "
          f"{[s[-1] for _, s, _ in log['verify'] if s][:12]}...; first calls ms "
          f"{[round(m, 2) for m, _, _ in log['verify'][:8]]}); the rest (HF's loop, acceptance, crops): "
          f"{total - draft_ms - verify_ms:.1f} ms", flush=True)
    print(f"# assistant generate ms, first rounds: {[round(m, 2) for m, _, _ in log['draft'][:8]]}")
    changed = {f"{k}.{n}": c - before.get(k, {}).get(n, 0) for k, v in dyn.counters.items() for n, c in v.items()
               if c != before.get(k, {}).get(n, 0)}
    print(f"# Dynamo counters that moved during the run: {changed or 'none'}; graph captures (target, assistant): "
          f"{target._gemma4opt.graph_captures - caps[0]}, {assistant._gemma4opt.graph_captures - caps[1]}")


def _profile(target, assistant, ids, new, device):
    """One assisted generate under cProfile (the host's Python, by cumulative time) and under
    torch.profiler (launches, graph replays and host syncs per target call)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    _phases(target, assistant, ids, new, device)
    prof = cProfile.Profile()
    prof.enable()
    _assisted(target, assistant, ids, new)
    _sync(device)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    calls = target._gemma4opt.compiled_calls
    with profile(activities=acts) as tprof:
        _assisted(target, assistant, ids, new)
        _sync(device)
    calls = target._gemma4opt.compiled_calls - calls
    events = tprof.key_averages()
    count = {k: sum(e.count for e in events if k in e.key) for k in
             ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "Synchronize", "plan")}
    print(f"# profile of one assisted generate: {calls} target calls; " + ", ".join(
        f"{k}: {v} ({v / max(calls, 1):.1f} per call)" for k, v in count.items()))
    print(events.table(sort_by="self_cpu_time_total", row_limit=20))
    if device.startswith("cuda"):
        print(events.table(sort_by="self_cuda_time_total", row_limit=12))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(ALL_PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--assistant", default="tiny-ple-shared", choices=sorted(ALL_PRESETS))
    ap.add_argument("--assistant-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="append result rows to this JSON-lines file")
    ap.add_argument("--draft", type=int, default=None,
                    help="the assistant drafts this many tokens every round (HF's constant schedule, confidence "
                         "threshold 0); default: HF's defaults (heuristic schedule from 20, stop below 0.4)")
    ap.add_argument("--accept-all", action="store_true",
                    help="zero every layer's output projections in both models so that the drafts are all "
                         "accepted (both repeat the last token): the speed-up of a perfect drafter")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile one assisted generate: where a round's time goes (host ops, "
                         "kernels, launches, syncs)")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = build_model(args.preset, args.layers, dtype=dtype, device=args.device)
    assistant = build_model(args.assistant, args.assistant_layers, dtype=dtype, device=args.device, seed=1)
    vocab = target.config.get_text_config().vocab_size
    if assistant.config.get_text_config().vocab_size != vocab:
        raise SystemExit(f"--assistant {args.assistant} has another vocabulary than --preset {args.preset}")
    if args.accept_all:
        _drafts_all_accepted(target, assistant)
    if args.draft is not None:
        gen = assistant.generation_config
        gen.num_assistant_tokens_schedule, gen.num_assistant_tokens = "constant", args.draft
        gen.assistant_confidence_threshold = 0.0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=g).to(args.device)

    want, eager_ms = _timed(args.device, lambda: _assisted(target, None, ids, args.new))
    gemma4opt.optimize(target)
    gemma4opt.optimize(assistant)
    rows = []
    for name, helper in (("target alone", None), ("target + assistant", assistant)):
        _assisted(target, helper, ids, args.new)            # warm-up: compiles, JIT, captures
        best, out = None, None
        for _ in range(args.repeats):
            calls = target._gemma4opt.compiled_calls
            out, ms = _timed(args.device, lambda: _assisted(target, helper, ids, args.new))
            calls = target._gemma4opt.compiled_calls - calls
            best = ms if best is None else min(best, ms)
        same = torch.equal(out, want)
        row = dict(run=time.strftime("%Y-%m-%d %H:%M/") + f"{args.preset}_{args.assistant}_assisted",
                   machine=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                   command="python3 benchmarks/bench_assisted.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   preset=args.preset, layers=target.config.get_text_config().num_hidden_layers,
                   assistant=args.assistant if helper is not None else None, batch=args.batch, prompt=args.prompt,
                   new=args.new, draft=args.draft, accept_all=args.accept_all, system=name, ms_per_token=best / args.new,
                   eager_ms_per_token=eager_ms / args.new, target_calls=calls,
                   tokens_equal_eager=same)
        rows.append(row)
        print(f"{name:>20}: {row['ms_per_token']:.2f} ms/token (whole generate / new tokens), {calls} target "
              f"forward calls for {args.new} tokens, tokens==eager {same}", flush=True)
    print(f"{'HF eager, target':>20}: {eager_ms / args.new:.2f} ms/token (one run, compile-free)")
    if args.profile:
        _profile(target, assistant, ids, args.new, args.device)
    st = target._gemma4opt
    print(f"# target: graphs compiled {st.graphs_compiled}, graph replays {st.graphed_calls}, captures "
          f"{st.graph_captures}; assistant: replays {assistant._gemma4opt.graphed_calls}, captures "
          f"{assistant._gemma4opt.graph_captures}")
    gemma4opt.report(target)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
