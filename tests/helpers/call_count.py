"""How much Python a call runs: the tests that hold a steady-state step to no Python work per param."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable


def python_calls(fn: Callable[[], object]) -> int:
    """The number of Python function calls (``sys.setprofile``'s "call" events) that ``fn()`` makes.

    The garbage collector is off meanwhile: a collection that happens to fall inside ``fn`` runs the
    ``gc.callbacks`` other code registered (hypothesis adds one once any of its tests ran, and forked
    ranks inherit it), two calls that are not ``fn``'s."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    return calls
