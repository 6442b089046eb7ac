"""Smoke test of benchmarks/bench_lowprec_kernels.py on CPU: every format is checked, timed and written;
and a negative control: its bit check refuses a wrong update. No speed assertions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lowprec_kernels.py"
FORMATS = ("fp32", "bf16", "bf16 SR", "8-bit")  # written out: dropping one from the benchmark fails here


def test_runs_checks_and_writes_every_format(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--sizes", "64K", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    rows = json.loads((tmp_path / "lowprec_kernels.json").read_text())["rows"]
    found = {(r["layout"], r["contender"]): r for r in rows}
    for layout in ("flat", "list"):
        assert any(c.startswith("torch") for lay, c in found if lay == layout)
        for fmt in FORMATS:
            row = found[(layout, f"distopt {fmt}")]
            assert row["median_ms"] > 0 and row["vs_torch"] > 0
            if "SR" not in fmt:  # round to nearest: checked against the fp32 op on this CPU too
                assert row["check"] == "= fp32 op between exact reads/stores", row


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("bench_lowprec_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("fmt", ["bf16", "8-bit"])
def test_check_refuses_a_wrong_update(bench, fmt: str, monkeypatch) -> None:
    torch.manual_seed(0)
    sizes = [1000, 300]
    params, grads = [torch.randn(n) for n in sizes], [torch.randn(n) for n in sizes]
    m, v = [torch.randn(n) * 0.1 for n in sizes], [torch.rand(n) * 0.01 for n in sizes]
    s = bench.Moments(fmt, params, grads, m, v)
    assert bench.check(s).startswith("=")  # the real step passes

    right = bench.Moments.step

    def wrong(self) -> None:  # a subtly wrong kernel: one param element one ulp off
        right(self)
        self.params[1][7] = torch.nextafter(self.params[1][7], torch.tensor(1e9))

    monkeypatch.setattr(bench.Moments, "step", wrong)
    with pytest.raises(AssertionError, match="differs"):
        bench.check(s)


def test_target_verdicts(bench) -> None:
    """Each issue-31 target is reported met or MISSED from the 64M flat rows; a failed check is not a time."""

    def row(contender: str, vs_fp32: float, check: str = "= CPU kernel bits", numel: int = 64 << 20) -> object:
        return bench.Row("flat", numel, 1, contender, 1.0, 1.0, 1.0, 1.0, 1.0, vs_fp32, check)

    rows = [row("distopt 8-bit", 1.31), row("distopt bf16", 1.2), row("distopt bf16 SR", 2.0, "FAILED: differs"),
            row("distopt bf16 SR", 9.0, numel=16 << 20)]  # fmt: skip
    got = bench.target_verdicts(rows)
    assert got == [
        "target 8-bit >= 1.3x: 1.31x the fp32-moment update: met",
        "target bf16 >= 1.25x: 1.20x the fp32-moment update: MISSED",
        "target bf16 SR >= 1.1x: not timed: FAILED: differs",
    ]
    assert bench.target_verdicts([])[0].endswith("not measured (no 64M flat row in this run)")
