import os
import re

import pytest

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


def _graph_files(names):
    return sorted(n for n in names if n.startswith("graph"))


def test_explain_into_a_used_directory_starts_over_and_keeps_other_files(tmp_path):
    model = gemma4opt.optimize(tiny())
    (tmp_path / "notes.txt").write_text("mine")
    first = gemma4opt.explain(model, str(tmp_path))
    first_names = [os.path.basename(f) for f in first]
    captured = open(tmp_path / "graph00_00_captured.py").read()
    depyf_first = sorted(n for n in first_names if not n.startswith("graph"))

    second = gemma4opt.explain(model, str(tmp_path))         # same model, same directory
    names = [os.path.basename(f) for f in second]
    assert _graph_files(names) == _graph_files(first_names)  # numbered from graph00 again, no graph02
    assert open(tmp_path / "graph00_00_captured.py").read() == captured
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert on_disk == sorted(names + ["notes.txt", ".gemma4opt_explain_files"])  # the first run's files are gone
    # depyf's own files start over too: same names but for Dynamo's process-wide __compiled_fn_N
    # counter and a uuid (before, a reused directory got full_code_..._1.py, __transformed_code_2_...)
    strip = lambda n: re.sub(r"__compiled_fn_\d+|[0-9a-f]{8}(_[0-9a-f]{4}){3}_[0-9a-f]{12}", "", n)  # noqa: E731
    assert sorted(map(strip, names)) == sorted(map(strip, depyf_first + _graph_files(first_names)))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert "notes.txt" not in first_names                  # only what explain wrote is returned
    assert gemma4opt.report(model, print_table=False).row("rms_norm").complete

    other = gemma4opt.optimize(tiny())                     # another model into a fresh directory
    fresh = tmp_path / "fresh"
    names = [os.path.basename(f) for f in gemma4opt.explain(other, str(fresh))]
    assert _graph_files(names) == _graph_files(first_names)


def test_explain_refuses_output_files_it_did_not_record(tmp_path):
    model = gemma4opt.optimize(tiny())
    (tmp_path / "graph00_00_captured.py").write_text("from an older run")
    with pytest.raises(FileExistsError, match=re.escape(str(tmp_path)) + ".*delete them or pass an empty"):
        gemma4opt.explain(model, str(tmp_path))
    assert (tmp_path / "graph00_00_captured.py").read_text() == "from an older run"
