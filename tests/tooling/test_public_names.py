"""The names users import keep working after the packages moved: the old paths are thin re-exports of
the new modules (the same objects), and the wheel ships every package."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import distopt
from distopt.distributed.checkpoint import atomic_replace as new_atomic_replace
from distopt.lowprec import codecs, formats

ROOT = Path(__file__).resolve().parents[2]


def public(module) -> dict:
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def test_top_level_names():
    assert {"BMUF", "DistributedFusedAdam", "FusedAdam", "ops"} <= set(distopt.__all__)
    from distopt.distributed import DistributedFusedAdam
    from distopt.fused_adam import FusedAdam

    assert distopt.DistributedFusedAdam is DistributedFusedAdam and distopt.FusedAdam is FusedAdam
    assert callable(distopt.ops.adam_step_)
    assert callable(importlib.import_module("distopt.testing").run_ranks)


def test_checkpoint_entrance():
    from distopt.distributed import checkpoint

    for name in ("save", "load", "sharded_state_dicts", "state_dict", "load_state_dict", "sharded_state_dict",
                 "ShardedParamState", "ShardedOptimizer", "FORMAT", "SHARDED_FORMAT", "STATE_KEYS"):
        assert hasattr(checkpoint, name), name


@pytest.mark.parametrize("old, new", [
    ("distopt.distributed.atomic_replace", new_atomic_replace),
    ("distopt.state_formats", codecs),
    ("distopt.moment_formats", formats),
])
def test_old_module_paths_re_export_the_new_modules(old, new):
    module = importlib.import_module(old)
    missing = [k for k, v in public(new).items() if getattr(module, k, None) is not v and not isinstance(v, type(sys))]
    assert missing == [], f"{old} lacks {missing} of {new.__name__}"


@pytest.mark.parametrize("old, new", [
    ("distopt.distributed.atomic_replace", new_atomic_replace),
    ("distopt.state_formats", codecs),
    ("distopt.moment_formats", formats),
])
def test_old_module_paths_are_the_new_modules(old, new, monkeypatch):
    """Patching a name under the old path reaches the code that uses it (as the kernel tests' negative
    controls patch ``distopt.state_formats._map``)."""
    module = importlib.import_module(old)
    assert module is new and sys.modules[old] is new
    parent, _, child = old.rpartition(".")
    assert getattr(importlib.import_module(parent), child) is new
    private = next(k for k, v in vars(new).items() if k.startswith("_") and callable(v) and not k.startswith("__"))
    sentinel = object()
    monkeypatch.setattr(module, private, sentinel)
    assert getattr(new, private) is sentinel


def test_documented_old_names():
    from distopt.distributed.atomic_replace import SaveFailed, replace_file, resolve
    from distopt.moment_formats import float32_state_dict
    from distopt.reference import join_bf16_remainder, split_bf16_remainder
    from distopt.state_formats import dequantize_blockwise, quantize_blockwise

    assert float32_state_dict is formats.float32_state_dict
    assert (quantize_blockwise, dequantize_blockwise) == (codecs.quantize_blockwise, codecs.dequantize_blockwise)
    assert (SaveFailed, replace_file, resolve) == (new_atomic_replace.SaveFailed, new_atomic_replace.replace_file,
                                                   new_atomic_replace.resolve)
    assert (join_bf16_remainder, split_bf16_remainder) == (codecs.join_bf16_remainder, codecs.split_bf16_remainder)


def test_every_package_is_in_the_wheel():
    """pyproject.toml's setuptools ``packages`` lists every package under distopt/ (the wheel holds only those)."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "distopt").rglob("__init__.py")}
    assert listed == found
