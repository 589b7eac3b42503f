"""Each fused op's Triton kernel vs Inductor's code for the same unfused subgraph, on the GPU.

    python benchmarks/bench_kernels.py [--presets 31b e4b] [--m 1 32 256 8192]
    python benchmarks/bench_kernels.py --linear --presets 31b --m 1 8 32   # decode GEMMs vs cuBLAS
    python benchmarks/bench_kernels.py --sweep-norm-rope --presets 31b     # q/k prep launch configs
    python benchmarks/bench_kernels.py --sweep gelu --m 1 32 256            # gelu.mul (or softcap) launches
    python benchmarks/bench_kernels.py --sweep rows --m 1 8 32              # row kernels' warps at decode
    python benchmarks/bench_kernels.py --sweep-linear --presets 31b --m 32  # skinny GEMM tiles vs cuBLAS
    python benchmarks/bench_kernels.py --sweep-fp8-block --presets e4b --m 1 8  # block-scaled fp8 GEMM tiles

For decode (M = 1, 32, 256 tokens) and prefill (M = 8192) shapes of the presets: time per call
(replayed in a CUDA graph, as decode runs), achieved GB/s (bytes read + written / time), the fraction of the measured
copy bandwidth, and the speedup over torch.compile of the op's reference (the unfused subgraph).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4opt  # noqa: E402,F401
from gemma4opt.kernels import _util  # noqa: E402
from gemma4opt.kernels._util import pdl_prologue  # noqa: E402
from gemma4opt.kernels.add_rms_norm import add_rms_norm_triton  # noqa: E402
from gemma4opt.kernels.fp8_quant import add_rms_norm_quant_triton, rms_norm_quant_triton  # noqa: E402
from gemma4opt.kernels.gelu_tanh_mul import gelu_tanh_mul_triton  # noqa: E402
from gemma4opt.kernels.moe_experts import MAX_PAIRS, moe_experts_triton  # noqa: E402
from gemma4opt.kernels.moe_grouped import MAX_GROUPED_PAIRS  # noqa: E402
from gemma4opt.kernels.moe_router import router_input_triton, router_topk_triton  # noqa: E402
from gemma4opt.kernels.moe_router_decode import MAX_ROWS as ROUTER_DECODE_ROWS, router_decode_triton  # noqa: E402
from gemma4opt.kernels.qkv_norm_rope_append import qkv_norm_rope_append_triton  # noqa: E402
from gemma4opt.kernels.rms_norm import rms_norm_triton  # noqa: E402
from gemma4opt.kernels.rms_norm_rope import rms_norm_rope_triton  # noqa: E402
from gemma4opt.kernels.skinny_linear import skinny_linear_triton  # noqa: E402
from gemma4opt.kernels.softcap import softcap_  # noqa: E402
from gemma4opt.ops.add_rms_norm import add_rms_norm_reference  # noqa: E402
from gemma4opt.ops.add_rms_norm_quant import add_rms_norm_quant_reference  # noqa: E402
from gemma4opt.ops.rms_norm_quant import rms_norm_quant_reference  # noqa: E402
from gemma4opt.ops.gelu_tanh_mul import gelu_tanh_mul_reference  # noqa: E402
from gemma4opt.ops.linear_softcap import linear_softcap_reference  # noqa: E402
from gemma4opt.ops.moe_router import moe_router_reference  # noqa: E402
from gemma4opt.ops.rms_norm import rms_norm_reference  # noqa: E402
from gemma4opt.ops.qkv_norm_rope_append import qkv_norm_rope_append_reference  # noqa: E402
from gemma4opt.ops.rms_norm_rope import rms_norm_rope_reference  # noqa: E402
from gemma4opt.presets import preset_config  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402

DT = torch.bfloat16
EPS = 1e-6


def _graph_us(fn, rep: int) -> float:
    """µs per call of fn replayed in a CUDA graph. Triton's do_bench_cudagraph runs fn on a side
    stream that does not wait for the current one: without the synchronize, fn could read inputs
    the current stream has not finished making. The likely cause of the MoE sweep's illegal address
    at 8 tokens on the H200, which a standalone run that synchronized first did not reproduce."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def _router_ref(logits, pes, k):
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    w, i = torch.topk(probs, k, -1)
    return probs, w / w.sum(-1, keepdim=True) * pes[i], i


