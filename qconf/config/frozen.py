"""``FrozenDict``: the immutable, hashable, picklable mapping the config dataclasses hold
(``types.MappingProxyType`` neither hashes nor pickles)."""
from __future__ import annotations

from typing import Any, Iterator, Mapping

__all__ = ["FrozenDict"]


class FrozenDict(Mapping):
    """A read-only dict: equal to any mapping with the same items, hashable, picklable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._data = dict(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"
