"""Gemma4OptConfig refuses bad field values at construction, naming the field."""
import pytest

from gemma4opt import Gemma4OptConfig


@pytest.mark.parametrize("kwargs, exc, field", [
    (dict(kv_pool_pages=-3), ValueError, "kv_pool_pages"),
    (dict(kv_pool_pages=0), ValueError, "kv_pool_pages"),
    (dict(kv_pool_pages=1), ValueError, "kv_pool_pages"),
    (dict(kv_pool_pages=2.0), TypeError, "kv_pool_pages"),
    (dict(page_size=3.5), TypeError, "page_size"),
    (dict(page_size="16"), TypeError, "page_size"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(page_size=None), TypeError, "page_size"),
    (dict(page_size=True), TypeError, "page_size"),
    (dict(max_batch_size=0), ValueError, "max_batch_size"),
    (dict(max_seq_len=-1), ValueError, "max_seq_len"),
    (dict(max_seq_len="96"), TypeError, "max_seq_len"),
    (dict(patterns="rms_norm"), TypeError, "patterns"),
    (dict(patterns=(1,)), TypeError, "patterns"),
    (dict(patterns=("nope",)), ValueError, "patterns"),
    (dict(attention="x"), ValueError, "attention"),
    (dict(attention=1), TypeError, "attention"),
    (dict(cache="paged-ish"), ValueError, "cache"),
    (dict(decode_kernel="cuda"), ValueError, "decode_kernel"),
    (dict(decode_buckets=(0,)), ValueError, "decode_buckets"),
    (dict(decode_buckets=()), ValueError, "decode_buckets"),
    (dict(decode_buckets=8), TypeError, "decode_buckets"),
    (dict(decode_buckets=(1.5,)), ValueError, "decode_buckets"),
    (dict(kv_pool_fraction=1.5), ValueError, "kv_pool_fraction"),
    (dict(kv_pool_fraction=0), ValueError, "kv_pool_fraction"),
    (dict(kv_pool_fraction=-0.1), ValueError, "kv_pool_fraction"),
    (dict(kv_pool_fraction="0.5"), TypeError, "kv_pool_fraction"),
    (dict(kv_pool_fraction=True), TypeError, "kv_pool_fraction"),
    (dict(inductor="yes"), TypeError, "inductor"),
    (dict(cuda_graphs=1), TypeError, "cuda_graphs"),
    (dict(deferred_stop=0), TypeError, "deferred_stop"),
    (dict(fast_replan=None), TypeError, "fast_replan"),
    (dict(kv_cache_dtype="fp16"), ValueError, "kv_cache_dtype"),
    (dict(kv_cache_dtype=None), ValueError, "kv_cache_dtype"),
    (dict(kv_cache_dtype=8), TypeError, "kv_cache_dtype"),
])
def test_bad_field_is_named(kwargs, exc, field):
    with pytest.raises(exc, match=rf"Gemma4OptConfig\.{field}\b"):
        Gemma4OptConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(kv_pool_pages=2), dict(page_size=1), dict(patterns=()), dict(patterns=["rms_norm"]),
    dict(kv_pool_fraction=1), dict(kv_pool_fraction=0.25), dict(decode_buckets=[1, 4]),
    dict(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4), dict(deferred_stop=False),
    dict(attention="paged", kv_cache_dtype="fp8"), dict(kv_cache_dtype="auto"),
])
def test_good_values_are_accepted(kwargs):
    cfg = Gemma4OptConfig(**kwargs)
    assert cfg == Gemma4OptConfig(**kwargs)          # lists are stored as tuples: hashable, comparable
    hash(cfg)


def test_resolve_refuses_what_the_device_cannot_run():
    with pytest.raises(ValueError, match="CUDA"):
        Gemma4OptConfig(cuda_graphs=True).resolve("cpu")
    with pytest.raises(ValueError, match="cache='static'"):
        Gemma4OptConfig(attention="paged", cache="static").resolve("cpu")
    with pytest.raises(ValueError, match="decode_buckets"):
        Gemma4OptConfig(decode_buckets=(8,), max_batch_size=4).resolve("cpu")


def test_fp8_kv_needs_the_paged_mode():
    import torch

    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is the paged KV pool's dtype: it needs "
                                         r"attention='paged' \(this model resolves to attention='hf'.*set in"):
        Gemma4OptConfig(attention="hf", kv_cache_dtype="fp8").resolve("cpu")
    # "auto" on a CPU is HF attention: the error says so, and why.
    with pytest.raises(ValueError, match=r"attention='paged' \(this model resolves to attention='hf'.*auto on cpu"):
        Gemma4OptConfig(kv_cache_dtype="fp8").resolve("cpu", torch.float32)
    assert Gemma4OptConfig(attention="paged", kv_cache_dtype="fp8").resolve("cpu").kv_cache_dtype == "fp8"


def test_auto_attention_with_fp8_kv_asks_flashinfer_about_the_fp8_pool(monkeypatch):
    """On CUDA, attention="auto" checks FlashInfer can read an fp8 pool of the model's head dims:
    the 31b's (256 / 512) yes; a head_dim 64 model (the demo preset) no, and the error says why."""
    import torch

    from gemma4opt.config import choose_attention
    from gemma4opt.paged.backends import flashinfer
    from gemma4opt.presets import preset_config

    monkeypatch.setattr(flashinfer, "available", lambda: None)
    big, demo = preset_config("31b", 6), preset_config("demo")
    assert choose_attention("cuda", torch.bfloat16, big, "fp8")[0] == "paged"
    assert choose_attention("cuda", torch.bfloat16, demo, "auto")[0] == "paged"
    mode, why = choose_attention("cuda", torch.bfloat16, demo, "fp8")
    assert mode == "hf" and "fp8 KV pool at head_dim 64" in why
    with pytest.raises(ValueError, match="needs attention='paged'.*fp8 KV pool at head_dim 64"):
        Gemma4OptConfig(kv_cache_dtype="fp8").resolve("cuda", torch.bfloat16, demo)
