"""`pyplot_untouched()`: a check that code making figures leaves matplotlib's process-wide state
alone: the backend (no `matplotlib.use`, no `pyplot.switch_backend`) and pyplot's open figures,
the user's included. In a Jupyter kernel a switched backend stops every later plot from
rendering (tests/notebook/test_inline_figures.py shows it in a real kernel)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def pyplot_untouched() -> Iterator[None]:
    """Runs the block with `matplotlib.use` and `pyplot.switch_backend` replaced by recorders
    and one user figure open in pyplot; afterwards asserts that neither was called, that the
    backend setting is the one before, and that pyplot holds the same figures (the user's still
    open, none added)."""
    import matplotlib
    import matplotlib.pyplot as plt

    user = plt.figure()  # resolves the backend now, not inside the block
    try:
        backend = dict.__getitem__(matplotlib.rcParams, "backend")
        figures = plt.get_fignums()
        calls: list[str] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(matplotlib, "use", lambda *a, **k: calls.append(f"matplotlib.use{a}"))
            mp.setattr(plt, "switch_backend", lambda *a, **k: calls.append(f"switch_backend{a}"))
            yield
        assert calls == [], f"the backend was switched: {calls}"
        assert dict.__getitem__(matplotlib.rcParams, "backend") == backend
        assert plt.get_fignums() == figures, "pyplot's open figures changed"
    finally:
        plt.close(user)
