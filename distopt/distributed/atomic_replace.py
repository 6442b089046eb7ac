"""Moved to ``distopt.distributed.checkpoint.atomic_replace``; this name stays importable (integrations
and user code write files crash-consistently through it).

The old name is the new module itself rather than a copy of its names, so that code patching a name
here (a test that makes a save fail) patches what ``checkpoint.save`` calls."""

import sys

from .checkpoint import atomic_replace

sys.modules[__name__] = atomic_replace
