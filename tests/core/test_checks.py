"""The one checker of "a number of the right kind in a range" (`posttrain.core.checks`) and the
classes that use it: every refusal names `Class.field`, shows the value and says the range.

Messages are pinned as written by hand from the rule: `name=repr(value); must be <kind>
<range>[ or None][ (note)]`, kind "an integer" or "a finite number", range `>= low`, `> above`,
`<= high`, `in [low, high]` or `in (above, high]`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from posttrain.core.checks import FieldTypeError, check_fields, check_number, fail
from posttrain.rewards.judge_limits import ServerSettings
from posttrain.train import ParallelPlan
from posttrain.verifiers.sandbox import SandboxLimits
from posttrain.workflows import SFTConfig, field_checks
from posttrain.workflows.config import override

SEED_MAX = 4294967295


@pytest.mark.parametrize(
    "value, bounds, error, message",
    [
        (0, dict(integer=True, low=1), ValueError, "n=0; must be an integer >= 1"),
        (True, dict(integer=True, low=1), FieldTypeError, "n=True; must be an integer >= 1"),
        (2.0, dict(integer=True, low=1), FieldTypeError, "n=2.0; must be an integer >= 1"),
        ("3", dict(integer=True), FieldTypeError, "n='3'; must be an integer"),
        (math.nan, dict(above=0), ValueError, "n=nan; must be a finite number > 0"),
        (-math.inf, dict(), ValueError, "n=-inf; must be a finite number"),
        (None, dict(above=0), FieldTypeError, "n=None; must be a finite number > 0"),
        (-0.5, dict(low=0, high=1), ValueError, "n=-0.5; must be a finite number in [0, 1]"),
        (0, dict(above=0, high=1), ValueError, "n=0; must be a finite number in (0, 1]"),
        (2, dict(high=1), ValueError, "n=2; must be a finite number <= 1"),
        (-1, dict(low=-math.inf, high=math.inf, integer=True), None, None),  # infinite bounds: none
        (
            -1,
            dict(integer=True, low=0, high=SEED_MAX, note="a seed"),
            ValueError,
            f"n=-1; must be an integer in [0, {SEED_MAX}] (a seed)",
        ),
        (
            0,
            dict(integer=True, low=1, optional=True, note="= pp"),
            ValueError,
            "n=0; must be an integer >= 1 or None (= pp)",
        ),
        (
            "x",
            dict(above=0, optional=True),
            FieldTypeError,
            "n='x'; must be a finite number > 0 or None",
        ),
        # an int past the float range is finite and compared exactly (math.isfinite of it raises
        # OverflowError)
        (10**400, dict(low=0.001, high=86400.0), ValueError, None),
        (10**400, dict(low=0.001), None, None),
    ],
)
def test_check_number_pinned(value, bounds, error, message):
    if error is None:
        check_number("n", value, **bounds)
        return
    with pytest.raises(error) as info:
        check_number("n", value, **bounds)
    assert type(info.value) is error
    if message is not None:
        assert str(info.value) == message


@pytest.mark.parametrize(
    "value, bounds",
    [
        (1, dict(integer=True, low=1)),
        (0.001, dict(low=0.001, high=1)),
        (1, dict(low=0, high=1)),
        (1e-300, dict(above=0)),
        (None, dict(above=0, optional=True)),
        (3, dict(above=0)),
        (SEED_MAX, dict(integer=True, low=0, high=SEED_MAX)),
        (10**30, dict(integer=True, low=1)),
    ],
)
def test_check_number_accepts_its_boundaries_and_ints_where_numbers_belong(value, bounds):
    check_number("n", value, **bounds)


def test_a_wrong_kind_is_both_a_type_error_and_a_value_error():
    """Sandbox limits documented TypeError, the config checks ValueError: one error is both."""
    for caught in (TypeError, ValueError):
        with pytest.raises(caught, match="n='1'"):
            check_number("n", "1", integer=True, low=1)
    assert issubclass(FieldTypeError, TypeError) and issubclass(FieldTypeError, ValueError)


def test_long_and_unprintable_values_are_cut_in_the_message():
    """A 10,000-character string is shown as its first 60 characters and its length; an int of
    5001 digits (past Python's 4300-digit limit of int -> str, where repr raises ValueError)
    by its size: 5000 * log2(10) = 16609.6, so 16610 bits."""
    with pytest.raises(FieldTypeError) as info:
        check_number("n", "x" * 10_000, low=0)
    assert str(info.value) == (
        f"n='{'x' * 59}... (10,002 characters); must be a finite number >= 0"
    )
    with pytest.raises(ValueError, match=r"^n=<int of 16610 bits>; must be an integer <= 10$"):
        check_number("n", 10**5000, integer=True, high=10)
    assert str(fail("a.b", [1] * 100, "short")).startswith("a.b=[1, 1, ")


def test_low_and_above_together_are_refused():
    with pytest.raises(ValueError, match="low= or above=, not both"):
        check_number("n", 1, low=0, above=0)


def test_check_fields_names_the_class_or_the_given_section():
    obj = SimpleNamespace(a=1, b=0)
    with pytest.raises(ValueError, match=r"^SimpleNamespace\.b=0; must be an integer >= 1$"):
        check_fields(obj, ("a", "b"), integer=True, low=1)
    with pytest.raises(ValueError, match=r"^Config\.optim\.b=0; must be a finite number > 0$"):
        check_fields(obj, ("a", "b"), at="Config.optim", above=0)


# -- the classes that use it: Class.field, the value and the range ----------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: ServerSettings(max_queue=0),
            "ServerSettings.max_queue=0; must be an integer >= 1",
        ),
        (
            lambda: ServerSettings(max_wait_s=-1),
            "ServerSettings.max_wait_s=-1; must be a finite number >= 0 (seconds)",
        ),
        (
            lambda: ServerSettings(max_wait_s=math.inf),
            "ServerSettings.max_wait_s=inf; must be a finite number >= 0 (seconds)",
        ),
        (
            lambda: ServerSettings(request_timeout_s=math.nan),
            "ServerSettings.request_timeout_s=nan; must be a finite number > 0",
        ),
        (
            lambda: SandboxLimits(output_bytes=0),
            f"SandboxLimits.output_bytes=0; must be an integer in [1, {2**30}]",
        ),
        (
            lambda: SandboxLimits(cpu_s=86400.5),
            "SandboxLimits.cpu_s=86400.5; must be a finite number in [0.001, 86400.0]",
        ),
        (lambda: ParallelPlan(tp=0), "ParallelPlan.tp=0; must be an integer >= 1"),
        (
            lambda: ParallelPlan(pp=2, n_microbatches=0),
            "ParallelPlan.n_microbatches=0; must be an integer >= 1 or None (= pp)",
        ),
        (
            lambda: override(SFTConfig(), {"parallel.dp_shard": 0}),  # a recipe's parallel section
            "Config.parallel.dp_shard=0; must be an integer >= 1",
        ),
        (
            lambda: field_checks.seeds(SimpleNamespace(seed=2**32), "Config", ("seed",)),
            f"Config.seed={2**32}; must be an integer in [0, {SEED_MAX}] (a seed)",
        ),
        (
            lambda: field_checks.finite(
                SimpleNamespace(weight_decay=-1.0), "Config.optim", ("weight_decay",), low=0.0
            ),
            "Config.optim.weight_decay=-1.0; must be a finite number >= 0.0",
        ),
        (
            lambda: field_checks.positive(SimpleNamespace(lr=0), "Config.optim", ("lr",)),
            "Config.optim.lr=0; must be a finite number > 0",
        ),
        (
            lambda: field_checks.ints(
                SimpleNamespace(keep_last=0),
                "Config.checkpoint",
                ("keep_last",),
                minimum=1,
                optional=True,
            ),
            "Config.checkpoint.keep_last=0; must be an integer >= 1 or None",
        ),
    ],
)
def test_each_user_names_its_class_field_value_and_range(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: ServerSettings(max_batch_size="8"), "ServerSettings.max_batch_size='8'"),
        (lambda: ServerSettings(drain_timeout_s=True), "ServerSettings.drain_timeout_s=True"),
        (lambda: SandboxLimits(memory_mb=512.0), "SandboxLimits.memory_mb=512.0"),
        (lambda: SandboxLimits(wall_s=None), "SandboxLimits.wall_s=None"),
        (lambda: ParallelPlan(dp_shard=2.0), "ParallelPlan.dp_shard=2.0"),
        (
            lambda: field_checks.ints(
                SimpleNamespace(steps=True), "Config.optim", ("steps",), minimum=1
            ),
            "Config.optim.steps=True",
        ),
    ],
)
def test_each_user_refuses_a_wrong_kind_as_type_and_value_error(make, name):
    with pytest.raises(FieldTypeError) as info:
        make()
    assert str(info.value).startswith(f"{name}; must be ")
