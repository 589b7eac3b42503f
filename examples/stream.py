"""Streaming: tokens arrive through HF's streamer API while the optimized model generates.

    python examples/stream.py [--preset demo] [--new-tokens 24]

Random-weight presets have no tokenizer, so the streamer prints token ids as they come.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers.generation.streamers import BaseStreamer

import gemma4opt
from gemma4opt.presets import build_model


class PrintIds(BaseStreamer):
    def __init__(self):
        self.first, self.t0, self.count = True, time.perf_counter(), 0

    def put(self, value):
        if self.first:                 # generate puts the prompt first
            self.first = False
            return
        for tok in value.reshape(-1).tolist():
            self.count += 1
            print(tok, end=" ", flush=True)

    def end(self):
        dt = time.perf_counter() - self.t0
        print(f"\n{self.count} tokens streamed in {dt:.2f} s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    model = gemma4opt.optimize(build_model(args.preset))
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)    # warm-up: compiles the graphs
        model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, streamer=PrintIds())


if __name__ == "__main__":
    main()