def _moe_batched_ref(x, idx, wt, gate_up, down):
    """HF's batched_mm experts path (what generate runs at decode on a GPU), for Inductor to compile."""
    T, k = idx.shape
    ids = idx.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    gu = torch.bmm(gate_up[ids], xs.unsqueeze(-1)).squeeze(-1)
    g, u = gu.chunk(2, dim=-1)
    h = torch.nn.functional.gelu(g, approximate="tanh") * u
    y = torch.bmm(down[ids], h.unsqueeze(-1)).squeeze(-1) * wt.reshape(-1).unsqueeze(-1)
    return y.view(T, k, -1).sum(dim=1).to(x.dtype)


def _moe_case(cfg, M):
    E, k, H, I = cfg.num_experts, cfg.top_k_experts, cfg.hidden_size, cfg.moe_intermediate_size
    x = torch.randn(M, H, device="cuda", dtype=DT)
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=DT) / H ** 0.5
    down = torch.randn(E, H, I, device="cuda", dtype=DT) / I ** 0.5
    idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(M)])
    wt = torch.softmax(torch.randn(M, k, device="cuda"), -1)
    if M * k <= MAX_PAIRS:
        moved = _nbytes(x) * 2 + M * k * 3 * I * H * 2       # each pair's gate, up and down rows
        return "moe_experts (decode)", moe_experts_triton, _moe_batched_ref, (x, idx, wt, gate_up, down), moved
    moved = _nbytes(x) * 2 + idx.unique().numel() * 3 * I * H * 2       # each touched expert's rows once
    return "moe_experts (grouped)", moe_experts_triton, _moe_batched_ref, (x, idx, wt, gate_up, down), moved


def _moe_fp8(x, idx, wt, gate_up, gate_up_scale, down, down_scale, launch=None):
    """The fp8 experts (quantization="fp8") through moe_experts_triton; ``launch`` may also hold
    ``grouped`` (True: the expert-by-expert kernels even at decode's few pairs), which the sweep times."""
    launch = dict(launch or {})
    grouped = launch.pop("grouped", None)
    return moe_experts_triton(x, idx, wt, gate_up, down, launch or None, gate_up_scale, down_scale, grouped=grouped)


def _moe_fp8_batched_ref(x, idx, wt, gate_up, gate_up_scale, down, down_scale):
    """HF's batched_mm path (``_moe_batched_ref``) on the chosen experts' rows dequantized to the model
    dtype, in pair order, for Inductor."""
    ids = idx.reshape(-1)
    gu = (gate_up[ids].float() * gate_up_scale[ids].float()[..., None]).to(x.dtype)
    dn = (down[ids].float() * down_scale[ids].float()[..., None]).to(x.dtype)
    pairs = torch.arange(ids.numel(), device=idx.device).view(idx.shape)
    return _moe_batched_ref(x, pairs, wt, gu, dn)


def _moe_fp8_case(cfg, M, bf16_args):
    """The bf16 case's tokens, routing and experts, the experts quantized as quantization="fp8" does."""
    from gemma4opt.ops.fp8 import quantize_rows_reference

    x, idx, wt, gate_up, down = bf16_args
    (gu_q, gu_s), (d_q, d_s) = quantize_rows_reference(gate_up), quantize_rows_reference(down)
    E, k, H, I = cfg.num_experts, cfg.top_k_experts, cfg.hidden_size, cfg.moe_intermediate_size
    experts = M * k if M * k <= MAX_PAIRS else idx.unique().numel()       # streamed pair by pair / once
    moved = _nbytes(x) * 2 + experts * 3 * I * (H + 4)
    kind = "decode" if M * k <= MAX_PAIRS else "grouped"
    return f"moe_experts fp8 ({kind})", _moe_fp8, _moe_fp8_batched_ref, (x, idx, wt, gu_q, gu_s, d_q, d_s), moved


def _router_unfused(x, scale, proj, pes, eps, root, k, w2, eps2):
    """The router as the op ran it before its one-launch decode kernel: the input kernel (with the
    experts' norm), cuBLAS's GEMM, the softmax / top-k kernel."""
    h, n = router_input_triton(x, scale, eps, root, w2, eps2)
    return (*router_topk_triton(torch.nn.functional.linear(h, proj), pes, k), n)


