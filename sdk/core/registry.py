"""One registry mechanism for everything chosen by name (losses, verifiers, tasks).

Example:
    >>> colours = Registry("colour")
    >>> @colours.register("red")
    ... def red(shade: int = 1):
    ...     return ("red", shade)
    >>> colours.build("red", shade=2)
    ('red', 2)
    >>> colours.build("blue")
    Traceback (most recent call last):
    ...
    ValueError: unknown colour 'blue'; registered colours: red
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Factories by name, with one signature: `build(name, **options) -> factory(**options)`.

    Args:
        kind: what is registered, for messages ("loss", "verifier", "task").
        load_builtins: called before a lookup, to import the modules that register the built-in
            names (lazily, so importing the registry's module stays cheap).

    Registering the same definition again (same module and qualified name: a notebook cell run
    twice, a reloaded module) replaces it; registering another definition under a taken name
    raises ValueError. An unknown name raises ValueError listing the registered names.
    """

    def __init__(self, kind: str, *, load_builtins: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self._factories: dict[str, F] = {}
        self._load_builtins = load_builtins

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(factory: F) -> F:
            taken = self._factories.get(name)
            if taken is not None and _identity(taken) != _identity(factory):
                raise ValueError(f"{self.kind} {name!r} is already registered (by {taken!r}); "
                                 "choose another name")
            self._factories[name] = factory
            return factory
        return decorator

    def build(self, name: str, /, **options: Any) -> Any:
        if self._load_builtins is not None:
            self._load_builtins()
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; registered {_plural(self.kind)}: "
                             f"{', '.join(sorted(self._factories))}")
        return self._factories[name](**options)

    def names(self) -> tuple[str, ...]:
        if self._load_builtins is not None:
            self._load_builtins()
        return tuple(self._factories)


def _plural(noun: str) -> str:
    """English plural of a registry kind: loss -> losses, verifier -> verifiers."""
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in tuple("aeiou"):
        return noun[:-1] + "ies"
    return noun + "s"


def _identity(factory: Any) -> tuple[str | None, str | None]:
    return getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
