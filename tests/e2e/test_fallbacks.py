"""What the passes do not cover runs HF's path, warns, and shows in the report — never a wrong result."""
import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import greedy, prompt, tiny


def test_output_attentions_falls_back():
    model = tiny()
    ids = prompt(1, 9)
    with torch.no_grad():
        want = model(ids, output_attentions=True)
        gemma4opt.optimize(model)
        with pytest.warns(UserWarning, match="output_attentions"):
            got = model(ids, output_attentions=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert got.attentions is not None
    rep = gemma4opt.report(model, print_table=False)
    assert rep.fallbacks == {"output_attentions requested": 1} and rep.compiled_calls == 0


def test_training_mode_falls_back_and_backprop_works():
    model = tiny()
    gemma4opt.optimize(model)
    model.train()
    ids = prompt(1, 6)
    with pytest.warns(UserWarning, match="training mode"):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
    assert gemma4opt.report(model, print_table=False).fallbacks == {"training mode": 1}


def test_unrecognized_config_disables_and_reports():
    model = tiny()
    model.config.model_type = "gemma4_experimental"
    with pytest.warns(UserWarning, match="unfused path"):
        gemma4opt.optimize(model)
    rep = gemma4opt.report(model, print_table=False)
    assert "gemma4_experimental" in rep.disabled_reason and rep.rows == []
    with torch.no_grad():
        model(prompt(1, 4))
    assert "NOT OPTIMIZED" in str(rep)


def test_a_model_dispatched_by_accelerate_runs_hfs_path_with_hfs_tokens():
    """A device_map over several devices or with offloading hooks modules (accelerate): before, the
    fused graph met those hooks at the first call and Dynamo stopped with an unrelated error."""
    from accelerate import cpu_offload

    model, ids = tiny(), prompt(1, 9)
    want = greedy(model, ids, new=4)
    cpu_offload(model, execution_device=torch.device("cpu"))        # weights on meta, loaded per call
    with pytest.warns(UserWarning, match="dispatched by accelerate .*hooks on .* modules.*unfused path"):
        gemma4opt.optimize(model)
    assert torch.equal(greedy(model, ids, new=4), want)
    rep = gemma4opt.report(model, print_table=False)
    assert "dispatched by accelerate" in rep.disabled_reason and rep.compiled_calls == 0


def test_a_model_on_several_devices_runs_hfs_path():
    model = tiny()
    model.model.layers[1].to("meta")
    with pytest.warns(UserWarning, match=r"several devices \(cpu, meta\)"):
        gemma4opt.optimize(model)
    assert "several devices" in gemma4opt.report(model, print_table=False).disabled_reason
    assert model.forward == type(model).forward.__get__(model)      # HF's forward, not wrapped


def test_other_models_raise_type_error_naming_class():
    with pytest.raises(TypeError, match=r"Linear.*supported: transformers Gemma4ForCausalLM"):
        gemma4opt.optimize(torch.nn.Linear(2, 2))


def test_unsupported_dtype_raises():
    model = tiny().to(torch.float64)
    with pytest.raises(TypeError, match="float64"):
        gemma4opt.optimize(model)


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="unknown pattern"):
        Gemma4OptConfig(patterns=("nope",))
    with pytest.raises(ValueError, match="cache"):
        Gemma4OptConfig(cache="paged-ish")
    with pytest.raises(ValueError, match="CUDA"):
        Gemma4OptConfig(cuda_graphs=True).resolve("cpu")


def test_patterns_can_be_disabled():
    model = tiny()
    ids = prompt(1, 7)
    with torch.no_grad():
        want = model(ids).logits
        gemma4opt.optimize(model, Gemma4OptConfig(patterns=()))
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert gemma4opt.report(model, print_table=False).rows == []


def test_only_this_instance_is_changed():
    a, b = tiny(), tiny()
    gemma4opt.optimize(a)
    assert "forward" in vars(a) and "forward" not in vars(b)
    assert type(a) is type(b)


def test_cpu_path_never_imports_flashinfer():
    """flashinfer is the optional [gpu] extra: optimize, generate (HF and paged attention) and
    report on the CPU run without importing it (a fresh interpreter, so nothing else did)."""
    import subprocess
    import sys

    code = """
import sys
tried = []


class Spy:          # sees every import attempt, also one whose ImportError is caught
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "flashinfer":
            tried.append(name)


sys.meta_path.insert(0, Spy())
import torch, gemma4opt
from tests.models import prompt, tiny
for cfg in (None, gemma4opt.Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=64, max_batch_size=2)):
    model = gemma4opt.optimize(tiny(), cfg)
    with torch.no_grad():
        model.generate(prompt(2, 6), max_new_tokens=3, do_sample=False)
    gemma4opt.report(model, print_table=False)
print(bool(tried) or "flashinfer" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
