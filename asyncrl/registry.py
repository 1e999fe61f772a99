"""One generic registry for pluggable components (rewards, losses, advantages, packers, sync backends).

YAML names a component by its registered name or by an import path ``"pkg.module:attr"`` for user code.
``Registry.build`` binds the remaining YAML keys to the component's keyword parameters, so a misspelt
key fails at startup with the component's real parameter names.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T", bound=Callable[..., Any])


class RegistryError(ValueError):
    """A component name, import path or parameter that does not resolve."""


def import_object(path: str) -> Any:
    """Import ``"pkg.module:attr"`` (or ``"pkg.module.attr"``) and return the attribute."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RegistryError(f"'{path}' is not an import path of the form 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import module '{module_name}' for '{path}': {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RegistryError(f"module '{module_name}' has no attribute '{attr}' (from '{path}')")
        obj = getattr(obj, part)
    return obj


def is_import_path(name: str) -> bool:
    return ":" in name


class Registry(Generic[T]):
    """Named components of one kind; ``kind`` appears in every error message."""

    def __init__(self, kind: str, call_arguments: tuple[str, ...] | None = None) -> None:
        """``call_arguments``: the parameters the caller fills when it calls a component (its ``**kwargs`` catch-all
        included, e.g. a reward's dataset columns), so a configured option must be one of its other named
        parameters; None: options may be any keyword the component accepts."""
        self.kind = kind
        self.call_arguments = call_arguments
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(component: T) -> T:
            if name in self._entries:
                raise RegistryError(f"{self.kind} '{name}' is already registered")
            self._entries[name] = component
            return component

        return decorator

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        """Resolve a registered name or an import path."""
        if name in self._entries:
            return self._entries[name]
        if is_import_path(name):
            obj = import_object(name)
            if not callable(obj):
                raise RegistryError(f"{self.kind} '{name}' is not callable")
            return obj
        known = ", ".join(self.names()) or "(none)"
        raise RegistryError(f"unknown {self.kind} '{name}' (known: {known}; or use 'package.module:attr')")

    def build(self, spec: Mapping[str, Any] | str) -> T:
        """Resolve ``spec['name']`` and bind the other keys as keyword arguments (a ``functools.partial``)."""
        if isinstance(spec, str):
            spec = {"name": spec}
        params = dict(spec)
        if "name" not in params:
            raise RegistryError(f"{self.kind} config needs a 'name' key (got keys: {', '.join(params) or 'none'})")
        name = str(params.pop("name"))
        component = self.get(name)
        if not params:
            return component
        check_params(component, params, f"{self.kind} '{name}'", self.call_arguments)
        return functools.partial(component, **params)  # type: ignore[return-value]


def check_params(
    component: Callable[..., Any], params: Mapping[str, Any], label: str, call_arguments: tuple[str, ...] | None = None
) -> None:  # fmt: skip
    """Raise if ``params`` cannot be passed as keywords to ``component``; with ``call_arguments`` (see Registry)
    only its named parameters other than those are options, whether or not it also takes ``**kwargs``."""
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):
        return
    parameters = signature.parameters.values()
    if call_arguments is None and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    allowed = [p.name for p in parameters if p.kind in named and p.name not in (call_arguments or ())]
    unknown = [key for key in params if key not in allowed]
    if unknown:
        raise RegistryError(f"{label} has no parameter '{unknown[0]}' (has: {', '.join(allowed) or 'none'})")
