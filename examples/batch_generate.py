"""Batch generation: prompts of different lengths, left-padded, on the paged KV cache.

    python examples/batch_generate.py                 # demo preset on the CPU
    python examples/batch_generate.py --lengths 5 40 90 --new-tokens 32

Each row's tokens equal what HF eager generates for the same padded batch; the report shows
the KV pool (sliding-window pages are freed as generation moves on).
"""
from __future__ import annotations

import argparse

import torch

import gemma4opt
from gemma4opt.presets import build_model


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--lengths", type=int, nargs="+", default=[7, 23, 50])
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    model = build_model(args.preset)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(3, vocab, (n,), generator=g) for n in args.lengths])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False)
    gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(attention="paged", max_batch_size=len(args.lengths),
                                                         max_seq_len=ids.shape[1] + args.new_tokens))
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False)
    for n, row in zip(args.lengths, got[:, ids.shape[1]:].tolist()):
        print(f"prompt of {n:>3} tokens -> {row}")
    print("tokens equal to HF eager:", torch.equal(got, want))
    gemma4opt.report(model)
    return 0 if torch.equal(got, want) else 1


if __name__ == "__main__":
    raise SystemExit(main())
