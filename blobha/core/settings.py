"""How a setting's text reads as a value, the same for the master's configuration, the Spark
conf and the command line. Each front end words its own error around :class:`SettingError`."""

from __future__ import annotations

import math

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


def flag(value: object) -> bool:
    """True or false, from a bool or one of :data:`FLAGS`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in FLAGS:
        return FLAGS[value.strip().lower()]
    raise SettingError("expected true or false")
