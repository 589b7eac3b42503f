"""report(model): wording that matches what runs on the model's device, and byte sizes by unit."""
import pytest

import gemma4opt
from gemma4opt.api import get_state
from gemma4opt.ops.state import OpState
from gemma4opt.report import PatternRow, _decode_experts, _decode_gemms, format_bytes
from tests.models import tiny


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1, "1 B"), (512, "512 B"), (1023, "1023 B"), (1023.6, "1.0 KiB"), (1024, "1.0 KiB"),
    (1536, "1.5 KiB"), (12.3 * 2**20, "12.3 MiB"), (2**20 - 1, "1.0 MiB"), (2 * 2**30, "2.0 GiB"),
    (3000 * 2**30, "3000.0 GiB"),
])
def test_format_bytes_picks_the_unit_by_size(n, text):
    assert format_bytes(n) == text


def _seed_cuda_picks(state: OpState) -> OpState:
    """Picks as a model's CUDA decode steps would have left them in its op state."""
    state.shapes["linear"].chosen.update({(1, 8, 4, None, 0): True, (8, 8, 4, None, 0): False})
    state.shapes["linear_softcap"].chosen.update({(1, 128, 64, None, 0): True})
    state.shapes["moe_experts"].chosen.update({(1, 8, 128, 1408, 2816, None, 0): True})
    return state


@pytest.mark.parametrize("variant", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("picks", [False, True])
def test_cpu_report_names_the_reference_ops_not_cublas_or_timings(variant, picks):
    model = gemma4opt.optimize(tiny(variant))
    if picks:
        _seed_cuda_picks(get_state(model).op_state)
    rep = gemma4opt.report(model, print_table=False)
    assert rep.decode_gemms.startswith("reference ops (CPU): F.linear")
    assert "per-shape GEMM picks apply on CUDA only" in rep.decode_gemms
    if variant == "tiny-moe":
        assert rep.decode_experts == ("reference ops (CPU): HF's experts path; "
                                      "per-shape decode-kernel picks apply on CUDA only")
    text = str(rep)
    assert "decode GEMMs (gemma4opt.linear): reference ops (CPU)" in text
    for word in ("cuBLAS", "timed", "Triton"):
        assert word not in text, text


def test_cuda_wording_is_kept():
    state = _seed_cuda_picks(OpState())
    assert _decode_gemms("cuda", state).startswith("the skinny Triton GEMM on 1 of 2 shapes timed (rows [1, 8]), "
                                                   "cuBLAS on the rest")
    assert _decode_experts("cuda", state).startswith("gemma4opt's decode kernels on 1 of 1 shapes timed")
    assert _decode_gemms("meta", state).startswith("reference ops (META)")


def test_sites_left_by_design_come_off_each_graphs_expected_count():
    """A pattern row whose graphs left some sites by design (not applicable): complete when each graph
    matched the formula less its own such sites; the table shows one count where the graphs agree,
    else each graph's in graph order, as the matched column does."""
    why = "a FineGrainedFP8 checkpoint's projection"
    row = PatternRow("p", "", None, [5, 3], 9, [], [4, 6], [why])
    assert row.expected_per_graph() == [5, 3] and row.complete
    assert not PatternRow("p", "", None, [5, 5], 9, [], [4, 6], [why]).complete
    assert PatternRow("p", "", 9, [9], 9, []).complete             # none left by design
    rep = gemma4opt.report(gemma4opt.optimize(tiny("tiny")), print_table=False)
    rep.rows = [row]
    lines = str(rep).splitlines()
    assert lines[-2].split() == ["p", "5/3", "5/3", "ok"]
    assert lines[-1].strip() == f"not applicable at 4/6 of its 9 sites: {why}"
