import os

import gemma4opt
from tests.models import tiny


def test_explain_writes_graphs_before_and_after_each_pass(tmp_path):
    model = gemma4opt.optimize(tiny())
    files = gemma4opt.explain(model, str(tmp_path))
    names = [os.path.basename(f) for f in files]
    assert "graph00_00_captured.py" in names and "graph00_01_after_rms_norm.py" in names
    before = open(tmp_path / "graph00_00_captured.py").read()
    after = open(tmp_path / "graph00_01_after_rms_norm.py").read()
    assert "torch.pow" in before and "gemma4opt.rms_norm" not in before
    assert "gemma4opt.rms_norm" in after
    assert any(n.startswith("full_code") or n.startswith("__compiled_fn") for n in names), names  # depyf output
    assert gemma4opt.report(model, print_table=False).row("rms_norm").complete
