"""The SIMT emulator's controls (controls.cpp) as a fixture, for test_simt.py and test_shared_wavefronts.py."""

from __future__ import annotations

import pytest
from simt_controls import Controls, build_controls


@pytest.fixture(scope="session")
def controls() -> Controls:
    return build_controls()
