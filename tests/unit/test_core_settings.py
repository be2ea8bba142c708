"""One reading of setting values for the master's configuration, the Spark conf and the CLI."""

from __future__ import annotations

import math

import pytest

from blobha.core import settings
from blobha.core.settings import SettingError
from blobha.master.config import ConfigError, load_config
from blobha.spark.conf import conf_float, conf_int


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
