"""Fixtures of the replay tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import REAL_TRACE


@pytest.fixture
def real_trace() -> Path:
    assert REAL_TRACE.is_file(), f"the shared trace is missing: {REAL_TRACE}"
    return REAL_TRACE
