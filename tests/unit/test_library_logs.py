"""Other libraries' notices stay off the console and reach the run's log file; their errors still show."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.records import library_logs


@pytest.fixture
def console() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = library_logs.quiet_libraries(stream)
    try:
        yield stream
    finally:
        handler.detach()
        logging.getLogger().removeHandler(handler)


def test_a_library_notice_is_kept_off_the_console_and_written_once_a_log_is_attached(
        console: io.StringIO, tmp_path: Path) -> None:
    logging.getLogger("math_verify.grader").warning("Timeout is disabled as timeout_seconds is None")
    logging.getLogger("agentrl.driver_probe").warning("agentrl's own line")  # its own handler's, not ours
    assert console.getvalue() == ""
    log = tmp_path / "driver.log"
    assert library_logs.attach(log)
    logging.getLogger("some.library").warning("a later notice")
    library_logs.detach()
    text = log.read_text()
    assert "WARNING math_verify.grader: Timeout is disabled" in text
    assert "a later notice" in text and "agentrl's own line" not in text
    assert text.index("Timeout is disabled") < text.index("a later notice")


def test_a_library_error_still_reaches_the_console(console: io.StringIO) -> None:
    logging.getLogger("some.library").error("the server refused the connection")
    assert "ERROR some.library: the server refused the connection" in console.getvalue()


def test_an_adopted_logger_stops_printing_through_its_own_stream_handler(console: io.StringIO, tmp_path: Path) -> None:
    own = io.StringIO()
    logger = logging.getLogger("ray_like_library")
    logger.addHandler(logging.StreamHandler(own))
    logger.propagate = False
    try:
        library_logs.adopt_logger("ray_like_library")
        logger.warning("Token authentication is enabled for this cluster")
        assert own.getvalue() == "" and console.getvalue() == ""
        library_logs.attach(tmp_path / "driver.log")
        assert "Token authentication is enabled" in (tmp_path / "driver.log").read_text()
    finally:
        logger.handlers.clear()


def test_only_the_newest_records_are_kept_while_no_log_is_attached(console: io.StringIO, tmp_path: Path) -> None:
    for i in range(library_logs.KEPT_RECORDS + 5):
        logging.getLogger("chatty").warning("notice %d", i)
    library_logs.attach(tmp_path / "driver.log")
    lines = (tmp_path / "driver.log").read_text().splitlines()
    assert len(lines) == library_logs.KEPT_RECORDS
    assert lines[0].endswith("notice 5") and lines[-1].endswith(f"notice {library_logs.KEPT_RECORDS + 4}")
