"""ms per decode step against batch size, one line per system plus the HBM roofline, as a PNG.

    python benchmarks/plot_generate.py benchmarks/results/generate_h200.jsonl --preset 31b --layers 12 --prompt 128 --out plot.png
    python benchmarks/plot_generate.py rows.jsonl --preset 31b --layers 12 --prompt 128

Reads the JSON lines bench_generate.py writes (--json). Where a (system, batch) was measured more
than once, the latest row counts. Needs matplotlib (pip install matplotlib).
"""
from __future__ import annotations

import argparse
import json


def series(rows, preset=None, layers=None, prompt=None):
    """{system: [(batch, ms_per_step), ...]} and [(batch, roofline_ms), ...], sorted by batch."""
    keep = [r for r in rows if (preset is None or r["preset"] == preset) and (layers is None or r["layers"] == layers)
            and (prompt is None or r["prompt"] == prompt)]
    latest, roof = {}, {}
    for r in keep:
        latest[(r["system"], r["batch"])] = r["ms_per_step"]
        roof[r["batch"]] = r["roofline_ms"]
    out: dict[str, list] = {}
    for (system, batch), ms in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(system, []).append((batch, ms))
    return out, sorted(roof.items())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--out", default="generate.png")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"plot_generate needs matplotlib ({e}); pip install matplotlib") from e
    with open(args.jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    lines, roof = series(rows, args.preset, args.layers, args.prompt)
    if not lines:
        raise SystemExit(f"no rows in {args.jsonl} match preset={args.preset} layers={args.layers} "
                         f"prompt={args.prompt}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, pts in lines.items():
        ax.plot([b for b, _ in pts], [ms for _, ms in pts], marker="o", label=system)
    ax.plot([b for b, _ in roof], [ms for _, ms in roof], "k--", marker="x", label="HBM roofline")
    ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step")
    r0 = rows[0]
    ax.set_title(f"{r0['preset']} x {r0['layers']} layers, prompt {r0['prompt']}, HF generate")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
