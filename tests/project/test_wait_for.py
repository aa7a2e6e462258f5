"""`conftest.wait_for`, the one way tests wait for a state: it returns the predicate's first
truthy value, and past its deadline fails with a message naming what it waited for."""

from __future__ import annotations

import itertools

import pytest
from _waits import wait_for


def test_returns_the_first_truthy_value_of_the_predicate():
    answers = iter([None, 0, "", 42, 43])
    assert wait_for(lambda: next(answers), what="the answer", poll_s=0.0) == 42
    assert next(answers) == 43  # polled no further than the first truthy value


def test_a_state_that_never_holds_fails_naming_it_and_the_detail():
    polls = itertools.count()
    with pytest.raises(
        TimeoutError,
        match=r"^timed out after 0 s waiting for job 7 to write "
        r"its pid; state RUNNING$",
    ):
        wait_for(
            lambda: next(polls) < 0,
            what="job 7 to write its pid",
            timeout=0,
            detail=lambda: "state RUNNING",
        )
    assert next(polls) == 1  # polled once even with no time left
