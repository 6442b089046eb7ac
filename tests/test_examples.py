"""The README's main job runs: 2 gloo ranks train with DistributedFusedAdam next to DDP + AdamW."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_train_example_runs_and_matches_ddp():
    result = subprocess.run([sys.executable, str(EXAMPLES / "train.py"), "--steps", "4", "--log-every", "1",
                             "--ranks", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "2 cpu rank(s) over gloo" in out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses)
    first, last = re.search(r"(\S+) after step 1, (\S+) after step 4", out).groups()
    assert float(first) < 1e-5 and float(last) < 1e-3, out
