"""Generate with an optimized Gemma-4 model next to HF eager; print ids, ms/token and the match report.

    python examples/generate.py                        # embedded 'demo' preset, CPU, < 1 minute
    python examples/generate.py --preset 31b --layers 12 --device cuda   # the one-liner: paged mode on CUDA
    python examples/generate.py --preset 31b --layers 12 --device cuda --attention hf      # HF attention + cache
    python examples/generate.py --model /path/to/gemma-4-checkpoint --device cuda
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import gemma4opt
from gemma4opt.presets import ALL_PRESETS, build_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed_generate(model, ids, new_tokens):
    def sync():
        if ids.is_cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync()
    return out, (time.perf_counter() - t0) * 1000 / new_tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo", choices=sorted(ALL_PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="cut the preset's depth to N layers")
    ap.add_argument("--model", default=None, help="local checkpoint directory (overrides --preset)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", default="auto", choices=["auto", "hf", "paged"],
                    help="auto (default): gemma4opt.optimize(model) as is, the fastest mode that runs here; hf: "
                         "HF attention over HF's cache; paged: the paged KV cache sized for this run (FlashInfer "
                         "on CUDA: the [gpu] extra)")
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]

    if args.model:
        from gemma4opt.loading import load_local

        model = load_local(args.model, dtype, args.device)
    else:
        model = build_model(args.preset, args.layers, dtype=dtype, device=args.device, seed=args.seed)
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=g).to(args.device)

    eager = copy.deepcopy(model) if not args.model else model
    timed_generate(eager, ids, 2)                              # warm-up
    want, eager_ms = timed_generate(eager, ids, args.new_tokens)
    if eager is not model:
        del eager

    config = None                     # the one-liner: every default
    if args.attention == "hf":
        config = gemma4opt.Gemma4OptConfig(attention="hf")
    elif args.attention == "paged":   # a pool sized for exactly this run
        config = gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=args.batch,
                                           max_seq_len=args.prompt_len + args.new_tokens + 16)
    gemma4opt.optimize(model, config)
    timed_generate(model, ids, args.new_tokens)                # compiles prefill + decode graphs
    got, opt_ms = timed_generate(model, ids, args.new_tokens)

    print("generated ids:", got[:, args.prompt_len:].tolist())
    print(f"HF eager : {eager_ms:8.2f} ms/token")
    print(f"gemma4opt: {opt_ms:8.2f} ms/token  ({eager_ms / opt_ms:.2f}x)")
    print("tokens equal to HF eager:", torch.equal(got, want))
    gemma4opt.report(model)
    return 0 if torch.equal(got, want) or dtype != torch.float32 else 1


if __name__ == "__main__":
    raise SystemExit(main())
