"""Every setting a person can make, read and validated in one place: the ``STUBCACHE_*``
environment variables (the root's configuration is parsed in :mod:`.sizecap`, with the same
parsers from :mod:`.units`).

A :class:`~stubcache.StubCache` checks the environment when it is made, the CLI when it starts,
and ``doctor`` reports every malformed variable. Cheap: a few dict lookups, and nothing imported
unless a variable is set (the hit path never pays for a size parser it does not need).
"""

from __future__ import annotations

import os

from .errors import StubCacheError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Callable, Mapping

DEFAULT_LOCK_TIMEOUT = 600.0
_FLAG_TRUE = ("1", "true", "yes", "on")
_FLAG_FALSE = ("", "0", "false", "no", "off")
_FLAG_ACCEPTED = "1, true, yes, on (set) or 0, false, no, off, empty (unset)"


class SettingsError(StubCacheError, ValueError):
    """A setting has a value stubcache cannot use. The message names the variable, its value and
    what is accepted. A :class:`ValueError` too, as the old per-setting checks raised."""

    def __init__(self, name: str, value: str, accepted: str) -> None:
        super().__init__(f"{name}={value!r} is not valid: {accepted}")
        self.name = name
        self.value = value
        self.accepted = accepted


def seconds(name: str, raw: str, *, allow_zero: bool = True) -> float:
    """A time in an environment variable: a number of seconds (``600``, the documented unit of
    every ``*_TIMEOUT``/``*_LEASE`` variable) or a duration with a unit (``10m``)."""
    accepted = ("a number of seconds (e.g. 600) or a duration with a unit (e.g. 10m)"
                + ("" if allow_zero else ", greater than 0"))
    text = raw.strip()
    try:
        value = float(text)
    except ValueError:
        from .units import parse_duration

        try:
            value = parse_duration(text)
        except ValueError:
            raise SettingsError(name, raw, accepted) from None
    if value != value or value in (float("inf"), float("-inf")) or value < 0 or (value == 0 and not allow_zero):
        raise SettingsError(name, raw, accepted)
    return value


def lock_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``STUBCACHE_LOCK_TIMEOUT`` in seconds (default 600)."""
    raw = (os.environ if environ is None else environ).get("STUBCACHE_LOCK_TIMEOUT")
    if raw is None or raw.strip() == "":
        return DEFAULT_LOCK_TIMEOUT
    return seconds("STUBCACHE_LOCK_TIMEOUT", raw)


def max_size(environ: Mapping[str, str] | None = None) -> int | None:
    """``STUBCACHE_MAX_SIZE`` in bytes, or ``None`` when unset or ``off`` (no cap; which of
    the two it is, ``sizecap.env_cap`` tells apart)."""
    raw = (os.environ if environ is None else environ).get("STUBCACHE_MAX_SIZE", "")
    if not raw.strip() or raw.strip().lower() == "off":
        return None
    from .units import parse_size

    try:
        return parse_size(raw)
    except ValueError:
        raise SettingsError("STUBCACHE_MAX_SIZE", raw,
                            "a size with a unit: K, M, G or T (powers of 1024, e.g. 10G), or B for bytes; or off for no cap") from None


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no variable (``STUBCACHE_REQUIRE_HIT``, ``STUBCACHE_REMOTE_INSECURE``)."""
    raw = (os.environ if environ is None else environ).get(name, "")
    v = raw.strip().lower()
    if v in _FLAG_TRUE:
        return True
    if v in _FLAG_FALSE:
        return False
    raise SettingsError(name, raw, _FLAG_ACCEPTED)


#: every checked variable -> its check (each raises SettingsError; the remote tier's are checked by stubcache.remote.config)
CHECKS: dict[str, Callable[[Mapping[str, str]], object]] = {
    "STUBCACHE_LOCK_TIMEOUT": lock_timeout,
    "STUBCACHE_MAX_SIZE": max_size,
    "STUBCACHE_REQUIRE_HIT": lambda env: flag("STUBCACHE_REQUIRE_HIT", env),
    "STUBCACHE_REMOTE_INSECURE": lambda env: flag("STUBCACHE_REMOTE_INSECURE", env),
}


def problems(environ: Mapping[str, str] | None = None) -> list[StubCacheError]:
    """Every malformed setting in ``environ`` (default ``os.environ``), in a stable order."""
    env = os.environ if environ is None else environ
    out: list[StubCacheError] = []
    for check in CHECKS.values():
        try:
            check(env)
        except SettingsError as exc:
            out.append(exc)
    return out


def validate(environ: Mapping[str, str] | None = None) -> None:
    """Raise the first malformed setting's error (remote settings are checked where the remote
    tier is configured, by :func:`stubcache.remote.config.config_from_env`)."""
    env = os.environ if environ is None else environ
    for name, check in CHECKS.items():
        if name in env:  # a dict lookup per variable: nothing parsed when nothing is set
            check(env)


def root_path_problem(root: str, source: str) -> str | None:
    """Why ``root`` cannot be a cache root at all (it exists and is not a directory), or ``None``.
    ``source`` names where it came from (``STUBCACHE_DIR``, ``--cache-dir``)."""
    try:
        import stat

        st = os.stat(root)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    what = "a file" if stat.S_ISREG(st.st_mode) else "not a directory"
    return (f"{source} {root} is {what}, not a directory: point {source} at a directory "
            "(or remove the file)") if what == "a file" else f"{source} {root} is not a directory"
