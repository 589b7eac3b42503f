"""The host's share of a decode step: how long HF generate's loop and gemma4opt's step take in Python.

    python benchmarks/profile_host.py --preset e2b --layers 2 --new 64 [--full]

A decode step is one CUDA-graph replay, so with few layers the GPU finishes each step long before
the host has the next one ready: the wall time per token of a ``--layers 2`` model is the host's
time per step, the floor under every preset's ms/token at batch 1 (HF's deferred stop check lets
the host queue step t+1 while step t runs, so a step costs max(host, device)). ``--full`` also
times the preset at full depth for comparison. (Not cProfile: Dynamo's frame hooks hide most of
generate's frames from it; on the H200 its listing missed generate itself.)
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import gemma4opt
from gemma4opt.presets import ALL_PRESETS, build_model


def _gen(model, ids, new):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def ms_per_step(model, ids, new, device, repeats=3) -> float:
    """Best of ``repeats``: (generate of ``new`` tokens - generate of 1) / (new - 1), after a warm-up."""
    _gen(model, ids, new)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _gen(model, ids, 1)
        _sync(device)
        t1 = time.perf_counter()
        _gen(model, ids, new)
        _sync(device)
        t2 = time.perf_counter()
        best = min(best, ((t2 - t1) - (t1 - t0)) * 1e3 / (new - 1))
    return best


def build(preset, layers, device, args):
    model = build_model(preset, layers, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    opts = dict(quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)
    if device == "cuda":
        opts.update(attention="paged", max_batch_size=args.batch, max_seq_len=args.prompt + args.new + 16)
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(**opts))
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
    ap.add_argument("--json", default=None, help="append one result row to this JSON-lines file")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(args.preset, args.layers, device, args)
    ids = torch.randint(3, min(1000, model.config.vocab_size), (args.batch, args.prompt), device=device)
    t = time.perf_counter()
    _gen(model, ids, args.new)
    _sync(device)
    print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    host_ms = ms_per_step(model, ids, args.new, device)
    print(f"{args.preset} x {args.layers} layers, batch {args.batch}: {host_ms:.3f} ms per decode step "
          f"(the host's time per step: the device's is a fraction of it)", flush=True)
    row = dict(preset=args.preset, layers=args.layers, batch=args.batch, prompt=args.prompt, new=args.new,
               quantization=args.quantization, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               host_ms_per_step=host_ms)
    if args.full:
        del model
        torch._dynamo.reset()
        full = build(args.preset, None, device, args)
        row["full_ms_per_step"] = ms_per_step(full, ids, args.new, device)
        print(f"{args.preset} full depth, batch {args.batch}: {row['full_ms_per_step']:.3f} ms per decode step",
              flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
