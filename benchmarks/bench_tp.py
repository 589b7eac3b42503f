"""Tensor parallel in HF generate: gemma4opt's split (tensor_parallel=True) against HF's own tensor
parallel (tp_plan="auto") with static cache + torch.compile, on the same random-weight model, one
torchrun job; greedy tokens of both against HF eager on one device (rank 0).

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --preset 31b --layers 12 --batch 1 32 --json rows.jsonl
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --preset tiny --device cpu --systems gemma4opt-tp

Every rank builds the same model (same seed) on its device. Rank 0 first runs HF eager on the
whole model for the reference tokens, and prints and writes the rows (bench_generate.py's schema;
system "gemma4opt-tp<N>" or "hf-tp<N>-static-compile"). HF's tensor parallel loads from a
checkpoint: rank 0 saves the model to --save-dir first. Roofline per rank: the bytes of its own
share of the weights plus 1/N of the KV, at the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4opt  # noqa: E402
from bench_generate import add_run_args, measure  # noqa: E402
from gemma4opt.presets import build_model  # noqa: E402
from roofline import copy_bandwidth, kv_bytes_per_step, weight_bytes_per_step  # noqa: E402

SYSTEMS = ("gemma4opt-tp", "hf-tp")


def _hf_tp_model(model, save_dir, device, dtype):
    from transformers import AutoModelForCausalLM

    where = [save_dir or (tempfile.mkdtemp(prefix="bench_tp_") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(where, src=0)          # one directory for every rank
    if dist.get_rank() == 0:
        model.save_pretrained(where[0])
    dist.barrier()
    return AutoModelForCausalLM.from_pretrained(where[0], tp_plan="auto", dtype=dtype).to(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--save-dir", default=None, help="where rank 0 saves the model for HF's tp_plan (default: a "
                    "new temporary directory, left behind)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", default=None)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(args.preset, args.layers, dtype=dtype, device=device)
    cfg = model.config.get_text_config()
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, cfg.vocab_size, (b, args.prompt), generator=g).to(device) for b in args.batch}
    want = {}
    if rank == 0:
        for b in args.batch:
            want[b] = measure(model, prompts[b], args.new, args.device, 1)[2]
    bw = copy_bandwidth(device)
    kv = {b: kv_bytes_per_step(model, b, args.prompt + args.new // 2) / world for b in args.batch}
    machine = f"{world} x {torch.cuda.get_device_name() if cuda else 'cpu'}"
    run = args.run or time.strftime("%Y-%m-%d %H:%M/") + f"{args.preset}_l{cfg.num_hidden_layers}_tp{world}"
    command = f"torchrun --nproc-per-node {world} benchmarks/bench_tp.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    rows = []
    for system in args.systems:
        if system == "gemma4opt-tp":
            sys_model, kw, name = model, {}, f"gemma4opt-tp{world}"
            gemma4opt.optimize(sys_model, gemma4opt.Gemma4OptConfig(
                tensor_parallel=True, attention="paged" if cuda else "auto", max_batch_size=max(args.batch),
                max_seq_len=args.prompt + args.new + 16))
        else:
            from transformers import CompileConfig

            sys_model = _hf_tp_model(model, args.save_dir, device, dtype)
            cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
            cc._compile_all_devices = True
            kw, name = dict(cache_implementation="static", compile_config=cc), f"hf-tp{world}-static-compile"
        for b in args.batch:
            ttft, ms, out, warm = measure(sys_model, prompts[b], args.new, args.device, args.repeats, **kw)
            roof = (weight_bytes_per_step(sys_model, b) + kv[b]) / bw * 1e3
            if rank == 0:
                row = dict(run=run, machine=machine, command=command, preset=args.preset,
                           layers=cfg.num_hidden_layers, batch=b, prompt=args.prompt, new=args.new, system=name,
                           warmup_s=warm, ttft_ms=ttft, ms_per_step=ms, tok_s=b * 1e3 / ms, roofline_ms=roof,
                           roofline_frac=roof / ms, tokens_equal_eager=bool(torch.equal(out, want[b])))
                print(f"{b:>5} {name:>24} warm-up {warm:7.1f} s  TTFT {ttft:8.1f} ms  {ms:8.2f} ms/step  "
                      f"roofline {roof / ms:4.0%}  tokens == eager: {row['tokens_equal_eager']}", flush=True)
                rows.append(row)
        if system == "gemma4opt-tp":
            if rank == 0:
                gemma4opt.report(sys_model)
            model = build_model(args.preset, args.layers, dtype=dtype, device=device)   # the split is in place
    if rank == 0 and args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
