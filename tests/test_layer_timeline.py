"""profile_decode's per-layer table (benchmarks/layer_timeline.py): where layers are cut, their times and bytes."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import layer_timeline as lt  # noqa: E402
import roofline  # noqa: E402
from profile_decode import category  # noqa: E402

ATTN = ["_decode_split_kernel", "_merge_kernel"]
# The e4b's layer at one row: q/k/v, its prep, attention, o, the attention tail, the MLP, the PLE block.
LAYER = ["_skinny_kernel", "_qkv_norm_rope_append_kernel", *ATTN, "_skinny_kernel", "_add_rms_norm_kernel",
         "_gate_up_gelu_kernel", "_skinny_kernel", "_norm_linear_kernel", "_skinny_kernel", "_add_rms_norm_kernel"]
PROLOGUE = ["Memcpy HtoD (Pinned -> Device)", "_rope_cos_sin_kernel", "_rms_norm_kernel"]
HEAD = ["_skinny_kernel", "_softcap_kernel", "reduce_kernel ArgMaxOps", "CatArrayBatchedCopy"]


def timeline(names, dur=2.0, gap=0.5):
    """Kernels back to back: each ``dur`` us, ``gap`` us apart."""
    out, t = [], 0.0
    for n in names:
        out.append(lt.Kernel(n, t, t + dur))
        t += dur + gap
    return out


def split(ks):
    return lt.split_layers(ks, lambda n: category(n) == "attention", lambda n: category(n) == "gemm")


def test_layers_start_at_their_qkv_projection_and_the_head_is_what_follows_the_last():
    ks = timeline(PROLOGUE + LAYER * 3 + HEAD)
    prologue, layers, head = split(ks)
    assert [k.name for k in prologue] == PROLOGUE
    assert len(layers) == 3 and all([k.name for k in layer] == LAYER for layer in layers)
    assert [k.name for k in head] == HEAD


def test_a_tail_fused_into_the_next_projection_and_a_gemm_right_before_it():
    """The PLE projection (a GEMM) right before the next layer's fused tail + q/k/v (another GEMM):
    the layer starts at the latter, the GEMM last before its attention."""
    layer = ["_norm_linear_kernel", "_qkv_norm_rope_append_kernel", *ATTN, "_skinny_kernel", "_skinny_kernel"]
    _, layers, head = split(timeline(["_rms_norm_kernel"] + layer * 4 + ["_skinny_kernel"]))
    assert [len(x) for x in layers] == [6, 6, 6, 6] and all(x[0].name == "_norm_linear_kernel" for x in layers)
    assert [k.name for k in head] == ["_skinny_kernel"]


def test_a_split_k_projection_starts_the_layer_at_its_gemm_not_its_reduce():
    layer = ["nvjet_sm90_tst_64x8_splitK_TNT", "void cublasLt::splitKreduce_kernel", "_rms_norm_rope_kernel", *ATTN,
             "nvjet_sm90_tst_64x8_TNT", "_norm_add_kernel"]
    prologue, layers, _ = split(timeline(["embedding"] + layer * 2))
    assert [k.name for k in prologue] == ["embedding"]
    assert all(x[0].name.endswith("splitK_TNT") and len(x) == len(layer) for x in layers)


def test_an_attention_kernel_without_a_gemm_before_it_is_an_error():
    with pytest.raises(ValueError, match="no GEMM kernel before the attention kernel"):
        split(timeline(["_skinny_kernel", *ATTN, "_softcap_kernel", *ATTN]))


def test_times_idle_and_bytes_per_layer():
    # Layer 0: a 10 us GEMM, a 4 us gap, two overlapping attention kernels (4-6 us), then layer 1.
    ks = [lt.Kernel("_skinny_kernel", 0, 10), lt.Kernel("_decode_split_kernel", 14, 20),
          lt.Kernel("_merge_kernel", 18, 22), lt.Kernel("_skinny_kernel", 30, 40),
          lt.Kernel("_decode_split_kernel", 40, 50), lt.Kernel("_merge_kernel", 50, 51),
          lt.Kernel("_softcap_kernel", 60, 61)]
    prologue, layers, head = split(ks)
    s0, s1 = lt.layer_stats(layers, head, {0: 60_000_000, 1: 21_000_000})
    assert s0.time == 30 and s0.idle == 30 - (10 + 8)       # to layer 1's start; the union of the overlap
    assert s0.gaps == (0.0, 4.0, 0.0) and s0.durations == (10, 6, 4)
    assert s0.own == (10, 6, 2)         # the merge adds 2 us after the split kernel's end
    assert sum(s0.own) + sum(s0.gaps) == s0.time - 8       # the 8 us before layer 1 are idle after the layer
    assert s1.time == 30 and s1.idle == 30 - 21             # to the head's first kernel
    lines = lt.report([s0, s1], prologue, head, copy_bw=4e12)
    kinds = [line.split() for line in lines[2:4]]
    # One kind (same kernels): median time 30 us, bytes median 40.5 MB -> 40.5e6 / 30e-6 / 4e12 = 34 %.
    assert kinds[0][:3] == ["A", "0-1", "3"] and kinds[0][3] == "30.0" and kinds[0][-1] == "34%"
    assert "2 layers, 60.0 us (30.0 us and 3.0 launches a layer)" in lines[0]


def test_layer_kinds_and_their_ranges():
    other = ["_skinny_kernel", "_rms_norm_rope_kernel", *ATTN, "_skinny_kernel"]
    # The last layer is taken as long as the one before it (module doc): both of kind B here.
    ks = timeline(LAYER * 2 + other * 2 + LAYER + other * 2 + HEAD)
    _, layers, head = split(ks)
    assert [k.name for k in head] == HEAD
    lines = lt.report(lt.layer_stats(layers, head), [], head)
    assert [line.split()[:3] for line in lines[2:4]] == [["A", "0-1,", "4"], ["B", "2-3,", "5-6"]]
    assert lines[2].split()[3] == str(len(LAYER)) and lines[3].split()[3] == "5"
    assert any(line.strip().startswith("kind B (4 layers)") for line in lines)


def test_per_layer_bytes_add_up_to_the_step():
    from tests.models import tiny

    model = tiny()
    per = roofline.weight_bytes_per_layer(model, 1)
    outside = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if roofline.layer_index(n) is None
                  and "embed_tokens" not in n)
    cfg = model.config.get_text_config()
    assert sorted(per) == list(range(cfg.num_hidden_layers))
    assert sum(per.values()) <= roofline.weight_bytes_per_step(model, 1) - outside
    kv = roofline.kv_bytes_per_layer(model, 2, 40)
    assert len(kv) == cfg.num_hidden_layers and sum(kv) == roofline.kv_bytes_per_step(model, 2, 40)
    assert roofline.layer_index("model.language_model.layers.12.mlp.down_proj.weight") == 12
    assert roofline.layer_index("model.language_model.embed_tokens.weight") is None


def test_the_results_page_shows_a_profiles_per_layer_table(tmp_path, monkeypatch):
    import results_page

    table = lt.report(lt.layer_stats(*split(timeline(LAYER * 2 + HEAD))[1:]), [], [])
    lines = ["# python3 benchmarks/profile_decode.py --preset e4b", "warm-up (compile) 1.0 s",
             *[f"line {i}" for i in range(20)], *table, "small host-launched ops by input shape", "  aten::copy_"]
    (tmp_path / "profile_e4b_h200.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(results_page, "RESULTS", str(tmp_path))
    page = results_page.profile_section()
    assert table[0] in page and table[-1] in page
    assert "line 7" in page and "line 8" not in page and "  aten::copy_" not in page


def test_profile_decode_prints_the_table_with_each_layers_bytes(capsys):
    """The tiny model's layers (its layer count of them) with their bytes and a share of the copy bandwidth."""
    import profile_decode
    from tests.models import tiny

    model = tiny()
    n = model.config.get_text_config().num_hidden_layers
    profile_decode.print_layers(timeline(PROLOGUE + LAYER * n + HEAD), model, 1, 20, device="cpu")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"per-layer timeline of the last decode step: {n} layers")
    kind = lines[2].split()
    assert kind[1] == f"0-{n - 1}" and float(kind[-2]) > 0 and kind[-1].endswith("%")
    # Fewer layers found than the model has: the table without bytes, and a line saying so.
    profile_decode.print_layers(timeline(LAYER + HEAD), model, 1, 20, device="cpu")
    out = capsys.readouterr().out
    assert f"1 layers found, the model has {n}: bytes left out" in out and out.splitlines()[3].split()[-1] == "-"


def test_a_recorded_listing_is_read_back_into_the_table(tmp_path, capsys):
    """profile_decode's listing (idle before, us, name) re-read: same kernels and times; with a
    preset, each layer's bytes from its config alone (a meta-device model)."""
    ks = timeline(PROLOGUE + LAYER * 2 + HEAD, dur=2.0, gap=0.5)
    listing = ["warm-up (compile) 1.0 s", "the last decode step in order (9 kernels): gap before (us), duration (us), kernel",
               *[f"  {0.0 if i == 0 else 0.5:6.1f} {k.end - k.start:7.1f}  {k.name}" for i, k in enumerate(ks)],
               "device timeline over the last 7 decode steps: ..."]
    path = tmp_path / "profile.txt"
    path.write_text("\n".join(listing) + "\n")
    assert lt.read_listing(str(path)) == ks
    lt.main([str(path), "--preset", "tiny", "--layers", "2", "--context", "20", "--copy-bw", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("per-layer timeline of the last decode step: 2 layers") and lines[2].split()[-1] != "-"
    (tmp_path / "bare.txt").write_text("warm-up (compile) 1.0 s\n")
    with pytest.raises(ValueError, match="no listing"):
        lt.read_listing(str(tmp_path / "bare.txt"))
