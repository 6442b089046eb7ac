"""The main job survives a dead rank: under ``torchrun --max-restarts 2`` (as users run it, no special
environment), a worker SIGKILLed at a random step after the first checkpoint; torchrun restarts the
job, which resumes from its newest checkpoint and ends with the params digest of an uninterrupted
run: bit for bit (CPU, gloo, 2 ranks).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TRAIN = str(EXAMPLES / "train.py")
STEPS, EVERY = 16, 4
ARGS = ["--steps", str(STEPS), "--log-every", "1", "--val-every", "8", "--val-batches", "1", "--batch-size", "4",
        "--seq-len", "32", "--warmup", "1", "--dim", "32", "--layers", "1", "--heads", "2"]

sys.path.insert(0, str(EXAMPLES))
import resume  # noqa: E402  (examples/resume.py)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1"}


def digest_of(out: str) -> str:
    """The digest on the line before the verdict, which must be the last of the run's output."""
    lines = out.splitlines()
    verdict = max(i for i, line in enumerate(lines) if line.startswith(("PASS", "FAIL")))
    m = re.fullmatch(r"params digest: ([0-9a-f]{64})", lines[verdict - 1])
    assert m, lines[verdict - 1]
    return m.group(1)


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    result = subprocess.run([sys.executable, TRAIN, *ARGS, "--ranks", "2"], capture_output=True, text=True,
                            timeout=300, env=environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return digest_of(result.stdout)


def workers(parent: int) -> list[int]:
    """torchrun's workers: the processes whose parent is `parent` and that run train.py."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            running_train = b"train.py" in Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if ppid == parent and running_train:
            found.append(int(entry))
    return sorted(found)


def killed_and_restarted(directory: Path, seed: int) -> tuple[str, int]:
    """Runs the job under torchrun; at a random step after the first checkpoint, SIGKILLs a random
    worker. Returns the whole output and the step at which the worker was killed."""
    rng = random.Random(seed)
    kill_after = rng.randint(EVERY + 1, STEPS - 2)  # the row of this step was printed
    delay = rng.uniform(0, 0.05)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "2", TRAIN, *ARGS, "--checkpoint-dir", str(directory), "--checkpoint-every", str(EVERY)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
    out, killed = [], None
    deadline = time.monotonic() + 300
    try:
        for line in job.stdout:
            out.append(line)
            row = re.match(r"^\s+(\d+)\s+\d+\.\d+", line)
            if killed is None and row and int(row.group(1)) == kill_after:
                time.sleep(delay)
                pids = workers(job.pid)
                assert len(pids) == 2, pids
                os.kill(rng.choice(pids), signal.SIGKILL)
                killed = kill_after
            assert time.monotonic() < deadline, "".join(out)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(out)
    assert job.returncode == 0, text[-5000:]
    assert killed is not None, text[-3000:]
    return text, killed


def check_resumed(text: str, killed: int, uninterrupted: str) -> None:
    resumed = re.findall(r"^resumed from .*step-(\d+): steps (\d+) to", text, re.MULTILINE)
    assert len(resumed) == 1, text[-5000:]
    assert int(resumed[0][0]) <= killed and int(resumed[0][0]) % EVERY == 0, (resumed, killed)
    assert digest_of(text) == uninterrupted, text[-3000:]


def test_a_rank_killed_under_torchrun_resumes_bit_for_bit(tmp_path, uninterrupted):
    text, killed = killed_and_restarted(tmp_path / "ckpt", seed=0)
    check_resumed(text, killed, uninterrupted)
    # The two newest checkpoints (saved before the last step), each a link and the version it names.
    listing = sorted(os.listdir(tmp_path / "ckpt"))
    assert [n for n in listing if "." not in n] == ["step-12", "step-8"], listing
    assert len(listing) == 4 and all(n.startswith(("step-12.v-", "step-8.v-")) for n in listing if "." in n), listing


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_a_rank_killed_under_torchrun_resumes_bit_for_bit_more_seeds(long_version, tmp_path, uninterrupted, seed):
    text, killed = killed_and_restarted(tmp_path / "ckpt", seed)
    check_resumed(text, killed, uninterrupted)


def test_the_digest_tells_one_ulp_apart():
    """The comparison's negative control: one param one ulp off gives another digest."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    before = resume.params_digest([model])
    assert resume.params_digest([model]) == before
    with torch.no_grad():
        model.weight[1, 2] = torch.nextafter(model.weight[1, 2], torch.tensor(float("inf")))
    assert resume.params_digest([model]) != before


TINY = ["--steps", "3", "--log-every", "1", "--val-every", "3", "--val-batches", "1", "--batch-size", "2",
        "--seq-len", "16", "--warmup", "1", "--dim", "16", "--layers", "1", "--heads", "2", "--ranks", "2"]


def run_job(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, *TINY, *args], capture_output=True, text=True, timeout=300,
                          env=environment())


def test_resume_refuses_other_settings_and_never_trains_over_unreadable_checkpoints(tmp_path):
    directory = str(tmp_path / "ckpt")
    first = run_job("--checkpoint-dir", directory, "--checkpoint-every", "1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert sorted(n for n in os.listdir(directory) if "." not in n) == ["step-1", "step-2"]
    other = run_job("--checkpoint-dir", directory, "--lr", "0.01", "--ranks", "1")
    assert other.returncode != 0, other.stdout[-3000:]
    assert "saved by a run with --lr 0.003 (now 0.01), 2 ranks (now 1)" in other.stderr, other.stderr[-3000:]
    for name in ("step-1", "step-2"):  # damage both: every data file loses its last byte
        for data in (tmp_path / "ckpt" / name).glob("*.distcp"):
            data.write_bytes(data.read_bytes()[:-1])
    damaged = run_job("--checkpoint-dir", directory)
    assert damaged.returncode != 0, damaged.stdout[-3000:]
    assert "resume: none of the checkpoints in" in damaged.stderr and "step-2 cannot be loaded" in damaged.stdout
    assert sorted(n for n in os.listdir(directory) if "." not in n) == ["step-1", "step-2"]  # left as they were
