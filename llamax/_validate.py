"""Argument checks shared by the Python layers: ints, numbers, bools.

One place decides what an int is (a Python or numpy integer, never a
``bool``: ``True`` is not a count) and what a number is (an int or a
float, finite unless a caller says otherwise), so no call site spells
``isinstance(x, bool) or not isinstance(x, int)`` by hand.  The native
core's ``_core._check_int`` / ``_check_float`` apply the same rules one
layer down.

The ``check_*`` functions raise what the core raises: ArgumentTypeError
for the wrong type, InvalidArgumentError for a value out of range, with the
core's words.  A call site that has always said something more precise
passes ``msg`` (the message for both failures) and, where it has always
raised one class for both, ``error``.  They return the value converted
(``int`` / ``float``), so a numpy scalar goes no further than the check.
"""

from __future__ import annotations

import math
from typing import Literal, cast, overload

import numpy as np

from llamax._errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["is_int", "is_number", "check_int", "check_float", "check_bool", "check_bools"]


def is_int(x: object, lo: int | None = None, hi: int | None = None) -> bool:
    """``x`` is an int (``int`` or a numpy integer, not a bool) in
    ``[lo, hi]`` (either bound may be None: no bound)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        return False
    return bool((lo is None or x >= lo) and (hi is None or x <= hi))


def is_number(x: object, lo: float | None = None, hi: float | None = None, *, finite: bool = True) -> bool:
    """``x`` is an int or a float (numpy scalars too, not a bool) in
    ``[lo, hi]``; with ``finite``, not nan or ±inf."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        return False
    # an int is always finite, and math.isfinite can't take one past a double's range
    if finite and isinstance(x, (float, np.floating)) and not math.isfinite(x):
        return False
    if x != x:  # nan (finite=False): inside no range
        return lo is None and hi is None
    return bool((lo is None or x >= lo) and (hi is None or x <= hi))


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"is out of range [{lo}, {hi}]"
    return f"must be >= {lo}" if lo is not None else f"must be <= {hi}"


@overload
def check_int(value: object, name: str, lo: int | None = ..., hi: int | None = ..., *,
              none_ok: Literal[False] = ..., msg: str | None = ..., error: type[Exception] | None = ...) -> int: ...
@overload
def check_int(value: object, name: str, lo: int | None = ..., hi: int | None = ..., *,
              none_ok: bool, msg: str | None = ..., error: type[Exception] | None = ...) -> int | None: ...


def check_int(value: object, name: str, lo: int | None = None, hi: int | None = None, *, none_ok: bool = False,
              msg: str | None = None, error: type[Exception] | None = None) -> int | None:
    """``value`` as an ``int`` (None stays None with ``none_ok``).

    Not an int: ArgumentTypeError ``"{name} must be an int, not {type}"``;
    outside ``[lo, hi]``: InvalidArgumentError ``"{name}={value} is out of
    range [lo, hi]"``.  ``msg`` / ``error`` replace the message / class of
    both."""
    if value is None and none_ok:
        return None
    if not is_int(value):
        raise (error or ArgumentTypeError)(
            msg or f"{name} must be an int{' or None' if none_ok else ''}, not {type(value).__name__}")
    if not is_int(value, lo, hi):
        raise (error or InvalidArgumentError)(msg or f"{name}={value} {_range(lo, hi)}")
    return int(cast(int, value))


@overload
def check_float(value: object, name: str, lo: float | None = ..., hi: float | None = ..., *, finite: bool = ...,
                none_ok: Literal[False] = ..., msg: str | None = ...,
                error: type[Exception] | None = ...) -> float: ...
@overload
def check_float(value: object, name: str, lo: float | None = ..., hi: float | None = ..., *, finite: bool = ...,
                none_ok: bool, msg: str | None = ..., error: type[Exception] | None = ...) -> float | None: ...


def check_float(value: object, name: str, lo: float | None = None, hi: float | None = None, *, finite: bool = True,
                none_ok: bool = False, msg: str | None = None,
                error: type[Exception] | None = None) -> float | None:
    """``value`` (an int or a float) as a ``float`` (None stays None with
    ``none_ok``).

    Not a number: ArgumentTypeError ``"{name} must be a number, not
    {type}"``; nan or ±inf (with ``finite``): InvalidArgumentError
    ``"{name} must be finite, got {value}"``; outside ``[lo, hi]``:
    InvalidArgumentError as :func:`check_int`.  ``msg`` / ``error`` replace
    the message / class of all three."""
    if value is None and none_ok:
        return None
    if not is_number(value, finite=False):
        raise (error or ArgumentTypeError)(
            msg or f"{name} must be a number{' or None' if none_ok else ''}, not {type(value).__name__}")
    if finite and not is_number(value):
        raise (error or InvalidArgumentError)(msg or f"{name} must be finite, got {value}")
    if not is_number(value, lo, hi, finite=finite):
        raise (error or InvalidArgumentError)(msg or f"{name}={value} {_range(lo, hi)}")
    return float(cast(float, value))


def check_bool(value: object, name: str, msg: str | None = None) -> bool:
    """``value`` if it is True or False (not 0/1, not a numpy bool), else
    ArgumentTypeError ``"{name} must be True or False, not {type}"``."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(msg or f"{name} must be True or False, not {type(value).__name__}")
    return value


def check_bools(**flags: object) -> None:
    """:func:`check_bool` on each ``name=value``."""
    for name, value in flags.items():
        check_bool(value, name)
