"""Moved to ``distopt.lowprec.formats``; this name stays importable (``float32_state_dict`` is documented
here)."""

from .lowprec.formats import *  # noqa: F403
