"""Logging, configured once, keeps working when the program's stderr is swapped."""

from __future__ import annotations

import io
import sys

import pytest
import structlog

from gpusched.libs.common.logging import configure_logging


def test_a_log_line_goes_to_the_current_stderr_even_after_the_old_one_was_closed(
    monkeypatch: pytest.MonkeyPatch,
):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging(json=True)
    log = structlog.get_logger("test")
    log.info("first line")
    first.close()  # as a test runner does with the stderr it lent
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    log.info("second line", job_id="j1")
    # JSON lines unless an earlier configuration chose the console format
    assert "second line" in second.getvalue()
    assert "j1" in second.getvalue()
