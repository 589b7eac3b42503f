"""docs/results.md from benchmarks/results/: one table per run of each suite, nothing typed by hand.

    python benchmarks/results_page.py                 # rewrites docs/results.md
    python benchmarks/results_page.py --check         # exit 1 if docs/results.md is not what it writes

One JSON-lines file per suite, every row carrying its run id, the commit that recorded it, the
machine and the command that measured it: generate_<machine>.jsonl (bench_generate.py),
kernels_<machine>.jsonl (bench_kernels.py), attention_<machine>.jsonl (bench_attention.py),
sweeps_<machine>.jsonl (launch-configuration sweeps), fp8_linear_sweeps_<machine>.jsonl (sweep_fp8_linear.py),
fp8_block_sweeps_<machine>.jsonl (bench_kernels.py --sweep-fp8-block),
moe_prefill_<machine>.jsonl (bench_moe_prefill.py); profile_<machine>.txt is profile_decode.py's
printout. Ratios compare rows of the same run, same batch and prompt only.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
SYSTEM_NAMES = {"eager": "HF eager", "static_compile": "HF static cache + torch.compile",
                "gemma4opt": "gemma4opt one-liner", "gemma4opt-paged": "gemma4opt paged, sized for the run",
                "gemma4opt-fp8": "gemma4opt one-liner, fp8 weights",
                "gemma4opt-fp8-head": "gemma4opt one-liner, fp8 weights and lm_head",
                "gemma4opt-before": "gemma4opt one-liner, the older checkout named in the command",
                "gemma4opt-hf-before": "gemma4opt-hf, the older checkout named in the command",
                "eager-before": "HF eager, beside the older checkout",
                "gemma4opt-triton-gemms": "gemma4opt one-liner, every decode GEMM on the Triton GEMM",
                "gemma4opt-paged-cublas": "gemma4opt paged, every decode GEMM on cuBLAS",
                "gemma4opt-nodirect": "gemma4opt one-liner, every decode step through Dynamo (direct_decode=False)",
                "gemma4opt-fp8-head-nodirect": "gemma4opt one-liner, fp8 weights and lm_head, direct_decode=False",
                "gemma4opt-early-kv": "gemma4opt one-liner, decode attention reading past K/V before the PDL wait",
                "gemma4opt-fp8-head-early-kv": "gemma4opt one-liner, fp8 weights and lm_head, past K/V before the wait",
                "gemma4opt-fp8-head-nopdl": "gemma4opt one-liner, fp8 weights and lm_head, programmatic dependent launch off",
                "gemma4opt-merged-attn": "gemma4opt one-liner, decode attention merging its splits in one launch",
                "gemma4opt-fp8-head-merged-attn": "gemma4opt one-liner, fp8 weights and lm_head, attention merged in one launch",
                "gemma4opt-no-rope": "gemma4opt one-liner, HF's rotary cos/sin ops (no rope_cos_sin)",
                "gemma4opt-fp8-head-no-rope": "gemma4opt one-liner, fp8 weights and lm_head, HF's rotary cos/sin ops",
                "gemma4opt-no-row-split": "gemma4opt one-liner, no split-K GEMM tiles at one row",
                "hf-fp8": "HF eager, transformers' FineGrainedFP8 model (its finegrained-fp8 kernel)",
                "hf-fp8-static": "HF static cache + torch.compile, transformers' FineGrainedFP8 model"}


def _rows(pattern):
    out = []
    for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
        with open(path) as f:
            out += [dict(json.loads(line), file=os.path.basename(path)) for line in f if line.strip()]
    return out


def _runs(rows):
    runs = collections.OrderedDict()
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    return list(reversed(runs.items()))       # rows are appended as runs happen: newest first


def _f(v, fmt="{:.2f}", none="—"):
    return none if v is None else fmt.format(v)


def _pct(v):
    return _f(v, "{:.0%}")


def _head(rid, rows):
    r = rows[0]
    return [f"### {rid}", "", f"`{r['command']}` — {r['machine']}, "
            + (f"recorded in commit {r['commit']}, " if r.get("commit") else "") + f"`benchmarks/results/{r['file']}`", ""]


def generate_section(rows):
    out = ["## generate", "", "HF `generate`, greedy, one process, every system on the same random-weight model "
           "(bf16). ms/step: decode steps after the first token. Roofline: weight + KV bytes per step at the "
           "measured copy bandwidth. Ratios: against HF static cache + torch.compile and HF eager of the same "
           "run, batch and prompt.", ""]
    for rid, rs in _runs(rows):
        out += _head(rid, rs)
        r0 = rs[0]
        out.append(f"{r0['preset']} × {r0['layers']} layers, prompt {r0['prompt']}, {r0['new']} new tokens.")
        notes = sorted({r["note"] for r in rs if r.get("note")} | {f"`{r['system']}`: {r['mode']}" for r in rs
                                                                  if r.get("mode")})
        out += [f"- {n}" for n in notes]
        # Runs that timed it: the decode step's CUDA graph replayed alone (the device's time per step, no
        # host between) and every repeat's ms/step, whose spread the best one hides.
        device = any("graph_replay_ms" in r for r in rs)
        out += ["", "| batch | system | warm-up s | TTFT ms | ms/step | tokens/s | of roofline | vs HF static + compile "
                "| vs HF eager | tokens == eager |" + (" device ms/step alone | every repeat's ms/step |" if device else ""),
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|" + ("---:|---|" if device else "")]
        by = {(r["batch"], r["prompt"], r["system"]): r for r in rs}
        for r in sorted(rs, key=lambda r: (r["batch"], r["prompt"])):
            static = by.get((r["batch"], r["prompt"], "static_compile"))
            eager = by.get((r["batch"], r["prompt"], "eager"))
            vs = lambda base: None if base is None else base["ms_per_step"] / r["ms_per_step"]   # noqa: E731
            same = {True: "yes", False: "no", None: "—"}[r["tokens_equal_eager"]] if r["system"] != "eager" else "—"
            if "first_diff_step" in r:      # where they first differ, and how close eager's own choice was
                same += f" (from step {r['first_diff_step']}; eager's top-2 margin there {r['eager_margin_at_diff']:.3g})"
            out.append(f"| {r['batch']} | {SYSTEM_NAMES.get(r['system'], r['system'])} | {_f(r.get('warmup_s'), '{:.1f}')} "
                       f"| {_f(r['ttft_ms'], '{:.1f}')} | {r['ms_per_step']:.2f} | {r['tok_s']:.0f} | "
                       f"{_pct(r['roofline_frac'])} | {_f(vs(static), '{:.2f}×')} | {_f(vs(eager), '{:.2f}×')} | {same} |"
                       + (f" {_f(r.get('graph_replay_ms'), '{:.2f}')} | "
                          f"{' / '.join(f'{t:.2f}' for t in r.get('ms_per_step_runs', ())) or '—'} |" if device else ""))
        for r in sorted(rs, key=lambda r: (r["batch"], r["prompt"])):    # transformers' own FP8 path as the bar
            if r["system"] == "hf-fp8-static":
                others = [o for o in rs if (o["batch"], o["prompt"]) == (r["batch"], r["prompt"]) and o is not r]
                out += ["", f"Against HF static cache + torch.compile on transformers' FineGrainedFP8 model (batch "
                        f"{r['batch']}): " + ", ".join(f"{SYSTEM_NAMES.get(o['system'], o['system'])} "
                                                      f"{r['ms_per_step'] / o['ms_per_step']:.2f}×" for o in others)]
        out.append("")
    return out


def _table_section(title, intro, rows, header, align, row):
    """A suite's section: per run its head, then one table row per result row (``row(r)``: the cells)."""
    out = [f"## {title}", "", intro, ""]
    for rid, rs in _runs(rows):
        out += _head(rid, rs)
        out += ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
        out += ["| " + " | ".join(row(r)) + " |" for r in rs]
        out.append("")
    return out


