"""Package re-exports loaded on first use (PEP 562 module `__getattr__`).

A package's `__init__` that re-exports names from its submodules imports all of them, and with
them torch: `import posttrain.core.threads` (which must run before torch loads) or a verifier
worker that needs only `posttrain.rewards.verifier` would pay ~1.2 s and ~300 MB for nothing.
With `lazy_exports`, `import posttrain.core` imports nothing; `from posttrain.core import
Registry` imports `posttrain.core.registry` then.

A package whose names were grouped by purpose keeps the ones it exported before importable
from it (`former`: name -> the submodule that holds it now) without listing them.

Example:
    >>> import sys
    >>> lookup, names = lazy_exports("posttrain.core", {"registry": ["Registry"]},
    ...                              former={"check_int": "checks"})
    >>> names, lookup("Registry").__name__, lookup("check_int").__name__
    (['Registry'], 'Registry', 'check_int')
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    exports: Mapping[str, Iterable[str]],
    *,
    former: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], list[str]]:
    """(`__getattr__`, `__all__`) for `package`, whose names come from its submodules.

    Args:
        package: the package's `__name__`.
        exports: submodule (relative to `package`, e.g. "checkpoint") -> the names it exports.
        former: name -> submodule, for names the package exported before they were grouped
            into their submodules: they still resolve from the package (`from package import
            NAME`), but are not in `__all__`.

    Returns:
        A module `__getattr__` that imports the submodule of a name on first lookup (and caches
        the value in the package, so later lookups are plain attribute reads), and the sorted
        list of the exported names (`former` ones left out).

    Raises:
        ValueError: if two submodules export the same name, or a former name is exported too.
        AttributeError: (from the returned function) for a name the package does not export.
    """
    where: dict[str, str] = {}
    for module, names in exports.items():
        for name in names:
            if name in where:
                raise ValueError(
                    f"{package}: {name!r} is exported by both {where[name]!r} and {module!r}"
                )
            where[name] = module
    public = sorted(where)
    for name, module in (former or {}).items():
        if name in where:
            raise ValueError(f"{package}: {name!r} is both exported and a former name")
        where[name] = module

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, public
