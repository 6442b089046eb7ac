"""Moved to ``distopt.lowprec.formats``; this name stays importable (``float32_state_dict`` is documented
here).

The old name is the new module itself rather than a copy of its names, so that code patching a name
here patches what the optimizers read."""

import sys

from .lowprec import formats

sys.modules[__name__] = formats
