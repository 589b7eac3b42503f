"""optimize() changes one instance: no transformers class, module or registry entry that another
model uses, and not the config object it shares with another model."""
import inspect
import sys

import pytest
import torch
import transformers
from transformers import Gemma4ForCausalLM
from transformers.generation import utils as gen_utils
from transformers.generation.utils import GenerationMixin

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.presets import preset_config, randomize_
from tests.models import prompt

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _from(config, seed=0):
    torch.manual_seed(seed)
    return randomize_(Gemma4ForCausalLM(config).eval(), seed)


def _classes():
    mod = sys.modules[Gemma4ForCausalLM.__module__]
    found = [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == mod.__name__]
    found += [GenerationMixin, Gemma4ForCausalLM, transformers.PreTrainedModel]
    for name in ("Gemma4ForConditionalGeneration", "Gemma4TextConfig", "Gemma4Config"):
        if hasattr(transformers, name):
            found.append(getattr(transformers, name))
    if getattr(gen_utils, "DeferredStopCheck", None) is not None:
        found.append(gen_utils.DeferredStopCheck)
    return found


def _snapshot():
    snap = {f"{c.__module__}.{c.__qualname__}": {k: id(v) for k, v in vars(c).items()} for c in _classes()}
    snap["module transformers.generation.utils"] = {k: id(v) for k, v in vars(gen_utils).items()}
    return snap


def _outputs(model, ids, mask):
    with torch.no_grad():
        return (model(ids, attention_mask=mask).logits,
                model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("cfg", [None, PAGED], ids=["hf", "paged"])
def test_nothing_outside_the_instance_changes(cfg):
    from transformers import AttentionInterface

    config = preset_config("tiny")
    config._attn_implementation = "sdpa"
    one, other = _from(config), _from(config)
    assert one.config is other.config is config
    ids = prompt(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    before = _outputs(other, ids, mask)
    attn_before = {id(c): c._attn_implementation for c in (config, config.get_text_config())}
    gen_before = other.generation_config.to_dict()
    classes_before = _snapshot()

    gemma4opt.optimize(one, cfg)
    mine = _outputs(one, ids, mask)                       # optimized calls, generate included
    assert torch.equal(mine[1], before[1])

    assert _snapshot() == classes_before
    assert other.config is config and one.config is not config
    assert {id(c): c._attn_implementation for c in (config, config.get_text_config())} == attn_before
    assert other.generation_config.to_dict() == gen_before and one.generation_config is not other.generation_config
    assert "forward" not in vars(other) and "generate" not in vars(other) and "_apply" not in vars(other)
    after = _outputs(other, ids, mask)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    # gemma4opt's attention entry (registered for paged calls) is selected by no other model
    ours = [k for k in AttentionInterface._global_mapping if "gemma4opt" in k]
    assert config._attn_implementation not in ours and other.config.get_text_config()._attn_implementation == "sdpa"
    assert one.config.get_text_config()._attn_implementation == "sdpa"   # outside a paged call: HF's own
