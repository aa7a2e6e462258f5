"""Checking that what travels to and from a job pickles, before it has to: `launch` checks the
function and its config (`_check_pickles`, raising `LaunchPickleError` before anything is
submitted or written), and each job checks its function's return value (`_check_result_pickles`).
Both name the innermost attribute at fault (e.g. `cfg.tokenizer._lock`), found by walking what
cloudpickle would pickle: items, fields, attributes, closures, globals and defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import cloudpickle

__all__ = ["LaunchPickleError"]

_FIX = (
    "define it in the notebook, or make its module importable on the cluster, or pass a "
    "path/name instead of the live object (e.g. a tokenizer's folder, not the tokenizer)"
)


class LaunchPickleError(TypeError):
    """The function or its config cannot be pickled, so it cannot be sent to a job. Raised
    before anything is submitted or written; the message names the innermost object at fault."""


def _check_result_pickles(result: Any) -> None:
    """Raise TypeError naming what in `result` cannot be pickled (else submitit fails to write
    the result file, leaves a temp file behind and reports that the job produced no output)."""
    try:
        cloudpickle.dumps(result)
    except Exception:  # noqa: BLE001 - any pickling failure
        path, obj, err = _find_unpicklable(result, "result")
        where = "" if path == "result" else f" ({path} is a {_type_name(obj)})"
        raise TypeError(
            f"the job's function returned a {_type_name(result)} that cannot be pickled{where}, "
            f"so it cannot be sent back ({type(err).__name__}: {err}). "
            "Return plain data (numbers, strings, lists, dicts, tensors, DataFrames), or save "
            "live objects (models, generators, open files) under out_dir and return the path."
        ) from None


def _pickle_error(obj: Any) -> Exception | None:
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception as e:  # noqa: BLE001 - TypeError, PicklingError, RecursionError, ...
        return e


def _find_unpicklable(
    obj: Any, path: str, depth: int = 0, seen: set[int] | None = None
) -> tuple[str, Any, Exception]:
    """(attribute path, object, error) of the innermost part of `obj` that fails to pickle;
    `obj` itself if none of its parts fails alone."""
    seen = set() if seen is None else seen
    err = _pickle_error(obj)
    if err is None:
        raise ValueError(f"{path} pickles")
    if depth < 16:
        for child_path, child in _parts(obj, path):
            if id(child) in seen:
                continue
            seen.add(id(child))
            if _pickle_error(child) is not None:
                return _find_unpicklable(child, child_path, depth + 1, seen)
    return path, obj, err


def _parts(obj: Any, path: str):
    """(path, part) of what pickling `obj` pickles too: items, fields, attributes; for functions
    pickled by value, the closure, the globals they use and the defaults."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{path}[{k!r}]", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"{path}[{i}]", v
    elif isinstance(obj, functools.partial):
        yield f"{path}.func", obj.func
        yield from _parts(obj.args, f"{path}.args")
        yield from _parts(obj.keywords, f"{path}.keywords")
    elif isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
        yield f"{path}.__func__", obj.__func__
    elif isinstance(obj, types.FunctionType):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f"{path}.__closure__[{name!r}]", cell.cell_contents
            except ValueError:  # empty cell
                pass
        for name in sorted(_global_names(obj.__code__)):
            if name in obj.__globals__:
                yield f"{path}.__globals__[{name!r}]", obj.__globals__[name]
        for i, v in enumerate(obj.__defaults__ or ()):
            yield f"{path}.__defaults__[{i}]", v
        for k, v in (obj.__kwdefaults__ or {}).items():
            yield f"{path}.__kwdefaults__[{k!r}]", v
    elif not isinstance(obj, type):
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                if hasattr(obj, f.name):
                    yield f"{path}.{f.name}", getattr(obj, f.name)
        for k, v in getattr(obj, "__dict__", {}).items():
            yield f"{path}.{k}", v
        for k in getattr(type(obj), "__slots__", ()):
            if isinstance(k, str) and hasattr(obj, k):
                yield f"{path}.{k}", getattr(obj, k)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_pickles(call: Any, what: str) -> None:
    """Raise LaunchPickleError naming the innermost unpicklable part of the target or the cfg
    of `call` (a `posttrain.launch.submit._Call`)."""
    if _pickle_error(call) is None:
        return
    for root, obj in (("target", call.target), ("cfg", call.cfg)):
        if _pickle_error(obj) is not None:
            path, bad, err = _find_unpicklable(obj, root)
            raise LaunchPickleError(
                f"cannot send {what} to the job: {path} ({_type_name(bad)}) cannot be pickled "
                f"({type(err).__name__}: {err}). submitit ships the function and its config to the "
                f"job with cloudpickle; {_FIX}."
            )
    raise LaunchPickleError(f"cannot send {what} to the job: {_pickle_error(call)}; {_FIX}.")
