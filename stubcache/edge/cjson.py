"""``json.dumps``/``json.loads`` for the hit path, without importing the ``json`` package.

A hit reads a manifest and a memo and hashes a canonical JSON form, so it needs JSON; but
``import json`` also imports ``re``, ``enum``, ``functools`` and ``collections`` (about 3 ms of
a 13 ms interpreter start here). The encoder and scanner that ``json`` itself uses are C
functions in the ``_json`` extension, which imports nothing: this module calls them with the
settings ``json`` would pass, so a successful call returns exactly what ``json`` returns. Anything
else — an input the fast path does not handle, an error, another Python without ``_json`` —
is handed to ``json`` itself, so results and exceptions are ``json``'s own.
"""

from __future__ import annotations

_FLOAT_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}
_WS = " \t\n\r"  # json's WHITESPACE

try:
    from _json import encode_basestring as _c_str
    from _json import encode_basestring_ascii as _c_ascii
    from _json import make_encoder as _c_make_encoder
    from _json import make_scanner as _c_make_scanner
except ImportError:  # another implementation: json itself
    _c_make_encoder = _c_make_scanner = None  # type: ignore[misc, assignment]


class _Context:
    """The attributes ``_json.make_scanner`` reads from a ``json.JSONDecoder`` (its defaults)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _FLOAT_CONSTANTS.__getitem__


def _not_serializable(o: object) -> None:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


_scanner = None  # made on first use; shared by all callers, as json's default decoder is


def dumps(obj: object, *, sort_keys: bool = False, separators: tuple[str, str] | None = None,
          ensure_ascii: bool = True) -> str:
    """``json.dumps(obj, sort_keys=..., separators=..., ensure_ascii=...)`` (no indent)."""
    seps = separators or (", ", ": ")
    if _c_make_encoder is not None and not isinstance(obj, str):
        try:
            # What json.JSONEncoder.iterencode does for a one-shot call: a new encoder with its
            # own markers dict (check_circular), no indent, skipkeys False, allow_nan True.
            encoder = _c_make_encoder({}, _not_serializable, _c_ascii if ensure_ascii else _c_str, None,
                                      seps[1], seps[0], sort_keys, False, True)
            return "".join(encoder(obj, 0))
        except Exception:  # noqa: BLE001 - json itself raises the error (or, if it disagrees, answers)
            pass
    import json

    return json.dumps(obj, sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii)


def loads(data: str | bytes | bytearray) -> object:
    """``json.loads(data)``."""
    global _scanner
    if _c_make_scanner is not None:
        text = None
        if isinstance(data, str):
            text = data
        elif isinstance(data, (bytes, bytearray)) and data[:3] != b"\xef\xbb\xbf" and b"\x00" not in data[:4]:
            try:  # json.detect_encoding's answer for such bytes is UTF-8
                text = data.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                text = None
        if text is not None and text[:1] != "\ufeff":
            try:
                if _scanner is None:
                    _scanner = _c_make_scanner(_Context())  # type: ignore[arg-type]  # a decoder's attributes
                start = len(text) - len(text.lstrip(_WS))
                obj, end = _scanner(text, start)
                if not text[end:].strip(_WS):
                    return obj
            except Exception:  # noqa: BLE001 - json itself raises the error, see below
                # Not only StopIteration and JSONDecodeError: _json builds the latter from
                # json.decoder only if that is imported already, and else fails with SystemError.
                pass
    import json

    return json.loads(data)