def kernels_section(rows):
    return _table_section(
        "kernels", "Each Triton kernel against the code it replaces (Inductor's for the unfused subgraph, or cuBLAS "
        "for the decode GEMMs), both replayed back to back in CUDA graphs. µs per call; speedup = baseline ÷ "
        "Triton; of copy BW: bytes read + written ÷ time ÷ copy bandwidth.", rows,
        ["preset", "M", "op", "Triton µs", "without PDL", "baseline", "baseline µs", "speedup", "of copy BW"],
        ["---", "---:", "---", "---:", "---:", "---", "---:", "---:", "---:"],
        lambda r: [str(r.get("preset", "")), str(r.get("M", "")), r["op"], f"{r['triton_us']:.2f}",
                   _f(r.get("triton_no_pdl_us")), str(r.get("baseline", "")), _f(r.get("baseline_us")),
                   _f(r.get("speedup"), "{:.2f}×"), _pct(r.get("frac_copy_bw"))])


def assisted_section(rows):
    return _table_section(
        "assisted decoding", "HF `generate` with `assistant_model` (bench_assisted.py): the target alone and the "
        "target with a small Gemma-4 drafting for it, both optimized, greedy, same prompt. ms/token: the whole "
        "generate over the new tokens. Target calls: the target's forward calls for those tokens (random weights "
        "reject most drafts: as many calls as tokens means none was accepted). Drafts: HF's default schedule, or "
        "a constant draft length; *all accepted*: both models' layer outputs zeroed so that both repeat the last "
        "token (`--accept-all`: the weights are still read, a step costs what it does with real weights), the "
        "speed-up of a perfect drafter.", rows,
        ["target", "assistant", "drafts", "batch", "prompt", "new", "system", "ms/token", "target calls",
         "tokens == eager"],
        ["---", "---", "---", "---:", "---:", "---:", "---", "---:", "---:", "---"],
        lambda r: [f"{r['preset']} × {r['layers']}", r["assistant"] or "—", _drafts(r), str(r["batch"]),
                   str(r["prompt"]), str(r["new"]), r["system"], f"{r['ms_per_token']:.2f}", str(r["target_calls"]),
                   "yes" if r["tokens_equal_eager"] else "no"])


