"""Shared argument checks: one place for "an int, not a bool, at least n" (every config record
validates its fields with it, so the errors read alike and name the field).

Pure: imports nothing of ours or third-party; every layer may use it.
"""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(owner: str, field: str, value: Any, *, minimum: int,
              allow_none: bool = False) -> None:
    """Raise ``ValueError("<owner>.<field> must be an int >= <minimum>, got <value>")`` unless
    ``value`` is such an int (or None when ``allow_none``)."""
    if allow_none and value is None:
        return
    if not is_int(value) or value < minimum:
        extra = "None or " if allow_none else ""
        raise ValueError(f"{owner}.{field} must be {extra}an int >= {minimum}, got {value!r}")
