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
])
def test_bad_field_is_named(kwargs, exc, field):
    with pytest.raises(exc, match=rf"Gemma4OptConfig\.{field}\b"):
        Gemma4OptConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(kv_pool_pages=2), dict(page_size=1), dict(patterns=()), dict(patterns=["rms_norm"]),
    dict(kv_pool_fraction=1), dict(kv_pool_fraction=0.25), dict(decode_buckets=[1, 4]),
    dict(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4), dict(deferred_stop=False),
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
