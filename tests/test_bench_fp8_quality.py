"""benchmarks/bench_fp8_quality.py on a tiny preset (CPU): rows for each system, and gemma4opt's
fp8 logits equal to the fp8 reference path's (the same KL and top-1)."""
import importlib.util
import json
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_fp8_quality.py")


def _main(argv):
    spec = importlib.util.spec_from_file_location("bench_fp8_quality", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def test_rows_and_gemma4opt_equal_to_the_reference_path(tmp_path):
    out = tmp_path / "q.jsonl"
    rows = _main(["--preset", "tiny", "--seq", "32", "--block", "32", "--device", "cpu", "--json", str(out)])
    by = {r["system"]: r for r in rows}
    assert set(by) == {"hf-finegrained-fp8", "fp8-reference", "gemma4opt-fp8"}
    assert by["gemma4opt-fp8"]["kl"] == by["fp8-reference"]["kl"] and by["gemma4opt-fp8"]["top1"] == by["fp8-reference"]["top1"]
    assert all(0 < r["kl"] < 0.1 and r["positions"] == 64 and 0 < r["kl_se"] < r["kl"] for r in rows)
    # Against the anchor (measured first): paired by position, so a system equal to it would read 0 ± 0.
    assert "kl_vs_anchor" not in by["hf-finegrained-fp8"]
    for name in ("fp8-reference", "gemma4opt-fp8"):
        r = by[name]
        assert abs(r["kl_vs_anchor"] - (r["kl"] / by["hf-finegrained-fp8"]["kl"] - 1)) < 1e-9 and r["kl_vs_anchor_se"] > 0
    assert [json.loads(line)["system"] for line in out.read_text().splitlines()] == [r["system"] for r in rows]


def test_paired_difference_is_zero_for_the_anchor_itself():
    spec = importlib.util.spec_from_file_location("bench_fp8_quality", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import torch

    kl = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    assert mod._vs_anchor(kl, kl) == (0.0, 0.0)
    ratio, se = mod._vs_anchor(kl * 1.5, kl)       # 50 % above, the differences' spread over sqrt(4)
    assert abs(ratio - 0.5) < 1e-12 and abs(se - (0.5 * kl).std().item() / 2 / 3.0) < 1e-12


def test_anchor_with_both_sides_swapped_is_gemma4opts_reference():
    """BlockFp8Linear with per-channel weights and per-token activations computes ops/fp8.py's
    reference product: the mixed systems swap exactly one scheme for the other."""
    import torch

    from gemma4opt.ops.fp8 import fp8_linear_reference, quantize_rows_reference, quantize_weight_reference

    spec = importlib.util.spec_from_file_location("bench_fp8_quality", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    lin = torch.nn.Linear(300, 70, bias=False)
    x = torch.randn(5, 300) * torch.rand(300) * 4
    got = mod.BlockFp8Linear(lin, 128, weights="channel", acts="token")(x)
    want = fp8_linear_reference(*quantize_rows_reference(x), *quantize_weight_reference(lin.weight.detach()), x.dtype)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    anchor = mod.BlockFp8Linear(lin, 128)(x)
    assert not torch.allclose(anchor, want, rtol=1e-6, atol=1e-6)      # the blocks do differ


def test_moe_experts_are_fp8_in_every_system():
    """tiny-moe: the anchor's emulation swaps each experts block too (FineGrainedFP8 quantizes
    experts), and gemma4opt's fp8 experts equal the reference path's."""
    spec = importlib.util.spec_from_file_location("bench_fp8_quality", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from tests.models import tiny

    model = tiny("tiny-moe")
    mod.block_fp8(model, 16)
    assert all(type(layer.experts).__name__ == "BlockFp8Experts" for layer in model.model.layers)
    rows = mod.main(["--preset", "tiny-moe", "--seq", "32", "--block", "16", "--device", "cpu"])
    by = {r["system"]: r for r in rows}
    assert by["gemma4opt-fp8"]["kl"] == by["fp8-reference"]["kl"] and all(r["kl"] > 0 for r in rows)


def test_a_finegrained_checkpoint_run_by_gemma4opt_measures_as_the_anchor():
    """The checkpoint's FP8Linear (transformers' own swap and weight quantizer) run by gemma4opt's
    block-scaled GEMM: the anchor's scheme, so its KL and top-1 are the anchor's but for the weight
    scales' rounding (transformers stores 1 / (448 / amax), the anchor amax / 448)."""
    rows = _main(["--preset", "tiny", "--seq", "32", "--block", "32", "--device", "cpu",
                  "--systems", "hf-finegrained-fp8", "gemma4opt-finegrained-fp8"])
    anchor, ours = rows
    assert ours["system"] == "gemma4opt-finegrained-fp8" and ours["kl"] > 0
    assert abs(ours["kl_vs_anchor"]) < 0.01 and abs(ours["top1"] - anchor["top1"]) <= 1 / 64


def test_hf_fp8_kernel_runs_transformers_forward_on_the_loaded_kernel(stand_in_kernel):
    """hf-fp8-kernel: transformers' FineGrainedFP8 model on the kernel package given, here a stand-in
    running the block-scaled reference (the real kernel is Triton for a GPU). transformers' quantizer
    and forward then compute the emulated anchor's scheme: the same KL, up to fp32 summation order."""
    import sys

    rows = _main(["--preset", "tiny", "--seq", "32", "--block", "32", "--device", "cpu",
                  "--hf-fp8-kernel", str(stand_in_kernel), "--systems", "hf-finegrained-fp8", "hf-fp8-kernel"])
    calls = sys.modules["finegrained_fp8_local"].CALLS
    assert calls and all(block == (32, 32) for _, _, block in calls)
    anchor, real = rows
    assert real["system"] == "hf-fp8-kernel" and 0 < real["kl"] < 0.1
    assert abs(real["kl_vs_anchor"]) < 1e-3, real