def _router_eager(x, scale, proj, pes, eps, root, k, w2, eps2):
    return (*moe_router_reference(x, scale, proj, pes, eps, root, k), rms_norm_reference(x, w2, eps2))


def _router_cases(cfg, M, x, scale, w2, pes):
    """The whole router of a MoE layer with its experts' norm (gemma4opt.moe_router_norm) at decode rows:
    the one-launch kernel and the three launches it replaces, each against Inductor's code for the eager ops."""
    H, E, k = cfg.hidden_size, cfg.num_experts, cfg.top_k_experts
    proj = torch.randn(E, H, device="cuda", dtype=DT) / H ** 0.5
    args = (x, scale, proj, pes, EPS, H ** -0.5, k, w2, EPS)
    moved = _nbytes(x, proj, scale, w2, x) + M * E * 4 + M * k * 12
    return [("moe_router (decode, one launch)", router_decode_triton, _router_eager, args, moved),
            ("moe_router (input, GEMM, top-k)", _router_unfused, _router_eager, args, moved)]


def _qkv_case(cfg, kind, M, D, heads, cos, sin, w):
    """The paged layer's q/k/v prep + KV append on the merged projection's output (page size 16)."""
    layer = cfg.layer_types.index(f"{kind}_attention")
    kvh = cfg.per_layer_config[layer].num_key_value_heads
    k_eq_v = kind == "full" and getattr(cfg, "attention_k_eq_v", False)
    qkv = torch.randn(1, M, (heads + kvh * (1 if k_eq_v else 2)) * D, device="cuda", dtype=DT)
    q = qkv[..., :heads * D].view(1, M, heads, D)
    k = qkv[..., heads * D:(heads + kvh) * D].view(1, M, kvh, D)
    v = k if k_eq_v else qkv[..., (heads + kvh) * D:].view(1, M, kvh, D)
    pool = torch.zeros(-(-M // 16) + 1, 2, 16, kvh, D, device="cuda", dtype=DT)
    slots = torch.arange(M, device="cuda")
    tok = torch.arange(M, device="cuda", dtype=torch.int32)
    args = (pool, q, w, k, w, v, cos, sin, EPS, slots, tok)
    moved = _nbytes(qkv, q, cos, sin) + 2 * M * kvh * D * 2
    return f"qkv_norm_rope_append[{kind} D={D}]", qkv_norm_rope_append_triton, qkv_norm_rope_append_reference, \
        args, moved


def linear_cases(cfg, M):
    """The decode step's GEMMs (merged q/k/v of each kind, o_proj, merged gate/up, down) with M
    rows: gemma4opt's skinny Triton GEMM against F.linear (cuBLAS, also what Inductor calls)."""
    H, I, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    out = []
    for kind in ("sliding_attention", "full_attention"):
        lc = cfg.per_layer_config[cfg.layer_types.index(kind)]
        k_eq_v = kind == "full_attention" and getattr(cfg, "attention_k_eq_v", False)
        n_qkv = (heads + lc.num_key_value_heads * (1 if k_eq_v else 2)) * lc.head_dim
        out.append((f"linear[qkv {kind.split('_')[0]}]", n_qkv, H))
        out.append((f"linear[o_proj {kind.split('_')[0]}]", H, heads * lc.head_dim))
    out += [("linear[gate_up]", 2 * I, H), ("linear[down]", H, I)]
    rows = []
    for name, n, k in out:
        x = torch.randn(M, k, device="cuda", dtype=DT)
        w = torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5
        rows.append((name, skinny_linear_triton, torch.nn.functional.linear, (x, w), _nbytes(x, w) + M * n * 2))
    return rows


def cases(cfg, M):
    """(op name, triton fn, reference fn, args, bytes moved) for one preset and M tokens."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    x, r = torch.randn(M, H, device="cuda", dtype=DT), torch.randn(M, H, device="cuda", dtype=DT)
    w, w2 = torch.randn(H, device="cuda", dtype=DT), torch.randn(H, device="cuda", dtype=DT)
    scale = torch.tensor([0.8], device="cuda", dtype=DT)
    out = [("rms_norm", rms_norm_triton, rms_norm_reference, (x, w, EPS), _nbytes(x, x, w))]
    out.append(("add_rms_norm", add_rms_norm_triton, add_rms_norm_reference, (x, r, w, EPS, scale, w2, EPS),
                _nbytes(x, r, x, x, w, w2)))
    # With fp8 weights the norms feeding a GEMM write its fp8 input and per-token scales.
    out.append(("rms_norm_quant", rms_norm_quant_triton, rms_norm_quant_reference, (x, w, EPS),
                _nbytes(x, w) + M * H + M * 4))
    out.append(("add_rms_norm_quant", add_rms_norm_quant_triton, add_rms_norm_quant_reference,
                (x, r, w, EPS, scale, w2, EPS), _nbytes(x, r, x, w, w2) + M * H + M * 4))
    gu = torch.randn(M, 2 * I, device="cuda", dtype=DT)
    g, u = gu[:, :I], gu[:, I:]
    out.append(("gelu_tanh_mul", gelu_tanh_mul_triton, gelu_tanh_mul_reference, (g, u), _nbytes(gu, g)))
    head_dim = {k: cfg.per_layer_config[cfg.layer_types.index(k)].head_dim
                for k in ("sliding_attention", "full_attention")}
    for kind, D, heads in (("sliding", head_dim["sliding_attention"], cfg.num_attention_heads),
                           ("full", head_dim["full_attention"], cfg.num_attention_heads)):
        q = torch.randn(1, M, heads, D, device="cuda", dtype=DT)
        cos = torch.randn(1, M, 1, D, device="cuda", dtype=DT)
        sin = torch.randn(1, M, 1, D, device="cuda", dtype=DT)
        wq = torch.randn(D, device="cuda", dtype=DT)
        out.append((f"rms_norm_rope[{kind} D={D}]", rms_norm_rope_triton, rms_norm_rope_reference,
                    (q, wq, cos, sin, EPS), _nbytes(q, q, cos, sin, wq)))
        out.append(_qkv_case(cfg, kind, M, D, heads, cos, sin, wq))
    if M <= 256:
        logits = torch.randn(M, cfg.vocab_size, device="cuda", dtype=DT)
        out.append(("softcap (lm_head epilogue)", softcap_, lambda t, c: torch.tanh(t / c) * c, (logits, 30.0),
                    _nbytes(logits, logits)))
    if M <= 32:     # decode: the lm_head GEMM with the softcap as its epilogue (ops/linear_softcap.py)
        h = torch.randn(M, H, device="cuda", dtype=DT)
        w_lm = torch.randn(cfg.vocab_size, H, device="cuda", dtype=DT) / H ** 0.5
        out.append(("lm_head + softcap", torch.ops.gemma4opt.linear_softcap.default, linear_softcap_reference,
                    (h, w_lm, 30.0), _nbytes(h, w_lm) + M * cfg.vocab_size * 2))
    if cfg.enable_moe_block:
        logits = torch.randn(M, cfg.num_experts, device="cuda", dtype=DT)
        pes = torch.randn(cfg.num_experts, device="cuda", dtype=DT)
        if M * cfg.top_k_experts <= MAX_GROUPED_PAIRS:
            out.append(_moe_case(cfg, M))
            out.append(_moe_fp8_case(cfg, M, out[-1][3]))
        out.append(("moe_router top-k", router_topk_triton, _router_ref, (logits, pes, cfg.top_k_experts),
                    _nbytes(logits) + M * cfg.num_experts * 4 + M * cfg.top_k_experts * 12))
        if M <= ROUTER_DECODE_ROWS:
            out += _router_cases(cfg, M, x, w, w2, pes)
    return out


def _sweeps():
    """--sweep-X -> (which cases, the launches to force: each passed as the kernel's ``launch=``)."""
    return {"norm_rope": (lambda n: "norm_rope" in n,
                          [dict(hb=hb, warps=w) for hb in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]),
            "gelu": (lambda n: n == "gelu_tanh_mul",
                     [dict(block=b, warps=w) for b in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8)]),
            "moe_grouped": (lambda n: n == "moe_experts (grouped)",
                            [dict(gu=(n, kk, w, st)) for n, w in ((64, 4), (128, 8), (32, 4)) for kk in (64, 128, 256)
                             for st in (3, 4)]
                            + [dict(dn=(n, kk, w, st)) for n, w in ((64, 4), (128, 8), (32, 4)) for kk in (64, 128)
                               for st in (3, 4)]),
            "moe": (lambda n: n == "moe_experts (decode)",
                    [dict(gu_n=n, gu_k=kk, gu_warps=w) for n in (4, 8, 16, 32) for kk in (256, 512) for w in (2, 4, 8)]
                    + [dict(dn_n=n, dn_k=kk, dn_warps=w) for n in (2, 4, 8, 16, 32) for kk in (256, 512)
                       for w in (2, 4, 8)]),
            # fp8 experts: gate/up's K tiles up to 1024 (an fp8 row is half the bytes; down's I = 704 takes 256
            # whatever the bound), and the grouped kernels at decode's pair counts (their tensor-core dot
            # against the pair-by-pair row sums).
            "moe_fp8": (lambda n: n == "moe_experts fp8 (decode)",
                        [dict(gu_n=n, gu_k=kk, gu_warps=w) for n in (4, 8, 16) for kk in (256, 512, 1024)
                         for w in (4, 8)]
                        + [dict(dn_n=n, dn_warps=w) for n in (1, 2, 4, 8) for w in (2, 4, 8)]
                        + [dict(grouped=True)]),
            # The decode kernels' K loops pipelined (gu_pipe / dn_pipe stages) against the plain loops, on
            # the default tiles and their neighbours.
            "moe_pipe": (lambda n: n == "moe_experts (decode)",
                         [dict(gu_pipe=p, dn_pipe=p) for p in (2, 3, 4)]
                         + [dict(gu_pipe=3, gu_n=n, gu_k=kk, gu_warps=w) for n in (4, 8, 16) for kk in (256, 512)
                            for w in (4, 8)]
                         + [dict(dn_pipe=3, dn_n=n, dn_warps=w) for n in (2, 4, 8) for w in (2, 4)]),
            "moe_fp8_pipe": (lambda n: n == "moe_experts fp8 (decode)",
                             [dict(gu_pipe=p, dn_pipe=p) for p in (2, 3, 4)]
                             + [dict(gu_pipe=3, gu_n=n, gu_k=kk, gu_warps=w) for n in (4, 8, 16) for kk in (512, 1024)
                                for w in (4, 8)]
                             + [dict(dn_pipe=3, dn_n=n, dn_warps=w) for n in (2, 4, 8) for w in (2, 4)]),
            # Row kernels at decode: every one's warps a program, through _util.set_decode_row_warps.
            "rows": (lambda n: n in ("rms_norm", "add_rms_norm", "rms_norm_quant", "add_rms_norm_quant"),
                     [dict(warps=w) for w in (1, 2, 4, 8, 16, 32)]),
            "router": (lambda n: n == "moe_router (decode, one launch)",
                       [dict(block_e=b, warps=w) for b in (1, 2, 4, 8) for w in (1, 2, 4, 8)]),
            "softcap": (lambda n: n.startswith("softcap"),
                        [dict(block=b, warps=w) for b in (512, 1024, 2048, 4096, 8192) for w in (2, 4, 8, 16)])}


def _with_row_warps(fn):
    """fn taking ``launch=dict(warps=w)``: every row kernel it launches at decode on w warps."""
    def run(*fargs, launch=None):
        _util.set_decode_row_warps(launch["warps"] if launch else None)
        try:
            return fn(*fargs)
        finally:
            _util.set_decode_row_warps(None)
    return run


def sweep(args, kind):
    """Per case of the kind: the default launch's time, then the fastest override found, each
    replayed in a CUDA graph; the data for retuning the kernel's launch heuristic. Rows are written
    as JSON lines as they come (a sweep may outlast its time limit)."""
    select, grid = _sweeps()[kind]
    out = open(args.json, "w") if args.json else None
    for preset in args.presets:
        cfg = preset_config(preset)
        for M in args.m:
            for name, fn, _, fargs, _ in cases(cfg, M):
                if not select(name):
                    continue
                if kind == "rows":
                    fn = _with_row_warps(fn)
                fn(*fargs)
                timed = {"default": _graph_us(lambda: fn(*fargs), rep=30)}
                for over in grid:
                    try:
                        fn(*fargs, launch=over)
                        timed[tuple(over.items())] = _graph_us(lambda: fn(*fargs, launch=over), rep=20)
                    except Exception as e:      # noqa: BLE001 - a launch the GPU refuses is skipped
                        print(f"# {name} {over}: {type(e).__name__}")
                best = min((k for k in timed if k != "default"), key=timed.get)
                row = dict(preset=preset, M=M, op=name, default_us=timed["default"], best=list(best),
                           best_us=timed[best], all={str(k): v for k, v in timed.items()})
                print(f"{preset:>8} {M:>5} {name:>40} default {timed['default']:8.2f} us   best {best} "
                      f"{timed[best]:8.2f} us ({timed['default'] / timed[best]:.2f}x)", flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()


def _linear_tiles():
    """The tl.dot tiles the linear sweep times: x's rows or W's as the dot's M side (SWAP), K
    unsplit or split, pipeline depth, warps; tiles whose stages would not fit shared memory left out."""
    for swap in (False, True):
        for bn in (16, 32, 64, 128):
            for bk in (64, 128, 256):
                for stages in (3, 5):
                    if (bn + 32) * bk * 2 * stages > 200 * 1024:
                        continue
                    for warps in ((4,) if bn < 64 else (4, 8)):
                        for split in (1, 2, 4):
                            yield dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SWAP=swap, num_warps=warps,
                                       num_stages=stages)


def _time_tiles(name, tiles, run, want, timed: dict) -> list[str]:
    """Each tile's ``run(tile)`` checked against ``want`` and timed in a CUDA graph into timed[str(tile)];
    the tiles' keys, fastest first."""
    for tile in tiles:
        try:
            if not torch.allclose(run(tile).float(), want.float(), rtol=2e-2, atol=2e-2):
                print(f"# {name} {tile}: wrong result")
                continue
            timed[str(tile)] = _graph_us(lambda: run(tile), rep=15)
        except Exception as e:      # noqa: BLE001 - a tile the GPU refuses is skipped
            print(f"# {name} {tile}: {type(e).__name__} {str(e)[:80]}")
    return sorted((k for k in timed if k.startswith("{")), key=timed.get)


def _write_ranked(out, row: dict, timed: dict, ranked: list[str]):
    """The runners-up under a sweep's printed line, and its row to the JSON-lines file as it comes."""
    for k in ranked[1:5]:
        print(f"{'':>36} {timed[k]:7.2f} {k}")
    if out:
        out.write(json.dumps(row) + "\n")
        out.flush()


def sweep_linear(args):
    """Per decode GEMM with M > 1 rows: cuBLAS, the autotuned skinny GEMM, and every tile of
    ``_linear_tiles`` (each replayed in a CUDA graph); the data for the autotuner's config list.
    Rows are written as they come (a sweep may outlast its time limit)."""
    out = open(args.json, "w") if args.json else None
    for preset in args.presets:
        cfg = preset_config(preset)
        for M in args.m:
            if not 1 < M <= 32:
                continue
            # Biggest weights first: a sweep cut short by its time limit still has them.
            for name, fn, ref, (x, w), nbytes in sorted(linear_cases(cfg, M), key=lambda c: -c[3][1].numel()):
                want = ref(x, w)
                fn(x, w)
                timed = {"cublas": _graph_us(lambda: ref(x, w), rep=20),
                         "autotuned": _graph_us(lambda: fn(x, w), rep=20)}
                ranked = _time_tiles(name, _linear_tiles(), lambda tile: fn(x, w, tile), want, timed)
                row = dict(preset=preset, M=M, op=name, cublas_us=timed["cublas"], autotuned_us=timed["autotuned"],
                           best=ranked[:5], best_us=[timed[k] for k in ranked[:5]],
                           gb_s_best=nbytes / (timed[ranked[0]] * 1e-6) / 1e9 if ranked else None)
                print(f"{preset:>6} {M:>3} {name:>24} cublas {timed['cublas']:7.2f} autotuned {timed['autotuned']:7.2f} "
                      f"best {timed[ranked[0]]:7.2f} ({timed['cublas'] / timed[ranked[0]]:.2f}x cublas) {ranked[0]}",
                      flush=True)
                _write_ranked(out, row, timed, ranked)


def _fp8_block_tiles(M: int):
    """Decode tiles of the block-scaled fp8 GEMM (BLOCK_K is the checkpoint's block_k) around its
    autotuner's: the MMA's (64-256 W rows a program, 4-16 warps, K in 2-16 whole-group splits, 3-4
    stages) and at one row the FMA's (BLOCK_M 1: 2-16 W rows, 4-16 groups an iteration, 1-2 splits)."""
    for bm in ((16,) if M <= 16 else (32,)):
        for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8), (256, 16)):
            for split in (2, 4, 8, 16):
                for stages in (3, 4):
                    yield dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, SWAP=True, num_warps=warps, num_stages=stages)
    if M == 1:
        for bn in (2, 4, 8, 16):
            for groups in (4, 8, 16):
                for split in (1, 2):
                    yield dict(BLOCK_M=1, BLOCK_N=bn, GROUPS=groups, SPLIT_K=split, num_warps=4)


