"""Reading and merging values of a traitlets ``Config`` section without clobbering the user's.

Why: ``c.KubeSpawner.volumes`` may be unset, a plain list or dict, or a ``LazyConfigValue``
(``c.KubeSpawner.volumes.append(...)`` in an earlier line). Our helpers add their entries by
name and leave everything else as the operator wrote it, so applying a helper twice, or after
other configuration, changes nothing it does not own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traitlets.config import Config
from traitlets.config.loader import LazyConfigValue

__all__ = ["current", "merged_dict", "with_named"]


def current(section: Config, name: str, empty: Any) -> Any:
    """The value configured for ``name`` (``empty`` if none), with lazy edits applied."""
    value = section.get(name)
    if value is None:
        return empty
    if isinstance(value, LazyConfigValue):
        return value.get_value(empty)
    return value


def merged_dict(section: Config, name: str, ours: Mapping[str, Any]) -> dict[str, Any]:
    """The configured dict with ``ours`` set over it (a new dict; the old one is not touched)."""
    existing = current(section, name, {})
    if not isinstance(existing, Mapping):
        raise TypeError(f"{name} is configured as {type(existing).__name__}, expected a dict")
    return {**existing, **ours}


def with_named(section: Config, name: str, entry: Mapping[str, Any]) -> list[Any] | dict[str, Any]:
    """The configured list (or KubeSpawner's dict form keyed by name) with ``entry`` in it,
    replacing an entry of the same ``name`` and keeping the others in order."""
    existing = current(section, name, [])
    if isinstance(existing, Mapping):
        return {**existing, entry["name"]: dict(entry)}
    if not isinstance(existing, list):
        raise TypeError(f"{name} is configured as {type(existing).__name__}, expected a list")
    kept = [item for item in existing if not _named(item, entry["name"])]
    return [*kept, dict(entry)]


def _named(item: object, name: str) -> bool:
    return isinstance(item, Mapping) and item.get("name") == name
