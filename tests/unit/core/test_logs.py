"""Log lines: text or JSON, each with the current request id."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from blobha.core import logs


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out = io.StringIO()
    try:
        yield out
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def _configure(fmt: str, out: io.StringIO) -> None:
    logs.configure("INFO", fmt, "m1:6627")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(out)


def test_json_lines_carry_the_request_id_and_the_exception(captured: io.StringIO) -> None:
    _configure("json", captured)
    log = logging.getLogger("blobha.test")
    previous = logs.set_request_id("req-42")
    try:
        log.info("hello %s", "wörld")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        logs.set_request_id(previous)
    log.info("outside")
    lines = [json.loads(x) for x in captured.getvalue().splitlines()]
    assert [x["request_id"] for x in lines] == ["req-42", "req-42", "-"]
    assert lines[0]["message"] == "hello wörld" and lines[0]["level"] == "INFO"
    assert lines[0]["master"] == "m1:6627" and lines[0]["logger"] == "blobha.test"
    assert lines[0]["ts"].endswith("+00:00")
    assert "ValueError: boom" in lines[1]["exception"]
    assert "exception" not in lines[2]


def test_text_lines_show_the_request_id(captured: io.StringIO) -> None:
    _configure("text", captured)
    previous = logs.set_request_id("abc")
    try:
        logging.getLogger("blobha.test").warning("careful")
    finally:
        logs.set_request_id(previous)
    line = captured.getvalue().strip()
    assert " WARNING [m1:6627] req=abc blobha.test: careful" in line
    assert logs.current_request_id() == logs.NO_REQUEST


def test_kazoo_reconnect_noise_is_quietened(captured: io.StringIO) -> None:
    _configure("text", captured)
    assert logging.getLogger("kazoo.client").level == logging.ERROR


def test_a_lazy_logger_loads_logging_at_its_first_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import subprocess
    import sys

    from blobha.core.lazy import LazyLogger

    code = ("import sys; from blobha.core.lazy import LazyLogger; LazyLogger('blobha.cache'); "
            "print('logging' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.split() == ["False"]

    log = LazyLogger("blobha.cache")
    assert log.logger is logging.getLogger("blobha.cache")

    def caller() -> None:
        log.info("kept %d", 3)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")

    with caplog.at_level(logging.INFO, logger="blobha.cache"):
        caller()
    first, second = caplog.records
    assert (first.name, first.getMessage(), first.funcName) == ("blobha.cache", "kept 3", "caller")
    assert first.pathname == __file__, "the record names the caller, not the wrapper"
    assert second.funcName == "caller" and second.exc_info is not None