def sweep_fp8_block(args, block=128):
    """Per decode GEMM (1-32 rows) of a FineGrainedFP8 checkpoint (block x block tiles): the
    autotuned block-scaled GEMM and every tile of ``_fp8_block_tiles``, beside the per-channel fp8
    GEMM (x quantized beforehand, scales applied once), F.linear in bf16 and the fp8 weight's
    bytes at the copy bandwidth: how far the in-loop quantization and per-group scaling sit from
    what the bytes allow. Rows are written as they come."""
    from gemma4opt.kernels.fp8_block_linear import fp8_block_linear_triton
    from gemma4opt.kernels.fp8_linear import fp8_linear_triton
    from gemma4opt.ops.fp8 import quantize_rows_reference, quantize_weight_reference
    from gemma4opt.ops.fp8_block import fp8_block_linear_reference, quantize_blocks_reference

    bw = copy_bandwidth("cuda")
    out = open(args.json, "w") if args.json else None
    for preset in args.presets:
        cfg = preset_config(preset)
        for M in (m for m in args.m if m <= 32):
            for name, _, _, (x, w), _ in linear_cases(cfg, M):
                wq, ws = quantize_blocks_reference(w, block, block)
                xq, xs = quantize_rows_reference(x)
                cq, cs = quantize_weight_reference(w)
                want = fp8_block_linear_reference(x, wq, ws, block, block)
                fp8_block_linear_triton(x, wq, ws, block, block)        # autotune outside the timed graphs
                timed = {"bf16 F.linear": _graph_us(lambda: torch.nn.functional.linear(x, w), rep=20),
                         "per-channel fp8": _graph_us(lambda: fp8_linear_triton(xq, xs, cq, cs, DT), rep=20),
                         "autotuned": _graph_us(lambda: fp8_block_linear_triton(x, wq, ws, block, block), rep=20)}
                ranked = _time_tiles(name, _fp8_block_tiles(M),
                                     lambda tile: fp8_block_linear_triton(x, wq, ws, block, block, tile), want, timed)
                floor_us = _nbytes(wq) / bw * 1e6
                row = dict(preset=preset, M=M, op=name, block=block, weight_floor_us=floor_us,
                           **{k: timed[k] for k in ("bf16 F.linear", "per-channel fp8", "autotuned")},
                           best=ranked[:5], best_us=[timed[k] for k in ranked[:5]])
                print(f"{preset:>6} {M:>3} {name:>24} fp8 bytes {floor_us:6.2f} us; bf16 {timed['bf16 F.linear']:7.2f} "
                      f"per-channel fp8 {timed['per-channel fp8']:7.2f} block autotuned {timed['autotuned']:7.2f} "
                      f"best {timed[ranked[0]] if ranked else float('nan'):7.2f} {ranked[0] if ranked else ''}",
                      flush=True)
                _write_ranked(out, row, timed, ranked)


