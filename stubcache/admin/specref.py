"""Resolving spec references given on the command line (``warm``, ``explain``).

A reference is either

* a path to a JSON file holding one :meth:`StubSpec.to_json` object or a list of them, or
* ``MODULE:ATTR`` (``ATTR`` may be dotted) naming an importable :class:`StubSpec`, a list or
  tuple of them, or a zero-argument callable returning either, e.g. ``kvarena.stub:allocator_spec``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from typing import Any

from ..key import StubSpec

_REF_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*\Z")


class SpecRefError(ValueError):
    """A spec reference could not be resolved; the message says why."""


def is_module_ref(text: str) -> bool:
    return bool(_REF_RE.match(text)) and not os.path.exists(text)


def _coerce(value: Any, origin: str) -> list[StubSpec]:
    if isinstance(value, StubSpec):
        return [value]
    if isinstance(value, dict):
        try:
            return [StubSpec.from_dict(value)]
        except (TypeError, ValueError) as exc:
            raise SpecRefError(f"{origin}: invalid spec: {exc}") from None
    if isinstance(value, (list, tuple)):
        out: list[StubSpec] = []
        for item in value:
            if isinstance(item, (list, tuple)):
                raise SpecRefError(f"{origin}: nested lists are not specs")
            out += _coerce(item, origin)
        if not out:
            raise SpecRefError(f"{origin}: an empty list of specs")
        return out
    raise SpecRefError(f"{origin}: expected a StubSpec, a spec object or a list of them, "
                       f"got {type(value).__name__}")


def load_spec_file(path: str) -> list[StubSpec]:
    """Specs from a JSON file (one ``StubSpec.to_json`` object or a list of them)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise SpecRefError(f"cannot read spec file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SpecRefError(f"spec file {path} is not valid JSON: {exc}") from None
    return _coerce(data, path)


def load_module_ref(ref: str) -> list[StubSpec]:
    """Specs from ``MODULE:ATTR``, imported from ``sys.path`` as it is: the current directory is
    *not* added (a module planted in whatever directory an administrator runs ``stubcache warm``
    from must not run; set ``PYTHONPATH`` to import from a directory on purpose)."""
    modname, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(modname)
    except ImportError as exc:
        raise SpecRefError(f"{ref}: cannot import {modname!r}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SpecRefError(f"{ref}: {modname!r} has no attribute {attr!r}") from None
    if callable(obj) and not isinstance(obj, StubSpec):
        try:
            obj = obj()
        except TypeError as exc:
            raise SpecRefError(f"{ref}: calling it with no arguments failed: {exc}") from None
    return _coerce(obj, ref)


def load_specs(ref: str) -> list[StubSpec]:
    """Resolve one reference: an existing file path, else ``MODULE:ATTR``."""
    if os.path.exists(ref) or not _REF_RE.match(ref):
        return load_spec_file(ref)
    return load_module_ref(ref)
