"""Registries of the seams: config value -> "module:Class", imported only when chosen, so an optional
stack (SGLang, Megatron, Ray) costs nothing to a run that does not use it."""

from __future__ import annotations

import pkgutil


def resolve(registry: dict[str, str], key: str, what: str):
    """The class registered under ``key``; a clear error naming the known keys otherwise."""
    if key not in registry:
        raise ValueError(f"unknown {what} {key!r}; known: {', '.join(sorted(registry))}")
    return pkgutil.resolve_name(registry[key])