def _drafts(r) -> str:
    if not r["assistant"]:
        return "—"
    how = f"{r['draft']} tokens" if r.get("draft") else "HF schedule"
    return how + (", all accepted" if r.get("accept_all") else "")


def attention_section(rows):
    return _table_section(
        "attention", "One decode query per sequence over the paged KV cache, the 31b's two attention kinds "
        "(sliding: 32/16 heads, head_dim 256, window 1024; full: 32/4 heads, head_dim 512). µs per layer (CUDA "
        "graph of 20 runs); of copy BW: KV bytes read ÷ time ÷ copy bandwidth; KV: the pool's dtype (fp8: "
        "e4m3, `kv_cache_dtype=\"fp8\"`).", rows,
        ["kind", "variant", "KV", "batch", "context", "µs", "KV MB", "of copy BW"],
        ["---", "---", "---", "---:", "---:", "---:", "---:", "---:"],
        lambda r: [r["kind"], r["variant"], r.get("kv_dtype", "bf16"), str(r["batch"]), str(r["context"]),
                   f"{r['us']:.1f}", f"{r['kv_mb']:.1f}", _pct(r["bw_frac"])])


def moe_prefill_section(rows):
    return _table_section(
        "MoE experts at prefill", "The MoE experts op at prefill token counts (bench_moe_prefill.py): HF's bf16 "
        "experts module (grouped_mm) against gemma4opt's fp8 experts above the decode kernels' 1024 (token, expert) "
        "pairs, with the number of experts widened at once. ms per call (CUDA events, median of 5).", rows,
        ["preset", "tokens", "pairs", "busiest expert", "system", "ms"],
        ["---", "---:", "---:", "---:", "---", "---:"],
        lambda r: [r["preset"], str(r["tokens"]), str(r["pairs"]), str(r["busiest"]), r["system"], f"{r['ms']:.2f}"])