@triton.jit
def _empty_kernel(X, PDL: tl.constexpr):
    pdl_prologue(PDL)


def launch_floor() -> dict:
    """The time of a kernel that does nothing, replayed back to back in a CUDA graph, with and
    without programmatic dependent launch: no kernel of a chain can take less. A kernel that is at
    this floor cannot be made faster, only removed."""
    x = torch.empty(1, device="cuda")
    out = {}
    for pdl in (True, False):
        _util.set_pdl(pdl)
        fn = lambda: _empty_kernel[(1,)](x, **_util.pdl_flags(x))  # noqa: E731
        fn()
        out["pdl" if pdl else "plain"] = _graph_us(fn, rep=50)
    _util.set_pdl(True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["31b", "e4b", "26b-a4b"])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 256, 8192])
    ap.add_argument("--json", default=None)
    ap.add_argument("--linear", action="store_true",
                    help="the decode GEMMs instead (skinny Triton GEMM vs F.linear / cuBLAS; M <= 32)")
    ap.add_argument("--only", default=None, help="only the cases whose name contains this (e.g. moe_experts)")
    ap.add_argument("--sweep", choices=sorted(_sweeps()), default=None,
                    help="time the kernel's launch under every override of its sweep grid (gelu: block x warps)")
    ap.add_argument("--sweep-norm-rope", action="store_true",
                    help="time rms_norm_rope / qkv_norm_rope_append under every (heads per program, warps)")
    ap.add_argument("--sweep-linear", action="store_true",
                    help="time every skinny GEMM tile against cuBLAS on the decode GEMMs (2-32 rows)")
    ap.add_argument("--sweep-fp8-block", action="store_true",
                    help="time every tile of the block-scaled fp8 GEMM (128 x 128 blocks) on the decode GEMMs "
                         "(1-32 rows) beside the per-channel fp8 GEMM and bf16")
    args = ap.parse_args(argv)
    if args.sweep_linear:
        return sweep_linear(args)
    if args.sweep_fp8_block:
        return sweep_fp8_block(args)
    if args.sweep_norm_rope or args.sweep:
        return sweep(args, args.sweep or "norm_rope")
    bw = copy_bandwidth("cuda")
    floor = launch_floor()
    print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  dtype {DT}  empty kernel "
          f"{floor['plain']:.2f} us ({floor['pdl']:.2f} with PDL)")
    print(f"{'preset':>8} {'M':>5} {'op':>28} {'triton us':>10} {'no PDL':>7} {'inductor us':>11} {'speedup':>8} "
          f"{'GB/s':>7} {'of copy bw':>10}")
    rows = [dict(op="empty kernel (launch floor)", triton_us=floor["pdl"], triton_no_pdl_us=floor["plain"])]
    torch._dynamo.config.recompile_limit = 256
    for preset in args.presets:
        cfg = preset_config(preset)
        for M in args.m:
            if args.linear and M > 32:
                continue
            for name, fn, ref, fargs, nbytes in (linear_cases if args.linear else cases)(cfg, M):
                if args.only and args.only not in name:
                    continue
                compiled = torch.compile(ref, dynamic=False)
                fn(*fargs), compiled(*fargs)           # compile / JIT outside the timed graphs
                torch.cuda.synchronize()
                # Timed as CUDA-graph replays, as decode runs them: no Python launch overhead.
                t_fused = _graph_us(lambda: fn(*fargs), rep=50)
                _util.set_pdl(False)        # the same kernel launched plainly (a recompile: PDL is constexpr)
                fn(*fargs)
                t_plain = _graph_us(lambda: fn(*fargs), rep=50)
                _util.set_pdl(True)
                t_ind = _graph_us(lambda: compiled(*fargs), rep=50)
                gbs = nbytes / (t_fused * 1e-6) / 1e9
                row = dict(preset=preset, M=M, op=name, triton_us=t_fused, triton_no_pdl_us=t_plain, inductor_us=t_ind,
                           speedup=t_ind / t_fused, gb_s=gbs, frac_copy_bw=gbs * 1e9 / bw)
                tuned = ""
                if args.linear:     # the tile (and split) the autotuner kept for this shape
                    from gemma4opt.kernels.skinny_linear import _tuned

                    row["config"] = tuned = str(_tuned.best_config)
                rows.append(row)
                print(f"{preset:>8} {M:>5} {name:>28} {t_fused:>10.2f} {t_plain:>7.2f} {t_ind:>11.2f} {row['speedup']:>7.2f}x "
                      f"{gbs:>7.0f} {row['frac_copy_bw']:>9.0%}  {tuned}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
