"""The model x feature matrix's video rows (slow: CI runs them beside test_matrix.py's image rows,
on the other worker)."""

from __future__ import annotations

import pytest
from conftest import patience
from test_matrix import VIDEO_ROWS, run_rows

RUNS_LONG = 7  # minutes of its tests (CI's figures, 2 workers): started first (conftest.py)


@pytest.mark.slow
@pytest.mark.timeout(patience(600))  # about 7 minutes on CI's machine; a hung cell fails at its peers' --timeout, and the rest run
def test_every_video_preset_with_every_feature(tmp_path):
    run_rows(VIDEO_ROWS, tmp_path)
