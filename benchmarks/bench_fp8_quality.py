"""FP8 quality on a random-weight model: teacher-forced logits against the same model in its own dtype.

    python3 benchmarks/bench_fp8_quality.py --preset 31b --layers 12 --json rows.jsonl

Systems, each the same model's attention and dense-MLP projections and MoE experts in fp8 (lm_head,
router, PLE kept), over ``--batch x --seq`` random tokens (>= 512 positions):
- ``gemma4opt-fp8``: ``optimize(model, Gemma4OptConfig(quantization="fp8"))`` (fused quantizing
  producers, the fp8 GEMMs); ``gemma4opt-fp8-head``: and ``quantize_lm_head=True`` (the lm_head in
  fp8 too, one scale per vocabulary row; not a default system);
- ``fp8-reference``: the same weights swapped by ops/fp8_weights.py and run by HF's eager forward
  (per-channel weight scales, per-token activation scales, fp32 GEMM: the semantics gemma4opt fuses;
  experts weight-only, per (expert, row) scales);
- ``hf-finegrained-fp8``: transformers' FineGrainedFP8Config semantics (128 x 128 weight blocks,
  1 x 128 activation groups, dynamic) emulated in torch on the same projections and, as its
  FP8Experts does, on each expert's gate_up and down, the anchor: its own kernel comes from the
  `kernels` hub, which an offline machine cannot load;
- ``gemma4opt-finegrained-fp8`` (not a default system): the model as transformers' FineGrainedFP8
  loading leaves it (presets.finegrained_fp8_: its own module swap and weight quantizer), run by
  ``optimize(model)``: the block-scaled GEMM on the checkpoint's bytes, the anchor's scheme where
  the dims are whole blocks (transformers leaves a weight that is not in the model's dtype: the
  26b-a4b's dense MLP and experts' down at 128);
- ``hf-fp8-kernel`` (not a default system; a GPU): the anchor's model as transformers' FineGrainedFP8
  loading leaves it, run by transformers' own FP8Linear / FP8Experts forward on its finegrained-fp8
  Triton kernel, loaded from a local copy of its source (hf_fp8_kernel.py, ``--hf-fp8-kernel``): the
  real path where the emulation above stands in for it;
- ``fp8-channel-weights-group-acts``, ``fp8-block-weights-token-acts``: the anchor with one side in
  gemma4opt's scheme (not default systems): which side a difference between the two comes from.
Per system: the mean KL(p_ref || p_fp8) over positions and the top-1 agreement with the reference.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

import gemma4opt
from gemma4opt.ops.fp8 import FP8_DTYPE, FP8_MAX, SCALE_MIN
from gemma4opt.ops.fp8_weights import QUANTIZED_BLOCKS, quantize_linears
from gemma4opt.presets import ALL_PRESETS, build_model, finegrained_fp8_


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # hf_fp8_kernel, beside this script

ANCHOR = "hf-finegrained-fp8"      # measured first (the default order): later rows say how far from it


def _block_quantize(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] quantized in (rows x cols) blocks, one scale each (fp32 math): (e4m3 [R, C], scales
    [ceil(R / rows), ceil(C / cols)]); the last blocks of a side that is not a multiple are partial,
    as FineGrainedFP8's scales make them: zero padding changes no block's amax."""
    R, C = x.shape
    pr, pc = -R % rows, -C % cols
    xf = torch.nn.functional.pad(x.float(), (0, pc, 0, pr))
    Rp, Cp = xf.shape
    xf = xf.reshape(Rp // rows, rows, Cp // cols, cols)
    scale = (xf.abs().amax(dim=(1, 3), keepdim=True) / torch.full((), FP8_MAX, device=x.device)).clamp_min(SCALE_MIN)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(Rp, Cp)[:R, :C], scale.reshape(Rp // rows, Cp // cols)


def _block_dequantize(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    R, C = q.shape
    return q.float() * scale.repeat_interleave(rows, 0)[:R].repeat_interleave(cols, 1)[:, :C]


def _blocks_quant(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [R, C] quantized and dequantized in (rows x cols) blocks (fp32)."""
    return _block_dequantize(*_block_quantize(x, rows, cols), rows, cols)


class BlockFp8Linear(torch.nn.Module):
    """FineGrainedFP8's scheme in torch: weight in (block x block) tiles, activations in 1 x block
    groups per token, both dynamic scales = amax / 448, product in fp32. ``weights="channel"`` or
    ``acts="token"``: that side in gemma4opt's scheme instead (one scale per output channel / per
    token), to see which side a difference between the two schemes comes from."""

    def __init__(self, linear: torch.nn.Linear, block: int, weights: str = "block", acts: str = "group"):
        super().__init__()
        self.block, self.acts = block, acts
        w = linear.weight.detach()
        self.register_buffer("w", _blocks_quant(w, block, block) if weights == "block" else _blocks_quant(w, 1, w.shape[1]))

    def forward(self, x):
        K = x.shape[-1]
        xd = _blocks_quant(x.reshape(-1, K), 1, self.block if self.acts == "group" else K).reshape(x.shape)
        return torch.matmul(xd, self.w.t()).to(x.dtype)


class BlockFp8Experts(torch.nn.Module):
    """FineGrainedFP8's experts in torch: each expert's gate_up and down in (block x block) tiles,
    each GEMM's input in 1 x block groups per token; HF's per-expert loop otherwise."""

    def __init__(self, experts: torch.nn.Module, block: int):
        super().__init__()
        self.block = block
        # Kept in e4m3 with their block scales and widened one expert at a time in forward: all the
        # 26b-a4b's experts in fp32 would take 4x its bf16 weights (it ran out of an H200's memory).
        for name, ws in (("gu", experts.gate_up_proj), ("dn", experts.down_proj)):
            qs = [_block_quantize(w.detach(), block, block) for w in ws]
            self.register_buffer(name, torch.stack([q for q, _ in qs]))
            self.register_buffer(name + "_scale", torch.stack([s for _, s in qs]))

    def _linear(self, x, q, scale):
        w = _block_dequantize(q, scale, self.block, self.block)
        return torch.matmul(_blocks_quant(x, 1, self.block), w.t())

    def forward(self, x, top_k_index, top_k_weights):
        I = self.gu.shape[1] // 2
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(top_k_index).tolist():
            t, j = torch.nonzero(top_k_index == e, as_tuple=True)
            gu = self._linear(x[t], self.gu[e], self.gu_scale[e]).to(x.dtype)
            act = torch.nn.functional.gelu(gu[:, :I], approximate="tanh") * gu[:, I:]
            y = self._linear(act, self.dn[e], self.dn_scale[e]).to(x.dtype).float() * top_k_weights[t, j].float()[:, None]
            out.index_add_(0, t, y)
        return out.to(x.dtype)


def block_fp8(model: torch.nn.Module, block: int, weights: str = "block", acts: str = "group") -> None:
    for module in list(model.modules()):
        if type(getattr(module, "experts", None)).__name__ == "Gemma4TextExperts":
            module.experts = BlockFp8Experts(module.experts, block)
        for name in QUANTIZED_BLOCKS.get(type(module).__name__, ()):
            lin = getattr(module, name, None)
            if lin is not None:
                setattr(module, name, BlockFp8Linear(lin, block, weights, acts))


# The anchor with one side swapped for gemma4opt's scheme (projections only; experts as the anchor's).
MIXED = {"fp8-channel-weights-group-acts": dict(weights="channel", acts="group"),
         "fp8-block-weights-token-acts": dict(weights="block", acts="token")}


def _metrics(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(KL(p_ref || p_got) in nats at every position, flattened; top-1 agreement over them)."""
    lp, lq = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).flatten().double()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    return kl, top1


def _vs_anchor(kl: torch.Tensor, anchor: torch.Tensor) -> tuple[float, float]:
    """(mean KL - the anchor's) / the anchor's mean, and that ratio's standard error, paired by
    position (each position's two KLs come from the same tokens). Positions of one sequence are not
    independent draws, so the error is a guide to the noise, not a test."""
    d = kl - anchor
    return (d.mean() / anchor.mean()).item(), (d.std() / d.numel() ** 0.5 / anchor.mean()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(ALL_PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--block", type=int, default=128, help="FineGrainedFP8's block (128; smaller for tiny presets)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--systems", nargs="+", default=["hf-finegrained-fp8", "fp8-reference", "gemma4opt-fp8"],
                    choices=["hf-finegrained-fp8", "fp8-reference", "gemma4opt-fp8", "gemma4opt-fp8-head",
                             "gemma4opt-finegrained-fp8", "hf-fp8-kernel", *MIXED])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="the reference model's dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    ap.add_argument("--hf-fp8-kernel", default=None,
                    help="hf-fp8-kernel: the finegrained-fp8 kernel package (default .hfkernels/finegrained_fp8)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", default=None)
    args = ap.parse_args(argv)
    dtype = (getattr(torch, args.dtype) if args.dtype else
             torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model = build_model(args.preset, args.layers, dtype=dtype, device=args.device)
    cfg = model.config.get_text_config()
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    run = args.run or time.strftime("%Y-%m-%d %H:%M/") + f"fp8_quality_{args.preset}_l{cfg.num_hidden_layers}"
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    with torch.no_grad():
        ref = model(ids).logits.float().cpu()
    print(f"# {args.preset} x {cfg.num_hidden_layers} layers, {dtype}, {args.batch * args.seq} positions on {machine}")
    rows, anchor = [], None
    for i, system in enumerate(args.systems):
        # The last system quantizes the model itself: at most one copy is alive (full 31b: 62 GB each).
        m = model if i == len(args.systems) - 1 else copy.deepcopy(model)
        if system in ("gemma4opt-fp8", "gemma4opt-fp8-head"):
            gemma4opt.optimize(m, gemma4opt.Gemma4OptConfig(quantization="fp8",
                                                             quantize_lm_head=system == "gemma4opt-fp8-head"))
        elif system == "gemma4opt-finegrained-fp8":
            finegrained_fp8_(m, (args.block, args.block), skip=("lm_head",))
            gemma4opt.optimize(m)
        elif system == "hf-fp8-kernel":
            import hf_fp8_kernel

            hf_fp8_kernel.load(args.hf_fp8_kernel)
            finegrained_fp8_(m, (args.block, args.block), skip=("lm_head",))
        elif system == "fp8-reference":
            quantize_linears(m)
        else:
            block_fp8(m, args.block, **MIXED.get(system, {}))
        with torch.no_grad():
            got = m(ids).logits.float().cpu()
        kls, top1 = _metrics(ref, got)
        kl = kls.mean().item()
        row = dict(run=run, machine=machine, command="python3 benchmarks/bench_fp8_quality.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), preset=args.preset, layers=cfg.num_hidden_layers,
                   positions=args.batch * args.seq, dtype=str(dtype).replace("torch.", ""), system=system,
                   kl=kl, kl_se=(kls.std() / kls.numel() ** 0.5).item(), top1=top1)
        line = f"{system:>20}  KL {kl:.3g} nats  top-1 agreement {top1:.4f}"
        if system == ANCHOR:
            anchor = kls
        elif anchor is not None:
            row["kl_vs_anchor"], row["kl_vs_anchor_se"] = _vs_anchor(kls, anchor)
            line += f"  KL vs the anchor {row['kl_vs_anchor']:+.1%} ± {row['kl_vs_anchor_se']:.1%}"
        print(line, flush=True)
        rows.append(row)
        del m
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