def fp8_quality_section(rows):
    return _table_section(
        "fp8 quality", "Teacher-forced logits of the same random-weight model with its attention and dense-MLP "
        "projections in fp8 (and, in the runs named `..._fp8_experts`, its MoE experts: gemma4opt's weight-only "
        "with per-(expert, row) scales, the anchor's in 128 × 128 blocks with 1 × 128 activation groups), against "
        "the model in its own dtype (bench_fp8_quality.py): mean KL(reference ‖ fp8) "
        "per position and top-1 agreement. Systems: gemma4opt's optimized fp8 model; the fp8 reference path "
        "(its semantics in plain torch: per-channel weight scales, per-token activation scales); transformers' "
        "FineGrainedFP8 scheme (128 × 128 weight blocks, 1 × 128 activation groups) emulated in torch, the anchor. "
        "Random weights of a few layers move the logits little: compare systems within a run. Where a run has it, "
        "\"vs anchor\" is the system's mean KL over the anchor's minus one, paired by position, ± its standard error "
        "(positions of a sequence are not independent: a guide to the noise, not a test).", rows,
        ["model", "positions", "dtype", "system", "KL (nats)", "vs anchor", "top-1"],
        ["---", "---:", "---", "---", "---:", "---:", "---:"],
        lambda r: [f"{r['preset']} × {r['layers']}", str(r["positions"]), r["dtype"], r["system"],
                   f"{r['kl']:.3g}", _vs_anchor(r), f"{r['top1']:.4f}"])


def _vs_anchor(r) -> str:
    if "kl_vs_anchor" not in r:
        return "—"
    return f"{r['kl_vs_anchor']:+.1%} ± {r['kl_vs_anchor_se']:.1%}"


def sweeps_section(rows):
    return _table_section(
        "sweeps", "Launch configurations of one kernel timed one by one; `default` is the launch the code used when "
        "the sweep ran (the autotuned tile for the skinny GEMM).", rows,
        ["preset", "M", "op", "default µs", "best", "best µs", "default ÷ best"],
        ["---", "---:", "---", "---:", "---", "---:", "---:"],
        lambda r: [r["preset"], str(r["M"]), r["op"], f"{r['default_us']:.2f}",
                   "`" + str(r["best"]).replace("|", "/") + "`", f"{r['best_us']:.2f}",
                   f"{r['default_us'] / r['best_us']:.2f}×"])


def fp8_linear_sweeps_section(rows):
    return _table_section(
        "fp8 GEMM tiles", "The skinny fp8 GEMM's tiles on a preset's decode GEMMs and lm_head (sweep_fp8_linear.py), each "
        "call streaming its weight from HBM (calls back to back in a CUDA graph, on copies of the weight twice the "
        "L2): the bf16 GEMM of the same shape on cuBLAS, torch._scaled_mm with row-wise scales, the tile the "
        "autotuner chose when the sweep ran, and the best tile, with its weight stream in GB/s. `BLOCK_M` 16 at one "
        "row is the tensor-core tile with the row padded.", rows,
        ["preset", "M", "GEMM", "N × K", "bf16 cuBLAS µs", "_scaled_mm µs", "autotuned µs", "best µs", "GB/s",
         "best tile"],
        ["---", "---:", "---", "---", "---:", "---:", "---:", "---:", "---:", "---"],
        lambda r: [r["preset"], str(r["M"]), r["op"], f"{r['N']} × {r['K']}", _f(r["bf16_cublas_us"]),
                   _f(r["scaled_mm_us"]), _f(r["autotuned_us"]), _f(r["best_us"][0] if r["best_us"] else None),
                   _f(r["gb_s_best"], "{:.0f}"), "`" + (r["best"][0] if r["best"] else "—") + "`"])


