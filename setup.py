"""The package list, discovered (everything else is in pyproject.toml).

Every package under gemma4opt/, plus patterns/ installed as gemma4opt.patterns (pyproject.toml's
package-dir maps it). pyproject.toml alone cannot combine discovery with a package that lives in
another directory, and the hand-kept list it had left gemma4opt.attention and gemma4opt.runtime
out of the wheel. tests/test_wheel.py builds and installs the wheel."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

# A set: a developer's gemma4opt/patterns -> ../patterns symlink makes the first find see it too.
packages = set(find_packages(HERE, include=["gemma4opt", "gemma4opt.*"]))
packages |= {"gemma4opt.patterns"}
packages |= {f"gemma4opt.patterns.{p}" for p in find_packages(os.path.join(HERE, "patterns"))}

setup(packages=sorted(packages))
