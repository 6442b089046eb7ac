"""The README's main job (examples/train.py): 2 gloo ranks train a byte-level GPT on the standard
library's sources with DistributedFusedAdam next to DDP + AdamW, and end with a verdict."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TRAIN = str(EXAMPLES / "train.py")
SMALL = ["--steps", "3", "--log-every", "1", "--val-every", "2", "--val-batches", "1", "--batch-size", "4",
         "--seq-len", "32", "--warmup", "1", "--ranks", "2"]

sys.path.insert(0, str(EXAMPLES))
import train  # noqa: E402  (examples/train.py)

import data  # noqa: E402  (examples/data.py)


def without_torchrun():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def test_train_example_runs_and_passes():
    result = subprocess.run([sys.executable, TRAIN, *SMALL], capture_output=True, text=True, timeout=300,
                            env=without_torchrun())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "2 cpu rank(s) over gloo" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    for _, ours, ref in rows:
        assert 0 < float(ours) < 10 and abs(float(ours) - float(ref)) < 1e-3, out
    assert re.search(r"time per step, median \(2 steps\)\s+[\d.]+ ms\s+[\d.]+ ms", out), out
    assert re.search(r"tokens/s.*\s[\d,]+\s+[\d,]+$", out, re.MULTILINE), out
    assert re.search(r"optimizer memory per rank\s+[\d.]+ MiB\s+[\d.]+ MiB", out), out
    verdict = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdict) == 1, out
    assert verdict[0].startswith("PASS: distopt's params agree with DDP+AdamW's: relative L2 difference"), out
    lines = out.splitlines()
    assert re.fullmatch(r"params digest: [0-9a-f]{64}", lines[lines.index(verdict[0]) - 1]), out


def test_train_example_with_offload_passes_and_reports_host_memory():
    result = subprocess.run([sys.executable, TRAIN, *SMALL, "--offload"], capture_output=True, text=True, timeout=300,
                            env=without_torchrun())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^PASS: ", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"distopt \(--offload\): [\d.]+ MiB of it in host memory, 0.00 MiB on the device", result.stdout)


def test_train_example_fails_with_exit_status_1_when_out_of_tolerance():
    # A tolerance no real run can meet: the verdict says FAIL and the exit status is non-zero.
    result = subprocess.run([sys.executable, TRAIN, *SMALL, "--steps", "1", "--tolerance-factor", "1e-30"],
                            capture_output=True, text=True, timeout=300, env=without_torchrun())
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^FAIL: ", result.stdout, re.MULTILINE), result.stdout


def test_help_shows_defaults():
    result = subprocess.run([sys.executable, TRAIN, "--help"], capture_output=True, text=True, timeout=120,
                            env=without_torchrun())
    assert result.returncode == 0, result.stderr
    for option in ("--steps", "--ranks", "--batch-size", "--seq-len", "--lr", "--clip", "--overlap-param-sync",
                   "--tolerance-factor", "--checkpoint-dir", "--checkpoint-every", "--collective-timeout"):
        assert option in result.stdout
    assert "(default: 120)" in result.stdout and "(default: 0.003)" in result.stdout


def test_ranks_is_refused_under_torchrun():
    env = {**without_torchrun(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    result = subprocess.run([sys.executable, TRAIN, "--ranks", "2"], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 2
    assert "--ranks does not apply under torchrun" in result.stderr, result.stderr


def test_checkpoint_and_timeout_options(monkeypatch, capsys):
    monkeypatch.setattr(train, "TORCHRUN", False)
    args = train.parse_args(["--checkpoint-dir", "ckpt", "--val-every", "7"])
    assert (args.checkpoint_every, args.collective_timeout) == (7, 300.0)  # the defaults
    for argv, message in ((["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
                          (["--checkpoint-dir", "c", "--checkpoint-every", "0"], "must be at least 1"),
                          (["--checkpoint-dir", "c", "--bmuf"], "not supported with --bmuf"),
                          (["--collective-timeout", "0"], "--collective-timeout must be positive")):
        with pytest.raises(SystemExit) as exc:
            train.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv


def test_batch_must_split_evenly_over_ranks(monkeypatch, capsys):
    monkeypatch.setattr(train, "TORCHRUN", False)
    assert train.parse_args(["--ranks", "4", "--batch-size", "8"]).world_size == 4
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--ranks", "2", "--batch-size", "5"])
    assert exc.value.code == 2 and "must be a multiple of the 2 ranks" in capsys.readouterr().err


# ------------------------------------------------------------------ examples/data.py


def test_rank_slices_make_up_the_global_batch():
    corpus = torch.arange(10_000) % 251
    whole = data.train_batch(corpus, 7, 8, 16, rank=0, world_size=1, seed=3)
    halves = [data.train_batch(corpus, 7, 8, 16, rank=r, world_size=2, seed=3) for r in range(2)]
    quarters = [data.train_batch(corpus, 7, 8, 16, rank=r, world_size=4, seed=3) for r in range(4)]
    assert whole.shape == (8, 17) and whole.dtype == torch.int64
    assert torch.equal(torch.cat(halves), whole) and torch.equal(torch.cat(quarters), whole)
    assert not torch.equal(data.train_batch(corpus, 8, 8, 16, 0, 1, seed=3), whole)  # another step
    assert ((whole[:, 1:] - whole[:, :-1]) % 251 == 1).all()  # each row is a contiguous window of the corpus
    val = data.val_batches(corpus, 2, 8, 16, rank=1, world_size=2)
    assert len(val) == 2 and val[0].shape == (4, 17)


def test_corpus_split_vocabulary_and_exclusions(tmp_path):
    files = {"a.py": "print('a')\n", "pkg/b.py": "x = 'é'\n", "pkg/bad.py": b"y = '\xff'\n",
             "site-packages/third.py": "ZZZ\n", "notes.txt": "QQQ\n"}
    for name in [f"m{i}.py" for i in range(40)]:
        files[name] = f"v = {name!r}\n"
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    sources = [p.relative_to(tmp_path).as_posix() for p in data.stdlib_sources(tmp_path)]
    assert sources == sorted(sources) and "site-packages/third.py" not in sources and "notes.txt" not in sources
    corpus = data.load_corpus(tmp_path)
    assert corpus.files[0] + corpus.files[1] == len(sources) and corpus.files[1] > 0
    text = corpus.decode(corpus.train) + corpus.decode(corpus.val)
    assert "Z" not in text and "Q" not in text  # excluded files contribute nothing
    assert "é" in text and "\ufffd" in text  # UTF-8 kept, undecodable bytes replaced
    assert corpus.vocab == sorted(set(text.encode()))
    assert torch.equal(data.load_corpus(tmp_path).train, corpus.train)  # deterministic


def test_the_real_stdlib_splits_about_one_file_in_twenty():
    root = data.stdlib_root()
    sources = [p.relative_to(root).as_posix() for p in data.stdlib_sources(root)]
    assert len(sources) > 100 and "os.py" in sources
    assert not any(part in ("site-packages", "dist-packages") for s in sources for part in s.split("/"))
    fraction = sum(map(data.is_validation, sources)) / len(sources)
    assert 0.02 < fraction < 0.1


def test_bmuf_mode_counts_what_it_all_reduces():
    result = subprocess.run([sys.executable, TRAIN, *SMALL, "--steps", "4", "--bmuf", "--sync-every", "2"],
                            capture_output=True, text=True, timeout=300, env=without_torchrun())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "distopt BMUF(FusedAdam) vs DDP + torch.optim.AdamW: 2 cpu rank(s) over gloo" in out
    counted = re.search(r"all-reduced per step and rank, counted\s+([\d.]+) KiB\s+([\d.]+) KiB", out)
    formula = re.search(r"^  formula\s+([\d.]+) KiB\s+([\d.]+) KiB", out, re.MULTILINE)
    assert counted and formula and counted.groups() == formula.groups(), out
    bmuf, ddp = map(float, counted.groups())
    assert 1.99 < ddp / bmuf <= 2.0, out  # every param (and a 64-byte check) once per 2 steps vs every grad every step
    assert re.search(r"^PASS: BMUF's final validation loss", out, re.MULTILINE), out


def test_low_precision_state_options(monkeypatch, capsys):
    import lowprec_mode

    monkeypatch.setattr(train, "TORCHRUN", False)
    args = train.parse_args([])
    assert not lowprec_mode.active(args) and lowprec_mode.optimizer_options(args) == {}  # the job unchanged
    args = train.parse_args(["--exp-avg-dtype", "uint8", "--exp-avg-sq-dtype", "bfloat16", "--stochastic-rounding"])
    assert lowprec_mode.optimizer_options(args) == dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16,
                                                        stochastic_rounding=True)
    lines = []
    assert lowprec_mode.verdict(lines.append, args, {"distopt": 2.03, "DDP": 2.0})
    assert not lowprec_mode.verdict(lines.append, args, {"distopt": 2.06, "DDP": 2.0})  # 0.06 > 0.05
    assert lines[1].startswith("PASS") and lines[3].startswith("FAIL"), lines
    for argv, message in ((["--exp-avg-dtype", "float16"], "invalid choice"),
                          (["--stochastic-rounding", "--offload"], "do not combine with --offload"),
                          (["--loss-tolerance", "0"], "--loss-tolerance must be positive")):
        with pytest.raises(SystemExit) as exc:
            train.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv


def test_train_example_with_8bit_state_passes_on_the_loss():
    import inspect

    from distopt import DistributedFusedAdam

    if "exp_avg_dtype" not in inspect.signature(DistributedFusedAdam).parameters:
        pytest.skip("this DistributedFusedAdam has no low-precision moments")
    result = subprocess.run([sys.executable, TRAIN, *SMALL, "--exp-avg-dtype", "uint8", "--exp-avg-sq-dtype", "uint8"],
                            capture_output=True, text=True, timeout=300, env=without_torchrun())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "distopt state: exp_avg uint8, exp_avg_sq uint8" in result.stdout
    assert re.search(r"PASS: distopt's final validation loss", result.stdout), result.stdout
