"""A decode step's kernels split into its decoder layers: launches, time, idle time and bytes per layer.

profile_decode.py prints this for the last decode step it profiled. Where the layers are cut:
- every decoder layer has one attention run (its attention kernels back to back: the split kernel and
  the merge, or FlashInfer's);
- a layer starts at its q/k/v projection, the GEMM kernel last before its attention run (with a
  split-K GEMM, the kernel before that GEMM's reduce kernel), so a layer ends with its MLP's tail
  (with norm_linear the projection kernel also makes the previous layer's tail: it counts here);
- what comes before layer 0's projection is the step's prologue (the step inputs' copies, embeddings,
  rope tables, layer 0's input norm); the last layer is taken as long as the one before it, and what
  follows it is the head (final norm where the last tail does not make it, lm_head, sampling).

A layer's time runs from its first kernel's start to the next layer's first kernel's start, so the
prologue, the layers and the head add up to the step; idle is that time less the union of its
kernels' intervals. A kernel's own time is what it adds after the kernels before it ended: with
programmatic dependent launch a kernel starts while the one before it runs and waits, so its start
to end overstates it; without, the two are equal. Own times and idle gaps add up to the layer's time
(where no kernel of the next layer overlaps it). With a layer's bytes (its weights and the KV its attention reads,
benchmarks/roofline.py) its share of the copy bandwidth follows. Layers with the same kernels in the
same order (a layer kind: sliding or full, owning KV or sharing it, dense or MoE) are summarized
together, medians over their layers, with each kernel's median time and the idle time before it.
"""
from __future__ import annotations

import statistics
from typing import NamedTuple

# Split-K reduces: the GEMM they finish started one kernel before.
_REDUCES = ("splitKreduce", "_split_sum")


class Kernel(NamedTuple):
    name: str
    start: float        # us
    end: float


def split_layers(kernels: list[Kernel], is_attention, is_gemm) -> tuple[list[Kernel], list[list[Kernel]], list[Kernel]]:
    """(prologue, layers, head) of one decode step's kernels in launch order (module doc)."""
    runs, i = [], 0
    while i < len(kernels):                     # attention runs: where each starts
        if is_attention(kernels[i].name):
            runs.append(i)
            while i < len(kernels) and is_attention(kernels[i].name):
                i += 1
        else:
            i += 1
    starts, floor = [], 0
    for a in runs:
        j = next((j for j in range(a - 1, floor - 1, -1) if is_gemm(kernels[j].name)), None)
        if j is None:
            raise ValueError(f"no GEMM kernel before the attention kernel at {a} ({kernels[a].name}) "
                             "after the layer before: cannot tell where its layer starts")
        if j > floor and any(r in kernels[j].name for r in _REDUCES):
            j -= 1
        starts.append(j)
        floor = a + 1
    if not starts:
        return list(kernels), [], []
    # The last layer: as long as the one before it (a lone layer: the rest of the step), at least
    # through its attention run.
    last = starts[-1] + (starts[-1] - starts[-2]) if len(starts) > 1 else len(kernels)
    ends = starts[1:] + [min(max(last, runs[-1] + 1), len(kernels))]
    layers = [kernels[s:e] for s, e in zip(starts, ends)]
    return kernels[:starts[0]], layers, kernels[ends[-1]:]


def _busy(ks: list[Kernel]) -> float:
    """The union of the kernels' intervals (overlapping kernels counted once)."""
    total, end = 0.0, None
    for k in sorted(ks, key=lambda k: k.start):
        if end is None or k.start >= end:
            total += k.end - k.start
            end = k.end
        elif k.end > end:
            total += k.end - end
            end = k.end
    return total


class LayerStats(NamedTuple):
    index: int
    start: float
    names: tuple[str, ...]
    time: float             # us, to the next layer's first kernel (the head's, for the last)
    idle: float
    durations: tuple[float, ...]
    own: tuple[float, ...]      # each kernel's time after the latest end before it (module doc)
    gaps: tuple[float, ...]     # idle before each kernel, from the latest end before it
    nbytes: int | None


