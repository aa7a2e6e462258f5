"""One registry mechanism for everything chosen by name (losses, verifiers, tasks).

A registry lives in the layer that defines the protocol; the built-in names are registered by
the higher layer that defines them, when that package is imported (`posttrain.verifiers`,
`posttrain.envs`, `posttrain.preference`), so no lower layer imports a higher one.

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

import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Registry"]

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Factories by name, with one signature: `build(name, **options) -> factory(**options)`.

    Args:
        kind: what is registered, for messages ("loss", "verifier", "task").
        builtins_hint: appended to the unknown-name error, saying which import registers the
            built-in names (e.g. "the built-in verifiers register on `import posttrain.verifiers`").

    Registering the same definition again (same module and qualified name: a notebook cell run
    twice, a reloaded module) replaces it with a `UserWarning`; registering another definition
    under a taken name raises ValueError. An unknown name raises ValueError listing the
    registered names.

    Example (a notebook cell run twice):
        >>> shapes = Registry("shape")
        >>> def cell():  # each run of the cell defines a new function with the same name
        ...     def square():
        ...         return 4
        ...     return square
        >>> _ = shapes.register("square")(cell())
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = shapes.register("square")(cell())
        >>> print(caught[0].message)
        shape 'square' registered again by the same definition (...square); the new one replaces it
    """

    def __init__(self, kind: str, *, builtins_hint: str | None = None) -> None:
        self.kind = kind
        self._factories: dict[str, F] = {}
        self._hint = builtins_hint

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(factory: F) -> F:
            taken = self._factories.get(name)
            if taken is not None and taken is not factory:
                if _identity(taken) != _identity(factory):
                    raise ValueError(
                        f"{self.kind} {name!r} is already registered (by {taken!r}); "
                        "choose another name"
                    )
                warnings.warn(
                    f"{self.kind} {name!r} registered again by the same definition "
                    f"({'.'.join(filter(None, _identity(factory)))}); the new one "
                    "replaces it",
                    UserWarning,
                    stacklevel=2,
                )
            self._factories[name] = factory
            return factory

        return decorator

    def build(self, name: str, /, **options: Any) -> Any:
        if name not in self._factories:
            hint = f" ({self._hint})" if self._hint else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered {_plural(self.kind)}: "
                f"{', '.join(sorted(self._factories)) or 'none'}{hint}"
            )
        return self._factories[name](**options)

    def names(self) -> tuple[str, ...]:
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
