"""llamax._validate: what counts as an int, a number and a bool, and what
the checks raise (the classes and words of the native core's checks)."""
import math

import numpy as np
import pytest

import llamax
from llamax._validate import check_bool, check_bools, check_float, check_int, is_int, is_number

INTS = [0, -3, 2**70, np.int8(5), np.int64(-1), np.uint32(7)]
NOT_INTS = [True, False, np.bool_(True), 1.0, np.float32(2), "1", None, [1], 1 + 0j]


@pytest.mark.parametrize("x", INTS)
def test_ints_are_ints(x):
    assert is_int(x) and is_number(x)


@pytest.mark.parametrize("x", NOT_INTS)
def test_bools_and_floats_are_not_ints(x):
    assert not is_int(x)


def test_is_int_bounds():
    assert is_int(0, 0) and is_int(5, 0, 5) and is_int(-5, hi=0)
    assert not is_int(-1, 0) and not is_int(6, 0, 5) and not is_int(1, hi=0)
    assert is_int(np.int64(3), 1, 3) and not is_int(np.int64(4), 1, 3)


@pytest.mark.parametrize("x", [0.5, -1e300, np.float32(1.5), np.float64(2), 3, np.int16(4), 2**2000])
def test_numbers(x):
    assert is_number(x)


@pytest.mark.parametrize("x", [True, np.bool_(False), "1.0", None, 1j, np.array([1.0])])
def test_not_numbers(x):
    assert not is_number(x) and not is_number(x, finite=False)


@pytest.mark.parametrize("x", [math.nan, math.inf, -math.inf, np.float32("nan"), np.float64("inf")])
def test_non_finite(x):
    assert not is_number(x)
    assert is_number(x, finite=False)


def test_number_bounds():
    assert is_number(0.5, 0, 1) and not is_number(1.5, 0, 1) and not is_number(-0.1, lo=0)
    assert is_number(math.inf, lo=0, finite=False) and not is_number(math.inf, hi=0, finite=False)
    assert not is_number(math.nan, 0, 1, finite=False)  # nan is inside no range


def test_check_int_returns_a_python_int():
    for x in (5, np.int32(5), np.uint64(5)):
        v = check_int(x, "n", 0, 10)
        assert v == 5 and type(v) is int
    assert check_int(None, "n", none_ok=True) is None


def test_check_int_errors():
    with pytest.raises(llamax.ArgumentTypeError, match=r"^n must be an int, not bool$"):
        check_int(True, "n")
    with pytest.raises(llamax.ArgumentTypeError, match=r"^n must be an int, not float$"):
        check_int(1.0, "n")
    with pytest.raises(llamax.ArgumentTypeError, match=r"^n must be an int, not NoneType$"):
        check_int(None, "n")
    with pytest.raises(llamax.ArgumentTypeError, match=r"^n must be an int or None, not str$"):
        check_int("3", "n", none_ok=True)
    with pytest.raises(llamax.InvalidArgumentError, match=r"^n=11 is out of range \[0, 10\]$"):
        check_int(11, "n", 0, 10)
    with pytest.raises(llamax.InvalidArgumentError, match=r"^n=-1 must be >= 0$"):
        check_int(-1, "n", 0)
    with pytest.raises(llamax.InvalidArgumentError, match=r"^n=2 must be <= 1$"):
        check_int(2, "n", hi=1)


def test_check_int_message_and_class_overrides():
    """A site that has always said one thing (and raised one class) for both."""
    for bad in (True, "x", -1):
        with pytest.raises(llamax.InvalidArgumentError, match=r"^seed must be a non-negative int$") as e:
            check_int(bad, "seed", 0, error=llamax.InvalidArgumentError, msg="seed must be a non-negative int")
        assert not isinstance(e.value, TypeError)
    with pytest.raises(llamax.ArgumentTypeError, match="^custom$"):
        check_int(1.5, "n", msg="custom")
    with pytest.raises(llamax.InvalidArgumentError, match="^custom$"):
        check_int(-1, "n", 0, msg="custom")


def test_check_float():
    for x in (1, 1.5, np.float32(1.5), np.int8(1)):
        v = check_float(x, "t")
        assert v == x and type(v) is float
    assert check_float(None, "t", none_ok=True) is None
    assert check_float(math.inf, "t", finite=False) == math.inf
    with pytest.raises(llamax.ArgumentTypeError, match=r"^t must be a number, not bool$"):
        check_float(False, "t")
    with pytest.raises(llamax.ArgumentTypeError, match=r"^t must be a number, not str$"):
        check_float("1", "t")
    with pytest.raises(llamax.InvalidArgumentError, match=r"^t must be finite, got nan$"):
        check_float(math.nan, "t")
    with pytest.raises(llamax.InvalidArgumentError, match=r"^t must be finite, got -inf$"):
        check_float(-math.inf, "t", 0, 1)
    with pytest.raises(llamax.InvalidArgumentError, match=r"^t=2.5 is out of range \[0, 2\]$"):
        check_float(2.5, "t", 0, 2)
    with pytest.raises(llamax.InvalidArgumentError, match=r"^t=nan is out of range \[0, 2\]$"):
        check_float(math.nan, "t", 0, 2, finite=False)
    with pytest.raises(llamax.InvalidArgumentError, match="^bad scale$"):
        check_float(math.nan, "t", error=llamax.InvalidArgumentError, msg="bad scale")
    with pytest.raises(llamax.InvalidArgumentError, match="^bad scale$"):
        check_float("x", "t", error=llamax.InvalidArgumentError, msg="bad scale")


def test_check_bool():
    assert check_bool(True, "f") is True and check_bool(False, "f") is False
    for bad in (1, 0, None, "True", np.bool_(True)):
        with pytest.raises(llamax.ArgumentTypeError, match=rf"^f must be True or False, not {type(bad).__name__}$"):
            check_bool(bad, "f")
    with pytest.raises(llamax.ArgumentTypeError, match="^f must be a bool$"):
        check_bool(1, "f", msg="f must be a bool")
    check_bools(a=True, b=False)
    with pytest.raises(llamax.ArgumentTypeError, match=r"^b must be True or False, not int$"):
        check_bools(a=True, b=1, c="never checked")