def fp8_block_sweeps_section(rows):
    return _table_section(
        "Block-scaled fp8 GEMM tiles", "FineGrainedFP8 checkpoints' GEMM (128 x 128 blocks, the input quantized per "
        "token and 128-long group inside it) on a preset's decode GEMMs (`bench_kernels.py --sweep-fp8-block`, each "
        "call replayed in a CUDA graph): the fp8 weight's bytes at the measured copy bandwidth, F.linear in bf16, "
        "the per-channel fp8 GEMM on the same weight (input quantized beforehand), the tile the autotuner chose when "
        "the sweep ran, and the best tile. `BLOCK_M` 1 is the one-row FMA tile, 16 the tensor-core tile with the "
        "rows padded.", rows,
        ["preset", "M", "GEMM", "fp8 bytes µs", "bf16 µs", "per-channel fp8 µs", "autotuned µs", "best µs",
         "best tile"],
        ["---", "---:", "---", "---:", "---:", "---:", "---:", "---:", "---"],
        lambda r: [r["preset"], str(r["M"]), r["op"], _f(r["weight_floor_us"]), _f(r["bf16 F.linear"]),
                   _f(r["per-channel fp8"]), _f(r["autotuned"]), _f(r["best_us"][0] if r["best_us"] else None),
                   "`" + (r["best"][0] if r["best"] else "—") + "`"])


def profile_section():
    out = ["## profile", ""]
    for path in sorted(glob.glob(os.path.join(RESULTS, "profile_*.txt"))):
        with open(path) as f:
            lines = [line.rstrip() for line in f]
        # A profile's first line may say how it was made ("# command ..."); the oldest file does not.
        what = lines.pop(0)[2:] if lines and lines[0].startswith("# ") else (
            "`python3 benchmarks/profile_decode.py --preset 31b --layers 12 --batch 32 --new 32`, HF static cache mode")
        name = os.path.basename(path)
        if name.startswith("profile_layer_tables"):     # layer_timeline.py's tables of recorded profiles: all of it
            out += [f"`benchmarks/results/{name}`: each decode layer's launches, time, idle time and bytes ({what}).",
                    "", "```", *lines, "```", ""]
            continue
        kind = ("the host's time per decode step" if name.startswith("profile_host")
                else "device time per decode step by kernel category")
        out += [f"`benchmarks/results/{name}`: {kind} ({what}). Its first lines:", "", "```"]
        out += lines[:9]
        # profile_decode's per-layer table (benchmarks/layer_timeline.py), where the file has one.
        start = next((i for i, line in enumerate(lines) if line.startswith("per-layer timeline")), None)
        if start is not None:
            end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
            out += ["", *lines[start:end]]
        out += ["```", ""]
    return out


def render() -> str:
    lines = ["# Results", "", "Generated by `python benchmarks/results_page.py` from `benchmarks/results/`; do not "
             "edit by hand. Every figure is a row of those files. Runs are listed newest first; a run id is "
             "the date it was recorded and the name of the file it was first recorded in. Suites and their "
             "commands: `benchmarks/gpu_session.sh`.", ""]
    lines += generate_section(_rows("generate_*.jsonl"))
    lines += kernels_section(_rows("kernels_*.jsonl"))
    lines += assisted_section(_rows("assisted_*.jsonl"))
    lines += attention_section(_rows("attention_*.jsonl"))
    lines += moe_prefill_section(_rows("moe_prefill_*.jsonl"))
    lines += fp8_quality_section(_rows("fp8_quality_*.jsonl"))
    lines += sweeps_section(_rows("sweeps_*.jsonl"))
    lines += fp8_linear_sweeps_section(_rows("fp8_linear_sweeps_*.jsonl"))
    lines += fp8_block_sweeps_section(_rows("fp8_block_sweeps_*.jsonl"))
    lines += profile_section()
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with docs/results.md instead of writing it")
    ap.add_argument("--out", default=PAGE)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(args.out) as f:
            same = f.read() == text
        print("docs/results.md is up to date" if same else "docs/results.md differs: run benchmarks/results_page.py")
        return 0 if same else 1
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
