"""A nested config struct from any of the forms a user gives it: the command-line flag's JSON
string, vLLM's dict (the Python API), or the struct itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

C = TypeVar("C", bound=msgspec.Struct)


def config_from(value: str | dict[str, Any] | C, cls: type[C], name: str,
                error: Callable[[C], str | None]) -> C:
    """``value`` as a ``cls``, checked by ``error``; ValueError naming the flag and the key."""
    try:
        if isinstance(value, cls):
            cfg = value
        elif isinstance(value, str):
            cfg = msgspec.json.decode(value.encode(), type=cls)
        elif isinstance(value, dict):
            cfg = msgspec.convert(value, cls)
        else:
            raise ValueError(f"{name}: expected a JSON string, a dict or a {cls.__name__}, "
                             f"got {type(value).__name__}")
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{name}: {e}") from None
    err = error(cfg)
    if err is not None:
        raise ValueError(err)
    return cfg
