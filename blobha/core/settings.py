"""How a setting's text reads as a value, the same for the master's configuration, the Spark
conf and the command line. Each front end words its own error around :class:`SettingError`."""

from __future__ import annotations

import math
import re

#: How a true/false setting may be written (an environment variable, a Spark conf).
FLAGS = {"true": True, "1": True, "yes": True, "on": True,
         "false": False, "0": False, "no": False, "off": False}


class SettingError(ValueError):
    """A setting's value does not read as its kind; the message says what was expected."""


def whole(value: object) -> int:
    """An integer, from an int, an integral float or its text."""
    if isinstance(value, bool):
        raise SettingError("expected a whole number")
    try:
        if isinstance(value, float):
            if value != int(value):
                raise SettingError("expected a whole number")
            return int(value)
        return int(str(value).strip()) if isinstance(value, str) else int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise SettingError("expected a whole number") from None


def real(value: object) -> float:
    """A finite number."""
    if isinstance(value, bool):
        raise SettingError("expected a number")
    try:
        number = float(str(value).strip()) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SettingError("expected a number") from None
    if not math.isfinite(number):
        raise SettingError("expected a number")
    return number


def seconds(value: object, forever: bool = False) -> float:
    """A non-negative number of seconds; with ``forever``, -1 (and only -1 of the negative
    numbers) too, meaning no limit."""
    try:
        number = real(value)
    except SettingError:
        raise SettingError("expected a number of seconds") from None
    if number < 0:
        if forever and number != -1:
            raise SettingError("use -1 to wait forever")
        if not forever:
            raise SettingError("expected a non-negative number of seconds")
    return number


#: Spark's time suffixes (JavaUtils.timeStringAs), in seconds; "m" is minutes, as in Spark.
TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
              "d": 86400.0}
#: Spark's size suffixes (JavaUtils.byteStringAs), binary as in Spark: 1k = 1024 bytes.
SIZE_UNITS = {"b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
              "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
              "p": 1 << 50, "pb": 1 << 50}
_AMOUNT = re.compile(r"([-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*([a-z]*)")


def duration(value: object, default_unit: str = "s") -> float:
    """A duration in seconds, from a number (in ``default_unit``) or Spark's time strings:
    ``500ms``, ``60s``, ``5min`` (or ``5m``), ``2h``, ``1d``, ``250us``. Fractions are
    accepted too (``1.5h``), where Spark takes whole numbers only."""
    expected = "expected a duration such as 60, 60s, 500ms, 5min, 2h or 1d"
    if isinstance(value, bool):
        raise SettingError(expected)
    try:
        number, unit = real(value), default_unit  # a plain number, "1e3" included
    except SettingError:
        m = _AMOUNT.fullmatch(str(value).strip().lower())
        if m is None:
            raise SettingError(expected) from None
        number, unit = float(m.group(1)), m.group(2) or default_unit
    if unit not in TIME_UNITS:
        raise SettingError(f"unknown time unit {unit!r}: {expected}")
    if not math.isfinite(number):
        raise SettingError(expected)
    return number * TIME_UNITS[unit]


def size(value: object) -> int:
    """A size in bytes, from a whole number of bytes or Spark's size strings: ``1k``,
    ``512m``, ``10g`` (or ``10gb``), ``2t``, binary as in Spark (``1k`` is 1024 bytes)."""
    expected = "expected a size in bytes such as 1048576, 512m, 10g or 10gb"
    if isinstance(value, bool):
        raise SettingError(expected)
    if isinstance(value, int):
        return value
    m = _AMOUNT.fullmatch(str(value).strip().lower())
    if m is None:
        raise SettingError(expected)
    text, unit = m.group(1), m.group(2) or "b"
    if unit not in SIZE_UNITS:
        raise SettingError(f"unknown size unit {unit!r}: {expected}")
    if not re.fullmatch(r"[-+]?[0-9]+", text):
        raise SettingError(f"a size takes a whole number (as in Spark): {expected}")
    return int(text) * SIZE_UNITS[unit]


def flag(value: object) -> bool:
    """True or false, from a bool or one of :data:`FLAGS`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in FLAGS:
        return FLAGS[value.strip().lower()]
    raise SettingError("expected true or false")
