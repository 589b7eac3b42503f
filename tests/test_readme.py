"""The README's generated parts cannot go stale: its sample report is scripts/sample_report.py's
output, docs/results.md is what benchmarks/results_page.py writes from benchmarks/results/, and
every figure of the README's results table is in its run's section of docs/results.md."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _between(text, start, end):
    assert start in text and end in text, f"README lost its {start} ... {end} markers"
    return text.split(start, 1)[1].split(end, 1)[0]


def test_readme_sample_report_is_the_scripts_output():
    env = dict(os.environ, GEMMA4OPT_PROGRESS="0")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sample_report.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    block = _between(_readme(), "<!-- sample-report -->", "<!-- /sample-report -->")
    block = block.strip().removeprefix("```").removesuffix("```").strip("\n")
    assert block == out.stdout.rstrip("\n"), "README's sample report is stale: paste `python scripts/sample_report.py`"


def test_results_page_is_generated_from_the_results_files():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import results_page

    with open(results_page.PAGE) as f:
        assert f.read() == results_page.render(), "docs/results.md is stale: run python benchmarks/results_page.py"


def test_readme_results_table_figures_are_in_their_runs_section():
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        page = f.read()
    sections = {s.split("\n", 1)[0].strip(): s for s in page.split("\n### ")[1:]}
    table = _between(_readme(), "<!-- results-table", "<!-- /results-table -->")
    rows = [line for line in table.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    assert len(rows) >= 8
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        run, batch, figures = cells[-1], cells[1], cells[2:-1]
        assert run in sections, f"run {run} is not in docs/results.md"
        lines = [ln for ln in sections[run].splitlines() if ln.startswith(f"| {batch} |")]
        assert lines, (run, batch)
        for fig in figures:
            assert re.fullmatch(r"[\d.]+×?", fig), fig
            assert any(f"| {fig} |" in ln for ln in lines), f"{fig} (batch {batch}) not in run {run} of docs/results.md"
