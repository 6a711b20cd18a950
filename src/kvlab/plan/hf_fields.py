"""Reading one model family's fields out of a config.json dict.

A config.json states only what differs from its family's defaults (transformers fills the
rest from the config class), and older files spell the same field differently (`n_layer`
for `num_hidden_layers`). `Fields` hides both, and turns every bad value into one
`PlanError` line naming the field, so no KeyError or TypeError ever reaches a user.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from kvlab.plan.errors import PlanError

_REQUIRED = object()  # marks a field with no family default: the config must state it


class Fields:
    """A config dict seen through a family's defaults and legacy key names."""

    def __init__(self, config: Mapping[str, Any], defaults: Mapping[str, Any], family: str) -> None:
        self.config = config
        self.defaults = defaults
        self.family = family

    def raw(self, key: str, *aliases: str) -> Any:
        """The stated value (first of `key`, then `aliases`), else the family default."""
        for name in (key, *aliases):
            if name in self.config:
                return self.config[name]
        value = self.defaults.get(key, _REQUIRED)
        if value is _REQUIRED:
            raise PlanError(f"{self.family} config lacks required field {key!r}")
        return value

    def has(self, key: str, *aliases: str) -> bool:
        return any(name in self.config for name in (key, *aliases))

    def size(self, key: str, *aliases: str) -> int:
        """A positive integer (layers, heads, widths)."""
        value = self._integer(key, self.raw(key, *aliases))
        if value <= 0:
            raise PlanError(f"{key} must be a positive integer, got {value}")
        return value

    def count(self, key: str, *aliases: str) -> int:
        """A non-negative integer (dense-layer counts, shared experts)."""
        value = self._integer(key, self.raw(key, *aliases))
        if value < 0:
            raise PlanError(f"{key} must be a non-negative integer, got {value}")
        return value

    def optional_size(self, key: str, *aliases: str) -> Optional[int]:
        """A positive integer, or None where the config says null (or the family default is None)."""
        value = self.raw(key, *aliases)
        return None if value is None else self.size(key, *aliases)

    def flag(self, key: str, *aliases: str) -> bool:
        value = self.raw(key, *aliases)
        if not isinstance(value, bool):
            raise PlanError(f"{key} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        """A list of non-negative integers (layer indices)."""
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(item) and item >= 0 for item in value):
            raise PlanError(f"{key} must be a list of layer indices, got {value!r}")
        return value

    @staticmethod
    def _integer(key: str, value: Any) -> int:
        if not _is_int(value):
            raise PlanError(f"{key} must be a positive integer, got {value!r}")
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
