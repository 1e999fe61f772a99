"""Registries of pluggable parts: ``Registry`` for named objects (attention and weight-sync backends), and
``ComponentRegistry`` for the configured components (rewards, losses, advantages, packers).

YAML names a component by its registered name or by an import path ``"pkg.module:attr"`` for user code. A
component is a class of its kind (``ComponentRegistry.base``) that declares ``Options``, a dataclass of what
YAML may set: ``ComponentRegistry.build`` makes the options from the remaining YAML keys (a misspelt key fails
at startup listing the real ones; an Enum field takes its value's name) and returns ``cls(options)``. What a
component needs or offers (a loss's optional batch fields, an estimator's step rule) are class attributes of
its kind, read off the built object. A registry with ``call_arguments`` (rewards) also takes a plain
function, whose named keyword parameters are its options.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar


class RegistryError(ValueError):
    """A component name, import path or option that does not resolve."""


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a component that has none."""


class Component:
    """A configured component: ``options`` is its ``Options`` dataclass, built from YAML by the registry. A kind's
    base class (an ``abc.ABC``) marks what each component must define abstract: a class missing it fails at lookup."""

    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None) -> None:
        self.options = self.Options() if options is None else options

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


T = TypeVar("T")
C = TypeVar("C")


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
    """Named objects of one kind (attention backends, weight-sync backends); ``kind`` appears in every error."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(entry: T) -> T:
            if name in self._entries:
                raise RegistryError(f"{self.kind} '{name}' is already registered")
            self._check(name, entry)
            self._entries[name] = entry
            return entry

        return decorator

    def _check(self, name: str, entry: Any) -> None:
        """Refuse an entry that is not of this registry's kind (any object here)."""

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
        if not is_import_path(name):
            known = ", ".join(self.names()) or "(none)"
            raise RegistryError(f"unknown {self.kind} '{name}' (known: {known}; or use 'package.module:attr')")
        obj = import_object(name)
        self._check(name, obj)
        return obj


class ComponentRegistry(Registry[Any], Generic[C]):
    """Component classes of one kind (subclasses of ``base``, each with an ``Options`` dataclass), built from a
    YAML mapping by ``build``."""

    def __init__(self, kind: str, base: type, call_arguments: tuple[str, ...] | None = None) -> None:
        """``call_arguments``: set for a kind that may also be a plain function (rewards): the parameters the
        caller fills (its ``**kwargs`` catch-all receives the rest), so its options are its other named ones."""
        super().__init__(kind)
        self.base = base
        self.call_arguments = call_arguments

    def _check(self, name: str, entry: Any) -> None:
        if isinstance(entry, type) and issubclass(entry, self.base) and dataclasses.is_dataclass(entry.Options):
            if inspect.isabstract(entry):
                missing = ", ".join(sorted(entry.__abstractmethods__))
                raise RegistryError(f"{self.kind} '{name}' ({entry.__name__}) must define {missing}, as every "
                                    f"{self.base.__name__} does")  # fmt: skip
            return
        if self.call_arguments is not None and callable(entry) and not isinstance(entry, type):
            return
        functions = " or a function" if self.call_arguments is not None else ""
        raise RegistryError(f"{self.kind} '{name}' is not a {self.base.__name__} subclass with an Options "
                            f"dataclass{functions}")  # fmt: skip

    def build(self, spec: Mapping[str, Any] | str) -> C:
        """The component ``spec['name']`` configured with the other keys."""
        if isinstance(spec, str):
            spec = {"name": spec}
        params = dict(spec)
        if "name" not in params:
            raise RegistryError(f"{self.kind} config needs a 'name' key (got keys: {', '.join(params) or 'none'})")
        name = str(params.pop("name"))
        component = self.get(name)
        label = f"{self.kind} '{name}'"
        if isinstance(component, type):
            return component(make_options(component.Options, params, label))
        check_params(component, params, label, self.call_arguments or ())
        return functools.partial(component, **params) if params else component  # type: ignore[return-value]


def make_options(options: type, params: Mapping[str, Any], label: str) -> Any:
    """The ``options`` dataclass from YAML keys: an unknown key lists the real ones, an Enum field takes the
    name of a member, and a value its ``__post_init__`` refuses fails naming the component."""
    fields = {f.name: f for f in dataclasses.fields(options) if f.init}
    unknown = [key for key in params if key not in fields]
    if unknown:
        raise RegistryError(f"{label} has no parameter '{unknown[0]}' (has: {', '.join(fields) or 'none'})")
    hints = typing.get_type_hints(options)
    values = {key: enum_member(hints[key], value, key, label) for key, value in params.items()}
    try:
        return options(**values)
    except (TypeError, ValueError) as exc:
        raise RegistryError(f"{label}: {exc}") from exc


def enum_member(annotation: Any, value: Any, key: str, label: str) -> Any:
    """``value`` as a member of the Enum ``annotation`` (or of the Enum in ``Enum | None``); others unchanged."""
    candidates = [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type)]
    kind = next((a for a in candidates if issubclass(a, enum.Enum)), None)
    if kind is None or value is None or isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in kind)
        raise RegistryError(f"{label}: {key}={value!r} must be one of {allowed}") from None


def check_params(
    component: Callable[..., Any], params: Mapping[str, Any], label: str, call_arguments: tuple[str, ...]
) -> None:  # fmt: skip
    """Raise if ``params`` are not named parameters of the function ``component`` other than ``call_arguments``
    (its ``**kwargs`` receives call-time values, so a misspelt option must not vanish there)."""
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):
        return
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    allowed = [p.name for p in signature.parameters.values() if p.kind in named and p.name not in call_arguments]
    unknown = [key for key in params if key not in allowed]
    if unknown:
        raise RegistryError(f"{label} has no parameter '{unknown[0]}' (has: {', '.join(allowed) or 'none'})")
