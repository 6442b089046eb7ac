"""How much Python a call runs: the tests that hold a steady-state step to no Python work per param."""

from __future__ import annotations

import sys
from collections.abc import Callable


def python_calls(fn: Callable[[], object]) -> int:
    """The number of Python function calls (``sys.setprofile``'s "call" events) that ``fn()`` makes."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls
