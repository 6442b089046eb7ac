"""distopt's import contracts (pyproject.toml's [tool.importlinter]): no import cycle anywhere in distopt,
each package's layers one way, and only ops' pure-PyTorch fallback importing the test oracle
(distopt/reference.py), checked by import-linter's ``lint-imports`` over the source tree. Every import
counts: top level, under TYPE_CHECKING, inside a function.

Negative controls: in a copy of the package, a deliberate cycle (closed through a TYPE_CHECKING import,
or an import inside a function) and a production import of reference.py each make lint-imports fail.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports() -> str:
    """The lint-imports of this interpreter's environment (or on PATH); the tests skip without one."""
    beside = Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is not installed (pip install import-linter)")
    return found


def lint(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    """lint-imports over the package at `root`, with `root`'s pyproject.toml (`contracts`: only those).
    lint-imports puts its working directory first on sys.path, so it reads `root`'s distopt, not an
    installed one; no cache, so nothing is written there."""
    args = [_lint_imports(), "--no-cache", "--no-logo", *(f"--contract={c}" for c in contracts)]
    return subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=120)


def test_the_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "acyclic" not in result.stderr, result.stdout


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of distopt's Python sources and of pyproject.toml (the contracts)."""
    shutil.copytree(ROOT / "distopt", tmp_path / "distopt", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint(tmp_path).returncode == 0  # the copy passes as the tree does
    return tmp_path


# comm.py is imported by nearly all of distributed/, optimizer.py by nothing there: an import back closes cycles.
CYCLES = {
    "type_checking": ("\nfrom typing import TYPE_CHECKING\n\n"
                      "if TYPE_CHECKING:\n    from .optimizer import DistributedFusedAdam\n"),
    "in_function": ("\n\ndef _deliberate_cycle():\n    from .optimizer import DistributedFusedAdam\n\n"
                    "    return DistributedFusedAdam\n"),
}


@pytest.mark.parametrize("how", CYCLES)
def test_negative_control_a_cycle_fails(copy: Path, how: str):
    with open(copy / "distopt/distributed/comm.py", "a") as f:
        f.write(CYCLES[how])
    result = lint(copy, "acyclic")  # the no-cycles contract alone catches it
    assert result.returncode == 1 and "BROKEN" in result.stdout, result.stdout + result.stderr
    assert "No cycles are allowed in distopt.distributed" in result.stdout and ".comm -> .optimizer" in result.stdout
    assert lint(copy).returncode == 1  # and the full run fails (the layers contract too)


def test_negative_control_a_production_import_of_the_oracle_fails(copy: Path):
    with open(copy / "distopt/distributed/buckets.py", "a") as f:
        f.write("\n\ndef _oracle():\n    from ..reference import join_bf16_remainder\n\n"
                "    return join_bf16_remainder\n")
    result = lint(copy, "reference")
    assert result.returncode == 1 and "distopt.distributed.buckets -> distopt.reference" in result.stdout, (
        result.stdout + result.stderr)
