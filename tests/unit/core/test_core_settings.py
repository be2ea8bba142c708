"""One reading of setting values for the master's configuration, the Spark conf and the CLI."""

from __future__ import annotations

import math

import pytest

from blobha.core import settings
from blobha.core.settings import SettingError
from blobha.master.config import ConfigError, load_config
from blobha.spark.conf import conf_float, conf_int, conf_size


@pytest.mark.parametrize(("text", "value"), [("3", 3), (" 7 ", 7), (4, 4), (5.0, 5), ("-2", -2)])
def test_whole_numbers(text: object, value: int) -> None:
    assert settings.whole(text) == value


@pytest.mark.parametrize("text", ["3.5", "x", "", True, 2.5, None, "1e3"])
def test_not_whole_numbers(text: object) -> None:
    with pytest.raises(SettingError, match="expected a whole number"):
        settings.whole(text)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "x", True])
def test_not_finite_numbers(text: object) -> None:
    with pytest.raises(SettingError):
        settings.real(text)


def test_seconds_and_forever() -> None:
    assert settings.seconds("2.5") == 2.5
    assert settings.seconds("-1", forever=True) == -1
    with pytest.raises(SettingError, match="use -1 to wait forever"):
        settings.seconds("-5", forever=True)
    with pytest.raises(SettingError, match="non-negative"):
        settings.seconds("-1")
    with pytest.raises(SettingError, match="number of seconds"):
        settings.seconds("soon")


@pytest.mark.parametrize(("text", "value"), [("yes", True), ("OFF", False), (True, True),
                                             (" 1 ", True), ("0", False)])
def test_flags(text: object, value: bool) -> None:
    assert settings.flag(text) is value


def test_every_front_end_reads_the_same_way(tmp_path: object) -> None:
    # The same text is refused alike by the master's configuration and the Spark conf, each
    # in its own words.
    with pytest.raises(ConfigError, match="whole number"):
        load_config(None, env={"BLOBHA_BLOBSTORE_SYNC_THREADS": "2.5"})
    with pytest.raises(Exception, match="expected a whole number"):
        conf_int({"k": "2.5"}, "k", 1, 1)
    assert conf_float({"k": "-1"}, "k", 5.0, allow_forever=True) == -1.0
    assert math.isclose(conf_float({"k": "0.25"}, "k", 5.0), 0.25)
    with pytest.raises(ConfigError, match="true or false"):
        load_config(None, env={"BLOBHA_BLOBSTORE_SYNC_RECURSIVE_WATCH": "maybe"})


@pytest.mark.parametrize(
    ("text", "secs"),
    [("60", 60.0), ("0.25", 0.25), ("1e3", 1000.0), ("-1", -1.0), (7, 7.0), ("60s", 60.0),
     ("500ms", 0.5), ("250us", 0.00025), ("5min", 300.0), ("5m", 300.0), (" 2H ", 7200.0),
     ("1d", 86400.0), ("1.5h", 5400.0), ("-1s", -1.0)],
)
def test_durations_read_spark_time_strings(text: object, secs: float) -> None:
    # Plain numbers keep their meaning (seconds); suffixes are Spark's (JavaUtils.timeStringAs).
    assert math.isclose(settings.duration(text), secs)


def test_a_duration_default_unit() -> None:
    assert settings.duration("500", default_unit="ms") == 0.5
    assert settings.duration("2s", default_unit="ms") == 2.0


@pytest.mark.parametrize("text", ["", "soon", "5 parsecs", "5y", "1g", "nan", "inf", True, "s"])
def test_not_durations(text: object) -> None:
    with pytest.raises(SettingError, match="expected a duration such as 60, 60s, 500ms"):
        settings.duration(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [("123", 123), (4096, 4096), ("1k", 1024), ("1kb", 1024), ("512m", 512 << 20),
     ("512MB", 512 << 20), ("10g", 10 << 30), ("10gb", 10 << 30), (" 2t ", 2 << 40),
     ("1p", 1 << 50), ("7b", 7)],
)
def test_sizes_read_spark_size_strings(text: object, size: int) -> None:
    # Binary, as Spark's JavaUtils.byteStringAs: 1k is 1024 bytes.
    assert settings.size(text) == size


@pytest.mark.parametrize("text", ["", "big", "10x", "1.5g", "2.0", "10 min", True, 2.5])
def test_not_sizes(text: object) -> None:
    with pytest.raises(SettingError, match="expected a size in bytes such as"):
        settings.size(text)


def test_the_spark_conf_reads_durations_and_sizes() -> None:
    assert conf_float({"k": "5min"}, "k", 1.0) == 300.0
    assert conf_float({"k": "500ms"}, "k", 1.0) == 0.5
    assert conf_float({"k": "-1"}, "k", 1.0, allow_forever=True) == -1.0
    with pytest.raises(Exception, match="k='-5s': use -1 to wait forever"):
        conf_float({"k": "-5s"}, "k", 1.0, allow_forever=True)
    with pytest.raises(Exception, match="k='-1ms': use -1 to wait forever"):
        conf_float({"k": "-1ms"}, "k", 1.0, allow_forever=True)
    assert conf_size({"k": "10g"}, "k", 1) == 10 << 30
    assert conf_size({"k": " "}, "k", 5) == 5
    with pytest.raises(Exception, match="k='-1g': must be at least 0"):
        conf_size({"k": "-1g"}, "k", 1)
