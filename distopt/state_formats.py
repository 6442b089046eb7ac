"""Moved to ``distopt.lowprec.codecs``; this name stays importable (ops' docstring and user code use it).

The old name is the new module itself rather than a copy of its names, so that code patching a name
here (the kernel tests' negative control replaces ``_map``) patches what the codecs read."""

import sys

from .lowprec import codecs

sys.modules[__name__] = codecs
