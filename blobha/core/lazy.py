"""Things loaded on first use: a package's public names (importing the package, which every one
of its modules' imports does first, then loads only what is used), and a logger."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging


def lazy_attributes(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose ``namespace`` (its globals)
    gets each name of ``exports`` (name -> module) from its module when first asked for."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups do not come back here
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_


class LazyLogger:
    """The logger ``name``, with the logging package loaded at its first message.

    For the node cache and the Spark worker hook: logging brings a dozen modules (traceback,
    tokenize, string...) that a Python worker's start served from a warm cache, which logs
    nothing, would load for nothing. Records name the caller, as the logger's own methods do.
    """

    __slots__ = ("_logger", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._logger: logging.Logger | None = None

    @property
    def logger(self) -> logging.Logger:
        if self._logger is None:
            import logging

            self._logger = logging.getLogger(self.name)
        return self._logger

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.logger.debug(msg, *args, **_caller(kwargs))

    def info(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.logger.info(msg, *args, **_caller(kwargs))

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.logger.warning(msg, *args, **_caller(kwargs))

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.logger.error(msg, *args, **_caller(kwargs))

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        self.logger.exception(msg, *args, **_caller(kwargs))


def _caller(kwargs: dict[str, Any]) -> dict[str, Any]:
    # One frame more to skip: the record names whoever called the LazyLogger method.
    kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
    return kwargs

