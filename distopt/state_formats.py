"""Moved to ``distopt.lowprec.codecs``; this name stays importable (ops' docstring and user code use it)."""

from .lowprec.codecs import *  # noqa: F403
