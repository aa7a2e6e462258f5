"""Progress bars that suit where the output goes.

In a terminal or a Jupyter notebook a run shows tqdm's live bar (`tqdm.auto`). When stderr is not
a terminal (a log file, a pipe, a Slurm job's output) a bar redrawn with a carriage return on
every step would fill the log with thousands of overwritten fragments; there the bar prints plain
lines instead: one when the run starts, then at most one every `LOG_INTERVAL_S` seconds, and one
at the end, each a whole line ending in a newline.

Example:
    >>> import io
    >>> log = io.StringIO()
    >>> bar = progress_bar(total=3, file=log, interval=0.0)
    >>> for _ in range(3):
    ...     _ = bar.update(1)
    >>> bar.close()
    >>> "\\r" in log.getvalue(), log.getvalue().splitlines()[-1].startswith("100% 3/3")
    (False, True)
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

LOG_INTERVAL_S = 30.0
"""Seconds between two progress lines when stderr is not a terminal (plus a first and a last)."""

LINE_FORMAT = (
    "{desc}{percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
)
"""tqdm `bar_format` of a progress line: no bar glyphs, so a log stays plain ASCII."""


class _Lines:
    """A file for tqdm that turns each redraw (carriage return + text + padding) into one line."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def in_notebook() -> bool:
    """True inside a Jupyter (IPython kernel) process, where `tqdm.auto` draws a widget."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None) if ipython is not None else None
    shell = get() if get is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress_bar(
    *, total: int, file: TextIO | None = None, interval: float = LOG_INTERVAL_S, **options: Any
):
    """A tqdm bar over `total` steps; `options` go to tqdm (`initial`, `desc`, `disable`, `unit`).

    `file` (default `sys.stderr`) decides the kind: a terminal or a notebook gets tqdm's live bar
    (`tqdm.auto`, redrawn in place, `dynamic_ncols`); anything else gets plain lines, the first
    at creation, then at most one every `interval` seconds, and the last at `close()`.

    Raises:
        ValueError: if `interval` is negative.
    """
    if interval < 0:
        raise ValueError(f"interval={interval!r} must be >= 0 (seconds between progress lines)")
    stream = sys.stderr if file is None else file
    isatty = getattr(stream, "isatty", None)
    if in_notebook() or (isatty is not None and isatty()):
        from tqdm.auto import tqdm

        return tqdm(total=total, file=file, dynamic_ncols=True, **options)
    from tqdm.std import tqdm

    if options.get("desc"):
        options["desc"] = f"{options['desc']}: "
    return tqdm(
        total=total,
        file=_Lines(stream),
        mininterval=interval,
        maxinterval=max(interval, 1.0),
        miniters=1,
        bar_format=LINE_FORMAT,
        ascii=True,
        **options,
    )
