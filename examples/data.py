"""Text every machine has: the Python standard library's own sources, as a byte-level corpus.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (third-party packages under
site-packages/dist-packages excluded), in sorted order, read as UTF-8 with undecodable bytes replaced
and encoded back to UTF-8: the tokens are the bytes that occur (ASCII Python source, plus the UTF-8
bytes of the few non-ASCII characters in comments, strings and tests). A file belongs to the
validation split when the CRC-32 of its path (relative to the stdlib) is 0 mod ``VAL_EVERY``: about
1/20 of the files, stable under additions and the same on every machine with the same Python.
Nothing is cached: reading and encoding the ~30 MB takes about a second.

Batches are deterministic: step ``s`` of a run draws ``batch_size`` window offsets from a generator
seeded with ``(seed, s)``, the same on every rank, and each rank takes its own contiguous slice of
those rows. The global batch, and so the loss curve, is the same whatever the world size.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

VAL_EVERY = 20
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's ``*.py`` files, sorted by their path relative to `root`."""
    root = root or stdlib_root()
    return sorted((p for p in root.rglob("*.py") if p.is_file() and not EXCLUDED_DIRS & set(p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).as_posix())


def is_validation(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % VAL_EVERY == 0


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 token ids (indices into `vocab`)
    val: torch.Tensor
    vocab: list[int]  # the byte values that occur, sorted: token id i is byte vocab[i]
    files: tuple[int, int]  # (train files, validation files)
    root: Path

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(self.vocab[i] for i in ids.tolist()).decode("utf-8", errors="replace")

    def describe(self) -> str:
        return (f"{self.files[0] + self.files[1]} .py files of the standard library under {self.root} "
                f"({(self.train.numel() + self.val.numel()) / 1e6:.1f}M bytes, {self.vocab_size}-byte vocabulary); "
                f"train {self.train.numel() / 1e6:.1f}M tokens from {self.files[0]} files, validation "
                f"{self.val.numel() / 1e6:.2f}M tokens from {self.files[1]} files")


def load_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in stdlib_sources(root):
        text = path.read_bytes().decode("utf-8", errors="replace")
        parts[is_validation(path.relative_to(root).as_posix())].append(text.encode("utf-8"))
    if not parts[False] or not parts[True]:
        raise RuntimeError(f"found too few .py files under {root} for a train/validation split")
    raw = {split: b"".join(chunks) for split, chunks in parts.items()}
    counts = sum(torch.bincount(torch.frombuffer(bytearray(b), dtype=torch.uint8).int(), minlength=256)
                 for b in raw.values())
    vocab = counts.nonzero().flatten().tolist()
    table = bytearray(256)  # byte value -> token id
    for i, byte in enumerate(vocab):
        table[byte] = i
    ids = {split: torch.frombuffer(bytearray(b.translate(table)), dtype=torch.uint8) for split, b in raw.items()}
    return Corpus(train=ids[False], val=ids[True], vocab=vocab,
                  files=(len(parts[False]), len(parts[True])), root=root)


def windows(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rows data[o : o + seq_len + 1] (inputs and next-token targets) as int64 token ids."""
    return data[offsets[:, None] + torch.arange(seq_len + 1)].long()


def train_batch(data: torch.Tensor, step: int, batch_size: int, seq_len: int, rank: int, world_size: int,
                seed: int = 0) -> torch.Tensor:
    """This rank's slice (batch_size // world_size rows) of step `step`'s global batch."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    offsets = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    per_rank = batch_size // world_size
    return windows(data, offsets[rank * per_rank:(rank + 1) * per_rank], seq_len)


def val_batches(data: torch.Tensor, n_batches: int, batch_size: int, seq_len: int, rank: int,
                world_size: int) -> list[torch.Tensor]:
    """A fixed validation set: n_batches * batch_size windows evenly spaced over the split, each
    rank its slice of every batch."""
    n = n_batches * batch_size
    offsets = torch.linspace(0, data.numel() - seq_len - 2, n).long().reshape(n_batches, batch_size)
    per_rank = batch_size // world_size
    return [windows(data, o[rank * per_rank:(rank + 1) * per_rank], seq_len) for o in offsets]