def layer_stats(layers: list[list[Kernel]], head: list[Kernel],
                nbytes: dict[int, int] | None = None) -> list[LayerStats]:
    out = []
    for i, ks in enumerate(layers):
        nxt = layers[i + 1][0].start if i + 1 < len(layers) else (head[0].start if head else max(k.end for k in ks))
        time = nxt - ks[0].start
        gaps, own, end = [], [], ks[0].start
        for k in ks:
            gaps.append(max(k.start - end, 0.0))
            own.append(max(k.end - max(k.start, end), 0.0))
            end = max(end, k.end)
        out.append(LayerStats(i, ks[0].start, tuple(k.name for k in ks), time, time - _busy(ks),
                              tuple(k.end - k.start for k in ks),
                              tuple(own), tuple(gaps), None if nbytes is None else nbytes.get(i)))
    return out


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    parts, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def report(stats: list[LayerStats], prologue: list[Kernel], head: list[Kernel], copy_bw: float | None = None,
           name_width: int = 60) -> list[str]:
    """The table's lines: one per layer kind, then each kind's kernels (module doc). ``copy_bw`` in bytes/s."""
    if not stats:
        return ["per-layer timeline: no attention kernel in the step (no layers found)"]
    step = sum(s.time for s in stats)
    pro = stats[0].start - prologue[0].start if prologue else 0.0
    tail = max(k.end for k in head) - head[0].start if head else 0.0
    lines = [f"per-layer timeline of the last decode step: {len(stats)} layers, {step:.1f} us "
             f"({step / len(stats):.1f} us and {sum(len(s.names) for s in stats) / len(stats):.1f} launches a layer); "
             f"prologue {len(prologue)} kernels over {pro:.1f} us, head {len(head)} over {tail:.1f} us"
             + (f"; copy bandwidth {copy_bw / 1e12:.2f} TB/s" if copy_bw else ""),
             "  kind  layers          launches  us a layer  idle us  MB a layer  % of copy BW"]
    kinds: dict[tuple, list[LayerStats]] = {}
    for s in stats:
        kinds.setdefault(s.names, []).append(s)
    order = sorted(kinds.values(), key=lambda g: g[0].index)
    for n, group in enumerate(order):
        t = statistics.median(s.time for s in group)
        idle = statistics.median(s.idle for s in group)
        known = [s.nbytes for s in group if s.nbytes is not None]
        mb = statistics.median(known) / 1e6 if known else None
        bw = (f"{mb * 1e6 / (t * 1e-6) / copy_bw:.0%}" if mb is not None and copy_bw and t > 0 else "-")
        lines.append(f"  {chr(65 + n) if n < 26 else n:>4}  {_ranges([s.index for s in group]):<15} "
                     f"{len(group[0].names):8d}  {t:10.1f}  {idle:7.1f}  "
                     + (f"{mb:10.2f}" if mb is not None else f"{'-':>10}") + f"  {bw:>12}")
    for n, group in enumerate(order):
        lines.append(f"  kind {chr(65 + n) if n < 26 else n} ({len(group)} layers), its kernels in order, medians: "
                     "us from start to end, us after the kernels before it ended, idle us before it")
        for j, name in enumerate(group[0].names):
            d, o, g = (statistics.median(getattr(s, f)[j] for s in group) for f in ("durations", "own", "gaps"))
            lines.append(f"    {d:7.1f} {o:7.1f} {g:6.1f}  {name[:name_width]}")
    return lines


def read_listing(path: str) -> list[Kernel]:
    """The last decode step's kernels from a profile_decode.py output (its "the last decode step in
    order" listing: idle us before each kernel, its us, its name). The listing gives no start of a
    kernel that overlaps the one before it (programmatic dependent launch on): such a kernel is
    taken to start where the one before ended, so its own time, not its start to end, is exact."""
    with open(path) as f:
        lines = f.read().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("the last decode step in order")), None)
    if head is None:
        raise ValueError(f"{path} has no listing of the last decode step's kernels")
    out, end = [], 0.0
    for line in lines[head + 1:]:
        parts = line.split(None, 2)
        try:
            gap, dur = float(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            break
        start = end + gap
        out.append(Kernel(parts[2] if len(parts) > 2 else "", start, start + dur))
        end = start + dur
    return out


def model_bytes(preset: str, layers: int | None, batch: int, context: int) -> dict[int, int]:
    """Each layer's weight + KV bytes for a preset in bf16, from its config alone (a model on the meta device)."""
    import torch
    from transformers import Gemma4ForCausalLM

    from gemma4opt.presets import preset_config
    from roofline import kv_bytes_per_layer, weight_bytes_per_layer

    config = preset_config(preset, layers)
    config._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Gemma4ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    weights = weight_bytes_per_layer(model, batch)
    return {i: weights.get(i, 0) + kv for i, kv in enumerate(kv_bytes_per_layer(model, batch, context))}


def main(argv=None):
    """Re-read a recorded profile_decode.py output's listing into the per-layer table (bf16 bytes)."""
    import argparse
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from profile_decode import category

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("profile", help="a profile_decode.py output with its last decode step's listing")
    ap.add_argument("--preset", default=None, help="the profiled preset: each layer's bytes (bf16 weights only)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=143, help="tokens the last step's attention reads")
    ap.add_argument("--copy-bw", type=float, default=None, help="the device's copy bandwidth, TB/s")
    args = ap.parse_args(argv)
    kernels = read_listing(args.profile)
    prologue, layers, head = split_layers(kernels, lambda n: category(n) == "attention",
                                          lambda n: category(n) == "gemm")
    nbytes = model_bytes(args.preset, args.layers, args.batch, args.context) if args.preset else None
    if nbytes is not None and len(nbytes) != len(layers):
        print(f"{len(layers)} layers found, the preset has {len(nbytes)}: bytes left out")
        nbytes = None
    bw = args.copy_bw * 1e12 if args.copy_bw else None
    for line in report(layer_stats(layers, head, nbytes), prologue, head, bw):
        print(line)


if __name__ == "__main__":
    main()
