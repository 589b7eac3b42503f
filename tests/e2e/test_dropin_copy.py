"""``copy.deepcopy`` and pickle of an optimized model give what HF's give: an independent model,
optimized with the same config, running its own weights: an edit to one model's weights shows in
that model's outputs only, and either model is freed when its last reference goes.

Python's own copy would keep gemma4opt's instance attributes as they were, a forward whose closure
holds the original's state: the copy ran the original's weights, whatever was done to its own; a
pickle stopped at them with an error naming an HF function (gemma4opt/copying.py)."""
import copy
import gc
import weakref

import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import greedy, prompt, tiny

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)
CONFIGS = {"default": None, "paged": PAGED, "fp8": Gemma4OptConfig(quantization="fp8", quantize_lm_head=True)}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _edit_(model) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            down = layer.mlp.down_proj      # an nn.Linear, or gemma4opt's Fp8Linear (e4m3 weight, fp32 scales)
            getattr(down, "weight_scale", down.weight).mul_(-3.0)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_deep_copy_is_optimized_and_runs_its_own_weights(name):
    model = gemma4opt.optimize(tiny("tiny-ple-shared"), CONFIGS[name])
    ids = prompt(2, 9)
    before = greedy(model, ids)
    twin = copy.deepcopy(model)
    assert twin._gemma4opt is not model._gemma4opt and twin._gemma4opt.user_config == model._gemma4opt.user_config
    assert torch.equal(greedy(twin, ids), before)
    # The oracle: an unoptimized model with the copy's weights, edited the same way.
    oracle = tiny("tiny-ple-shared")
    if name != "fp8":
        unedited = _logits(twin, ids)
        _edit_(twin)
        _edit_(oracle)
        assert not torch.equal(_logits(twin, ids), unedited)
        assert torch.equal(_logits(twin, ids), _logits(oracle, ids))
        assert torch.equal(greedy(twin, ids), greedy(oracle, ids))
    else:                                               # no bf16 oracle of fp8 weights: the copy against itself
        edited = copy.deepcopy(twin)
        _edit_(edited)
        assert not torch.equal(_logits(edited, ids), _logits(twin, ids))
        assert torch.equal(_logits(copy.deepcopy(edited), ids), _logits(edited, ids))
    assert torch.equal(greedy(model, ids), before)      # the original untouched
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "the copy keeps the original alive"
    assert greedy(twin, ids).shape == before.shape


def test_a_copy_of_a_vision_language_models_text_decoder_is_hfs_module():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from gemma4opt.presets import TINY_PRESETS, randomize_

    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=TINY_PRESETS["tiny"], vision_config=None, audio_config=None)
    model = randomize_(Gemma4ForConditionalGeneration(cfg).eval())
    ids = prompt(1, 10)
    oracle = copy.deepcopy(model)
    gemma4opt.optimize(model)
    greedy(model, ids)
    decoder = copy.deepcopy(model.model.language_model)
    assert "forward" not in vars(decoder) and "__deepcopy__" not in vars(decoder)
    with torch.no_grad():
        assert torch.equal(decoder(ids).last_hidden_state, oracle.model.language_model(ids).last_hidden_state)
    whole = copy.deepcopy(model)
    assert whole._gemma4opt is not model._gemma4opt
    assert torch.equal(greedy(whole, ids), greedy(oracle, ids))


def test_a_copy_of_a_model_whose_config_was_not_recognized_is_hfs_model_too():
    model = tiny()
    ref = copy.deepcopy(model)
    model.config.get_text_config().model_type = "not_gemma4_text"
    with pytest.warns(UserWarning, match="not recognized|model_type"):
        gemma4opt.optimize(model)
    twin = copy.deepcopy(model)
    assert twin._gemma4opt is not model._gemma4opt and twin._gemma4opt.disabled_reason
    ids = prompt(1, 7)
    assert torch.equal(greedy(twin, ids), greedy(ref, ids))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_pickled_model_loads_optimized_with_the_same_config(name):
    import io

    model = gemma4opt.optimize(tiny("tiny-ple-shared"), CONFIGS[name])
    ids = prompt(2, 9)
    before = greedy(model, ids)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert torch.equal(greedy(model, ids), before)          # the original as it was
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._gemma4opt is not model._gemma4opt and loaded._gemma4opt.user_config == model._gemma4opt.user_config
    assert torch.equal(greedy(loaded, ids), before)
    assert loaded._gemma4opt.compiled_calls > 0             # its own compiled entry ran
    assert loaded.generation_config.to_dict() == model.generation_config.to_dict()
    assert {n: p.dtype for n, p in loaded.state_dict().items()} == {n: p.dtype for n, p in model.state_dict().items()}


def test_a_pickled_submodule_is_hfs_module():
    import pickle

    model = gemma4opt.optimize(tiny("tiny-ple-shared"), PAGED)
    greedy(model, prompt(1, 7))
    attention = pickle.loads(pickle.dumps(model.model.layers[0].self_attn))
    assert not {"_gemma4opt_ctx", "__getstate__", "forward"} & set(vars(attention))
    layer = copy.deepcopy(model.model.layers[0])
    assert "_gemma4opt_ctx" not in vars(layer.self_attn)


def test_a_shallow_copy_shares_the_model():
    import pickle

    model = gemma4opt.optimize(tiny())
    ref = tiny()
    shallow = copy.copy(model)
    ids = prompt(1, 7)
    assert shallow._gemma4opt is model._gemma4opt and shallow.lm_head is model.lm_head
    assert torch.equal(greedy(shallow, ids), greedy(ref, ids))
    assert pickle.loads(pickle.dumps(ref)) is not None           # HF's model itself pickles
