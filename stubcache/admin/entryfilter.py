"""Selecting and ordering scanned entries (:class:`stubcache.admin.scan.EntryRecord`): the ``--filter``
language and the ``--sort`` orders of ``stubcache ls``. Pure functions over scan records."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

FIELDS = ("size", "accessed", "used", "created", "age", "name", "torch", "method", "in_use", "key")
_FILTER_RE = re.compile(r"\s*([a-z_]+)\s*(>=|<=|!=|==|=|>|<)\s*(.*?)\s*\Z")

Filter = Callable[[Any, float], bool]
"""A predicate over ``(entry, now)``."""

SORTS: dict[str, Callable[[Any], Any]] = {
    "key": lambda e: e.key, "name": lambda e: (e.name, e.key), "size": lambda e: (e.size, e.key),
    "created": lambda e: (e.created, e.key), "used": lambda e: (e.last_used, e.key),
}
"""``--sort`` field -> sort key; ties are broken by the entry key."""


class FilterError(ValueError):
    """A filter expression that does not parse; the message says what is accepted."""


def parse_filter(text: str) -> Filter:
    """``size>1M``, ``accessed>30d`` (not used for 30 days), ``created<2h``, ``name=alloc*``,
    ``torch=2.13.0+cpu``, ``method=direct``, ``in_use=yes``, ``key=ab12*`` (a spec key or an entry key)."""
    from ..edge.units import parse_duration, parse_size

    m = _FILTER_RE.match(text)
    if not m or m.group(1) not in FIELDS:
        raise FilterError(f"bad filter {text!r}: use FIELD OP VALUE with FIELD one of "
                          f"{', '.join(FIELDS)} and OP one of > < >= <= = !=")
    fld, op, raw = m.groups()
    op = "=" if op == "==" else op
    try:
        if fld == "size":
            value: Any = parse_size(raw)
            get: Callable[[Any, float], Any] = lambda e, now: e.size
        elif fld in ("accessed", "used"):
            value = parse_duration(raw)
            get = lambda e, now: now - e.last_used
        elif fld in ("created", "age"):
            value = parse_duration(raw)
            get = lambda e, now: now - e.created
        elif fld == "in_use":
            value = raw.lower() in ("1", "yes", "true", "y")
            get = lambda e, now: bool(e.in_use)
        else:
            value = raw
            attr = {"method": "build_method"}.get(fld, fld)
            get = lambda e, now: str(getattr(e, attr) or "")
    except ValueError as exc:
        raise FilterError(str(exc)) from None
    if isinstance(value, str):
        if op not in ("=", "!="):
            raise FilterError(f"filter {text!r}: {fld} only supports = and != (with * wildcards)")
        import fnmatch

        want = op == "="
        if fld == "key":  # either kind of key: the entry key or the spec key it was built from
            value = value.lower()
            return lambda e, now: any(fnmatch.fnmatchcase(k or "", value)
                                      for k in (e.key, getattr(e, "base_key", ""))) == want
        return lambda e, now: fnmatch.fnmatchcase(get(e, now), value) == want
    ops: dict[str, Callable[[Any, Any], bool]] = {">": lambda a, b: a > b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b,
           "<=": lambda a, b: a <= b, "=": lambda a, b: a == b, "!=": lambda a, b: a != b}
    fn = ops[op]
    return lambda e, now: fn(get(e, now), value)


def select(entries: Iterable[Any], now: float, filters: Iterable[Filter] = (), name: str | None = None,
           sort: str = "used", reverse: bool = False) -> list[Any]:
    """The entries whose name matches the glob ``name`` and that pass every filter, in ``sort``
    order (see :data:`SORTS`)."""
    filters = list(filters)
    out = list(entries)
    if name:
        import fnmatch

        out = [e for e in out if fnmatch.fnmatchcase(e.name, name)]
    out = [e for e in out if all(f(e, now) for f in filters)]
    out.sort(key=SORTS[sort], reverse=reverse)
    return out
