"""rope_cos_sin on the real HF rotary embedding of each tiny variant, on transformers 5.17's matmul
form, and its refusals."""
import pytest
import torch

from gemma4opt.patterns import build_patterns
from tests.models import VARIANTS, prompt, tiny
from tests.patterns.helpers import Compiled


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_count_numerics_and_nothing_left(variant, dtype):
    model = tiny(variant, dtype=dtype)
    ids = prompt(2, 11)
    with torch.no_grad():
        want = model(ids).logits
    c = Compiled(model, ["rope_cos_sin"], text_config=model.config, max_seq_len=512)
    got = c(ids).logits
    assert c.matched("rope_cos_sin") == build_patterns()["rope_cos_sin"].expected(model.config, "causal_lm") == 2
    assert c.unfused("rope_cos_sin") == []
    assert torch.equal(got, want)                   # the CPU path is HF's own ops: same bits
    ops = c.ops()
    assert ops["cos"] == ops["sin"] == 0, ops          # (the concats left are rotate_half's)
    calls = [n for n in c.graphs[-1].graph.nodes if "rope_cos_sin" in str(n.target)]
    assert {n.args[3] for n in calls} == {dtype} and {n.args[5] for n in calls} == {512}


class Rotary517(torch.nn.Module):
    """transformers 5.17's Gemma4TextRotaryEmbedding.forward (the matmul form), one layer type."""

    def __init__(self, half=8, scaling=1.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 2 * half, 2).float() / (2 * half))),
                             persistent=False)
        self.attention_scaling = scaling

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(
            dtype=torch.float, device=x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Holder(torch.nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.rotary_emb = rotary

    def forward(self, x, position_ids):
        cos, sin = self.rotary_emb(x, position_ids)
        return x * cos + sin


def _run(module, max_seq_len=512):
    x = torch.randn(2, 5, 16).to(torch.bfloat16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 300, 511]])
    with torch.no_grad():
        want = module(x, pos)
    c = Compiled(module, ["rope_cos_sin"], max_seq_len=max_seq_len)
    return c, c(x, pos), want


@pytest.mark.parametrize("scaling", [1.0, 0.75])
def test_matmul_form_of_transformers_517(scaling):
    c, got, want = _run(Holder(Rotary517(scaling=scaling)))
    assert c.matched("rope_cos_sin") == 1, c.unfused("rope_cos_sin")
    assert torch.equal(got, want)
    call = next(n for n in c.graphs[-1].graph.nodes if "rope_cos_sin" in str(n.target))
    assert call.args[2:] == (scaling, torch.bfloat16, True, 512)
    assert c.ops()["matmul"] == c.ops()["cos"] == 0


@pytest.fixture
def tf32_on():
    # Not monkeypatch: torch 2.11's cuBLASModule answers the flag through __getattr__ only.
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_matmul_form_is_left_alone_where_tf32_may_run_it(tf32_on):
    c, got, want = _run(Holder(Rotary517()))
    assert c.matched("rope_cos_sin") == 0
    assert "allow_tf32" in c.unfused("rope_cos_sin")[0]
    assert torch.equal(got, want)


def test_unbounded_positions_are_left_alone():
    c, got, want = _run(Holder(Rotary517()), max_seq_len=None)
    assert c.matched("rope_cos_sin") == 0
    assert "unbounded" in c.unfused("rope_cos_sin")[0]


class Leaky(Rotary517):
    """The concat also read by something other than cos and sin."""

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * 1.0).to(x.dtype), (emb.sin() * 1.0).to(x.dtype)
        return cos + emb.to(x.dtype), sin


class OtherProduct(Rotary517):
    """Frequencies that are not position x inv_freq (an offset added)."""

    def forward(self, x, position_ids):
        freqs = (position_ids[..., None].float() + 1.0) * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * 1.0).to(x.dtype), (emb.sin() * 1.0).to(x.dtype)


class TensorScale(Rotary517):
    """cos scaled by a tensor, not a number."""

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.inv_freq[0]).to(x.dtype), (emb.sin() * 1.0).to(x.dtype)


@pytest.mark.parametrize("module,why", [(Leaky, "not read by exactly one cos and one sin"),
                                        (OtherProduct, "not position_ids x inv_freq"),
                                        (TensorScale, "scaled by one number")])
def test_refusals_keep_hfs_ops(module, why):
    c, got, want = _run(Holder(module()))
    assert c.matched("rope_cos_sin") == 0
    assert why in c.unfused("rope_cos_sin")[0], c.unfused("rope_cos_sin")
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)
