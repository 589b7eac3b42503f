"""The package as pip installs it from a wheel (not editable): built from the checkout, installed
into a fresh virtual environment, imported from outside the checkout, then optimize + greedy
generate on the tiny preset. CI installs editable, so only this test sees a package the wheel
leaves out (a subpackage missing from pyproject.toml's packages made `import gemma4opt` fail).

Offline: the wheel is built with the setuptools already installed (no build isolation, no
index), installed with --no-deps; the venv takes torch/transformers from the system python."""
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

# The [test] extra (scripts/setup.sh) installs setuptools >= 70.1, so CI never skips these.
if importlib.util.find_spec("setuptools") is None:
    pytest.skip("setuptools is not installed: cannot build the wheel", allow_module_level=True)
if (importlib.util.find_spec("setuptools.command.bdist_wheel") is None
        and importlib.util.find_spec("wheel") is None):   # setuptools < 70.1 builds wheels with `wheel`
    pytest.skip("neither setuptools' bdist_wheel nor the wheel package is installed",
                allow_module_level=True)

# Copied into the build tree: what a clean clone has, less VCS/build leftovers and symlinks (a
# developer's untracked gemma4opt/patterns -> ../patterns link would hide a missing mapping).
_SKIP = {".git", "__pycache__", "build", "dist", ".pytest_cache", "explain_out", "tests",
         "benchmarks", "examples"}


def _ignore(src, names):
    return {n for n in names
            if n in _SKIP or n.endswith(".egg-info") or os.path.islink(os.path.join(src, n))}


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    shown = " ".join(str(c) for c in cmd if "\n" not in str(c))   # the -c script is left out
    assert r.returncode == 0, f"{shown} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def _build_wheel(src, out):
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(out), str(src)], cwd=out.parent)
    (whl,) = out.glob("gemma4opt-*.whl")
    return whl


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory):
    src = tmp_path_factory.mktemp("wheel") / "src"
    shutil.copytree(REPO, src, ignore=_ignore)
    return src


@pytest.fixture(scope="module")
def wheel(source_tree):
    """What `pip install .` builds and installs."""
    return _build_wheel(source_tree, source_tree.parent / "dist")


def _source_files():
    """Every file of the package on disk, as its path inside the wheel (patterns/ is installed
    as gemma4opt/patterns)."""
    want = set()
    for root, prefix in ((REPO / "gemma4opt", "gemma4opt"), (REPO / "patterns", "gemma4opt/patterns")):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames
                           if d != "__pycache__" and not os.path.islink(os.path.join(dirpath, d))]
            for f in filenames:
                if f.endswith((".pyc", ".pyo")):
                    continue
                rel = Path(dirpath, f).relative_to(root).as_posix()
                want.add(f"{prefix}/{rel}")
    return want


def _check_wheel_files(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"the wheel leaves out: {missing}"
    # Every package directory is a package (an __init__.py), so nothing is a namespace by accident.
    inits = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    dirs = {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}
    assert dirs <= inits, f"directories without __init__.py: {sorted(dirs - inits)}"
    assert not any(n.startswith(("tests/", "patterns/", "benchmarks/")) for n in names)


def test_wheel_holds_every_package_file(wheel):
    _check_wheel_files(wheel)


def test_sdist_builds_a_complete_wheel(source_tree, tmp_path):
    """The sdist carries everything its wheel needs (setup.py, patterns/): sdist -> wheel, as pip
    does for a source distribution."""
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
          "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "sdist")], cwd=source_tree)
    (sdist,) = (tmp_path / "sdist").glob("gemma4opt-*.tar.gz")
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", **safe)
    (root,) = (tmp_path / "unpacked").iterdir()
    _check_wheel_files(_build_wheel(root, tmp_path / "dist"))


_CHECK = r"""
import copy, os, sys
# The system site-packages may hold an editable install of gemma4opt (setup.sh's `pip install -e`):
# its finder, last on sys.meta_path, would serve any subpackage the wheel lacks from that
# checkout. A machine with only the wheel has none: drop it.
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
import torch
import gemma4opt
from gemma4opt.presets import build_model
print(gemma4opt.__file__)
model = build_model("tiny")
ref = copy.deepcopy(model)
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, 128, (1, 9), generator=g)
assert gemma4opt.optimize(model) is model
with torch.no_grad():
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    got = model.generate(ids, max_new_tokens=6, do_sample=False)
assert torch.equal(got, want), (got, want)
rep = gemma4opt.report(model, print_table=False)
assert rep.compiled_calls > 0 and all(r.complete for r in rep.rows), str(rep)
root = os.path.dirname(gemma4opt.__file__)
stray = {n: m.__file__ for n, m in list(sys.modules.items())
         if n.split(".")[0] == "gemma4opt" and getattr(m, "__file__", None)
         and not os.path.realpath(m.__file__).startswith(os.path.realpath(root) + os.sep)}
assert not stray, f"gemma4opt modules imported from outside the installed package: {stray}"
print("OK")
"""


def test_wheel_installs_imports_and_generates(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # The venv has no pip of its own: the system's pip (seen through --system-site-packages)
    # installs into the venv it runs in. --ignore-installed: the system's own gemma4opt (an
    # editable install of some checkout) is left alone, not taken as already satisfying this.
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
          str(wheel)], cwd=tmp_path)
    out = _run([str(py), "-c", _CHECK], cwd=tmp_path).stdout.split()
    assert out[-1] == "OK"
    installed = Path(out[0]).resolve()
    assert installed.is_relative_to(venv.resolve()), f"imported {installed}, not the venv's wheel"
    assert not installed.is_relative_to(REPO), installed
