"""Policies by name: ``@register`` adds a policy class to ``REGISTRY`` (every policy module
registers its classes when imported; :func:`kvjax.eviction.policies.make_policy` builds one)."""

from __future__ import annotations

REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` available by ``cls.name`` in configs and the CLI."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: {cls.__name__} needs a class attribute name = '...'")
    if name in REGISTRY and REGISTRY[name] is not cls and REGISTRY[name].__qualname__ != cls.__qualname__:
        raise ValueError(f"register: the policy name {name!r} is taken by {REGISTRY[name].__qualname__}")
    REGISTRY[name] = cls
    return cls
