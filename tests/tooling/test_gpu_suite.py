"""benchmarks/gpu_suite.sh, without a GPU: what would fail it for a reason visible here.

The suite runs once per lent GPU, with no second chance, so its shell must parse and its sanitizer
workload (an inline Python program) must call the ops as they are today. The workload runs here on the
CPU kernels with its device swapped, so a renamed argument or a moved import fails here, not there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.sh"


def test_the_suite_parses() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(SUITE)], check=True)


def sanitizer_workload() -> str:
    m = re.search(r"read -r -d '' SANITIZER_PY <<'EOF'\n(.*?)\nEOF\n", SUITE.read_text(), re.S)
    assert m, "the SANITIZER_PY heredoc moved: update this test"
    return m.group(1)


@pytest.mark.parametrize("args", [[], ["shared"]], ids=["memcheck", "racecheck"])
def test_sanitizer_workload_runs_on_the_cpu_kernels(tmp_path: Path, args: list[str]) -> None:
    source = sanitizer_workload()
    swaps = {'device="cuda"': 'device="cpu"', 'ops.has_kernel(op, "cuda")': 'ops.has_kernel(op, "cpu")',
             "torch.cuda.synchronize()": "pass"}  # fmt: skip
    for old, new in swaps.items():
        assert old in source, old
        source = source.replace(old, new)
    assert '"cuda"' not in source and "torch.cuda" not in source, "a GPU call the swaps above miss"
    script = tmp_path / "workload.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sanitizer workload done" in proc.stdout
