"""Moved to ``distopt.distributed.checkpoint.atomic_replace``; this name stays importable (integrations
and user code write files crash-consistently through it)."""

from .checkpoint.atomic_replace import *  # noqa: F403
