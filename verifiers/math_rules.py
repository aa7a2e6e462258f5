"""How `MathAnswerVerifier` compares numbers and variables where math-verify 0.9.0 does not.

As math-verify ships (`math_verify.grader`, `math_verify.parser`):

- a float is compared after rounding both sides to `float_rounding` decimals (6), and two
  expressions that are not single numbers by `(a - b).evalf(chop=True) == 0`, which chops any
  difference under ~1e-15 to zero: every number under 5e-7 equals every other
  (0.0000001 == 0.0000002) and 1/2^99 equals 1/2^98.
- its LaTeX parser lowercases every symbol (latex2sympy2_extended's
  `ConversionConfig.lowercase_symbols`, which math-verify does not expose), so X equals x even
  with `strict=True`, whose documented meaning is that variables matter.

Here, two numbers (no free variable; alone, or inside sets, tuples, intervals, matrices and the
sides of relations: wherever math-verify compares numbers) are equal when:

    ==============================  ==============================================================
    both sides                      equal when
    ==============================  ==============================================================
    rational: integers, fractions,  exactly equal (1/2^99 != 1/2^98, 100! != 100! + 1)
    factorials, integer powers
    exact but not rational          their difference is zero to sympy's evalf, which refines
    (sqrt, pi, log)                 to 100 digits (sqrt(3 + 2 sqrt 2) == 1 + sqrt 2)
    one or both a float             they agree to `float_rounding` significant digits of the
                                    larger, and to at least `float_rounding` decimals: both are
                                    rounded at decimal place float_rounding + max(0, -1 - e),
                                    e = floor(log10 max(|a|, |b|)). At 6: 0.333333 == 1/3,
                                    0.3333 != 1/3, 1.0e-7 != 2.0e-7, 1.23456789e-30 ==
                                    1.234568e-30, 1234567.4 != 1234567
    one a percentage p%             p% == p or p% == p/100 (math-verify's rule); two
                                    percentages by their numbers
    ==============================  ==============================================================

Expressions with free variables are left to math-verify's symbolic comparison (sympy's
`simplify` of the difference, exact).

With `strict=True` LaTeX symbols keep their case (X != x, `\\Pi` is not pi); math-verify's symbol
rule still compares names of several letters (`\\text{Yes}`) without case. With `strict=False`
(variables matched by position) they are lowercased as math-verify does.

How: `install()` replaces math-verify's `grader.sympy_numeric_eq` and `parser.parse_latex_cached`
once by functions that apply these rules inside `applied(...)` (a context variable, so per
thread) and call math-verify's own everywhere else: `math_verify.verify` and `math_verify.parse`
called outside this verifier behave as shipped.

Example:
    >>> from sympy import Float, Integer, Rational
    >>> numbers_equal(Rational(1, 2**99), Rational(1, 2**98), 6, 15)
    False
    >>> numbers_equal(Float("1e-7"), Float("2e-7"), 6, 15), numbers_equal(Float("0.333333"),
    ...     Rational(1, 3), 6, 15), numbers_equal(Float("0.3333"), Rational(1, 3), 6, 15)
    (False, True, False)
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from decimal import Decimal
from functools import lru_cache
from typing import Any

_CASE_SENSITIVE: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "posttrain_math_rules", default=None
)  # None: math-verify's own rules (not inside applied)
_INSTALL_LOCK = threading.Lock()


@contextlib.contextmanager
def applied(*, case_sensitive: bool) -> Iterator[None]:
    """Within this block (this thread or task only), math-verify compares numbers by the rules of
    the module docstring and, if `case_sensitive`, parses LaTeX symbols keeping their case."""
    install()
    token = _CASE_SENSITIVE.set(case_sensitive)
    try:
        yield
    finally:
        _CASE_SENSITIVE.reset(token)


def install() -> None:
    """Put the two replacements into math-verify once (idempotent, thread-safe). Raises
    RuntimeError if math-verify lacks the functions replaced (a version other than 0.9.0)."""
    from math_verify import grader, parser

    with _INSTALL_LOCK:
        if getattr(grader.sympy_numeric_eq, "posttrain_rules", False):
            return
        if not (
            callable(getattr(grader, "sympy_numeric_eq", None))
            and callable(getattr(parser, "parse_latex_cached", None))
        ):
            raise RuntimeError(
                "math_verify.grader.sympy_numeric_eq / math_verify.parser."
                "parse_latex_cached are missing: posttrain's number and case "
                "rules need math-verify 0.9.0 (constraints.txt)"
            )
        own_numeric_eq, own_parse = grader.sympy_numeric_eq, parser.parse_latex_cached

        def sympy_numeric_eq(a: Any, b: Any, float_rounding: int, numeric_precision: int) -> bool:
            if _CASE_SENSITIVE.get() is None:
                return own_numeric_eq(a, b, float_rounding, numeric_precision)
            return numbers_equal(a, b, float_rounding, numeric_precision)

        def parse_latex_cached(latex: str) -> Any:
            if _CASE_SENSITIVE.get():
                return _parse_latex_keeping_case(latex)
            return own_parse(latex)

        # a mark on the installed functions, so that installing twice is seen
        sympy_numeric_eq.posttrain_rules = True  # type: ignore[attr-defined]
        parse_latex_cached.posttrain_rules = True  # type: ignore[attr-defined]
        grader.sympy_numeric_eq, parser.parse_latex_cached = sympy_numeric_eq, parse_latex_cached


def numbers_equal(a: Any, b: Any, float_rounding: int, numeric_precision: int) -> bool:
    """Whether sympy values `a` and `b` are equal numbers by the module docstring's table; False
    for anything else (expressions with variables: math-verify's symbolic comparison decides).
    `numeric_precision` is the digits evalf is asked for (math-verify's, 15), refined up to 100."""
    from math_verify.grader import get_pct_val, safe_sympy_doit
    from sympy import MatrixBase, MatrixExpr

    try:
        if isinstance(a, (MatrixBase, MatrixExpr)) and isinstance(b, (MatrixBase, MatrixExpr)):
            a, b = safe_sympy_doit(a), safe_sympy_doit(b)
            return (
                isinstance(a, MatrixBase)
                and isinstance(b, MatrixBase)
                and a.shape == b.shape
                and all(
                    numbers_equal(x, y, float_rounding, numeric_precision)
                    for x, y in zip(a, b, strict=True)
                )
            )
        percent_a, percent_b = get_pct_val(a), get_pct_val(b)
        if (percent_a is None) != (percent_b is None):  # p% against a number: p or p/100
            percent, value, other = (
                (a, percent_a, b) if percent_a is not None else (b, percent_b, a)
            )
            return _values_equal(value, other, float_rounding, numeric_precision) or _values_equal(
                percent, other, float_rounding, numeric_precision
            )
        if percent_a is not None:
            a, b = percent_a, percent_b
        return _values_equal(a, b, float_rounding, numeric_precision)
    except Exception:  # noqa: BLE001 - as math-verify's own rule: what cannot compare is unequal
        return False


def _values_equal(a: Any, b: Any, float_rounding: int, numeric_precision: int) -> bool:
    from math_verify.grader import safe_sympy_doit
    from sympy import Expr, Float

    a, b = safe_sympy_doit(a), safe_sympy_doit(b)
    if not (isinstance(a, Expr) and isinstance(b, Expr) and a.is_number and b.is_number):
        return False
    if a.has(Float) or b.has(Float):
        return _rounded_equal(a, b, float_rounding)
    if a.is_Rational and b.is_Rational:
        return bool(a == b)
    return _difference_is_zero(a - b, numeric_precision)


def _rounded_equal(a: Any, b: Any, float_rounding: int) -> bool:
    """Both rounded at float_rounding significant digits of the larger magnitude, and at no
    fewer than float_rounding decimals: the nearest integers to a * 10^places and b * 10^places
    (real and imaginary parts) are equal. Integers, not rounded Floats, are compared: sympy's
    Float(1.0) != Integer(1), and two roundings of one value may differ in binary precision."""
    from sympy import Integer, im, re

    larger = max(abs(a.evalf(30)), abs(b.evalf(30)))
    if larger == 0:
        return True
    exponent = Decimal(str(larger)).adjusted()  # floor(log10(larger)), from its decimal digits
    scale = Integer(10) ** (float_rounding + max(0, -1 - exponent))
    return all(
        int((part(a) * scale).round()) == int((part(b) * scale).round()) for part in (re, im)
    )


def _difference_is_zero(difference: Any, numeric_precision: int) -> bool:
    """True when sympy's evalf, refining up to 100 digits, cannot tell `difference` from zero."""
    from sympy.core.evalf import PrecisionExhausted

    try:
        return bool(difference.evalf(n=numeric_precision, strict=True) == 0)
    except PrecisionExhausted:
        return True


@lru_cache(maxsize=256)
def _parse_latex_keeping_case(latex: str) -> Any:
    """math-verify's `parse_latex_cached` (parser.py, 0.9.0) with the symbols' case kept: the
    LaTeX as it is, else its last equation (`a = b = c` read as c)."""
    from latex2sympy2_extended.latex2sympy2 import ConversionConfig, latex2sympy
    from math_verify.grader import should_treat_as_complex
    from math_verify.parser import get_last_eq

    def convert(text: str) -> Any:
        return latex2sympy(
            text,
            is_real=not should_treat_as_complex(text),
            convert_degrees=False,
            normalization_config=None,
            conversion_config=ConversionConfig(lowercase_symbols=False),
        )

    try:
        return convert(latex)
    except Exception:
        last = get_last_eq(latex)
        if last == latex:
            raise
        return convert(last)
