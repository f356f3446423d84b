"""Every setting a person can make, in one place: the ``STUBCACHE_*`` environment variables
(:data:`VARIABLES`: names, what each is, whether a hit through a record may run under it; the
``--help`` list and docs/cli.md's table are rendered from :data:`ROWS`) and the settings kept in a
root's ``stubcache-root.json`` (:data:`ROOT_SETTINGS`), with their parsers and checks.

A :class:`~stubcache.StubCache` checks the environment when it is made, the CLI when it starts,
and ``doctor`` reports every malformed variable. The remote tier's variables are named here and
checked together by :func:`stubcache.remote.config.config_from_env` (a URL, a mode and a secret
are valid only together, and only with the backend's client installed). Cheap: a few dict
lookups, and nothing imported unless a variable is set (the hit path never pays for a size
parser it does not need).
"""

from __future__ import annotations

import os

from .errors import StubCacheError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any, Callable, Mapping

DIR = "STUBCACHE_DIR"
MAX_SIZE = "STUBCACHE_MAX_SIZE"
LOCK_TIMEOUT = "STUBCACHE_LOCK_TIMEOUT"
SEED_DIRS = "STUBCACHE_SEED_DIRS"
REQUIRE_HIT = "STUBCACHE_REQUIRE_HIT"
TRUSTED_ROOTS = "STUBCACHE_TRUSTED_ROOTS"
PATCH_TORCH = "STUBCACHE_PATCH_TORCH"
FAULT = "STUBCACHE_FAULT"
REMOTE = "STUBCACHE_REMOTE"
REMOTE_MODE = "STUBCACHE_REMOTE_MODE"
REMOTE_SECRET = "STUBCACHE_REMOTE_SECRET"
REMOTE_TIMEOUT = "STUBCACHE_REMOTE_TIMEOUT"
REMOTE_INSECURE = "STUBCACHE_REMOTE_INSECURE"
REMOTE_LEASE = "STUBCACHE_REMOTE_LEASE"


class Variable:
    """One ``STUBCACHE_*`` variable. ``full_path``: a hit through a hit record cannot run under it
    (the full path validates it, or it changes what a hit means); the compact hit path
    (:data:`stubcache.hit.FULL_PATH_SETTINGS`) keeps the same list without importing this
    module, and a test holds the two equal."""

    __slots__ = ("name", "full_path")

    def __init__(self, name: str, *, full_path: bool) -> None:
        self.name = name
        self.full_path = full_path


VARIABLES = (
    Variable(DIR, full_path=False),  # the root a record is found under
    Variable(MAX_SIZE, full_path=True),
    Variable(LOCK_TIMEOUT, full_path=True),
    Variable(SEED_DIRS, full_path=True),
    Variable(REQUIRE_HIT, full_path=False),  # a hit is a hit; the hit path rejects a malformed value
    Variable(TRUSTED_ROOTS, full_path=True),
    Variable(PATCH_TORCH, full_path=False),  # read by `stubcache run`'s start-up hook only
    Variable(FAULT, full_path=True),  # the crash tests' kill points (not documented for users)
    *(Variable(n, full_path=True) for n in (REMOTE, REMOTE_MODE, REMOTE_SECRET, REMOTE_TIMEOUT,
                                            REMOTE_INSECURE, REMOTE_LEASE)),
)


class Row:
    """One row of the ``--help`` environment list and of docs/cli.md's table: the variables it is
    about, its one-line help (``--help``; ``\n`` where the line wraps) and its documentation."""

    __slots__ = ("names", "help", "doc")

    def __init__(self, names: tuple[str, ...], help: str, doc: str) -> None:
        self.names = names
        self.help = help
        self.doc = doc


ROWS = (
    Row((DIR,), "cache root (default: the platform cache directory, see `stubcache dir`)",
        "the cache root (overridden by `--cache-dir`)."),
    Row((MAX_SIZE,), "size cap kept after each publish (default 2G; e.g. 10G, or off for\nnone); also `stubcache config`",
        "the size cap (e.g. `10G`, or `off` for none) enforced after each publish; the smaller of it and the "
        "root's `max_size` applies, and with neither set every root has the default cap of 2 GiB (see `config`)."),
    Row((LOCK_TIMEOUT,), "seconds (or a duration: 10m) to wait for another process's build\n(default 600), then build privately",
        "seconds (or a duration: `10m`) a process waits for another process's build of the same key (default "
        "600); after that it builds privately without publishing. `doctor` reports a malformed value as an error."),
    Row((SEED_DIRS,), "read-only caches searched first (':'-separated), e.g. baked into an image",
        "`os.pathsep`-separated read-only stores consulted before the writable root (e.g. baked into an image "
        "with `stubcache --cache-dir /opt/stubs warm ...`). The CLI commands act on one root only: point "
        "`--cache-dir` at a seed store to list or verify it."),
    Row((REQUIRE_HIT,), "1: fail (CacheMissError) instead of compiling on a miss",
        "`1`/`true`/`yes`/`on`: a miss raises `stubcache.CacheMissError` instead of compiling (prebuilt "
        "containers). `stubcache warm` ignores it, since warming is how such a cache gets filled."),
    Row((TRUSTED_ROOTS,), "roots owned by others that you trust (':'-separated)",
        "`os.pathsep`-separated roots you trust although neither you nor root owns them (also one per line in "
        "`~/.config/stubcache/trusted-roots`); `doctor` says whether you trust the root and how to "
        "([security.md](security.md#which-roots-a-process-uses-trust-is-anchored-in-the-loading-user))."),
    Row((PATCH_TORCH,), "set by `stubcache run`: patch torch's loaders at start-up",
        "set by `stubcache run` for its start-up hook."),
    Row((REMOTE, REMOTE_MODE, REMOTE_SECRET, REMOTE_TIMEOUT, REMOTE_INSECURE, REMOTE_LEASE),
        "the optional fleet-wide remote tier",
        "the fleet tier ([remote.md](remote.md#settings)); `ls`/`prune --remote`, `stats` and `doctor` read them."),
    Row(("CXX",), "the compiler (default c++), part of every key",
        "the compiler; part of every key. `prune --toolchain-mismatch` and `doctor` use the current value."),
)
NAME_WIDTH = 25  # the --help list's name column


def help_text() -> str:
    """The ``environment:`` list of ``stubcache --help``."""
    out = []
    for row in ROWS:
        lines = row.help.split("\n")
        if len(row.names) == 1:
            out.append(f"  {row.names[0]:<{NAME_WIDTH}}{lines[0]}")
            out += [" " * (NAME_WIDTH + 2) + line for line in lines[1:]]
            continue
        names, line = [f"{n}," for n in row.names[:-1]] + [row.names[-1]], "  "
        for name in names:  # a group: its names wrapped at 94 columns, then its help
            if len(line) + len(name) > 94:
                out.append(line.rstrip())
                line = "  "
            line += name + " "
        out.append(line.rstrip() + "  " + " ".join(lines))
    return "\n".join(out)


def doc_table() -> str:
    """docs/cli.md's table of environment variables."""
    out = ["| variable | effect |", "|---|---|"]
    for row in ROWS:
        names = ", ".join(f"`{n}`" for n in row.names) if len(row.names) < 3 else f"`{row.names[0]}`, `{REMOTE}_*`"
        out.append(f"| {names} | {row.doc} |")
    return "\n".join(out)


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


def root_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """``STUBCACHE_DIR`` as set (``None`` when unset or empty)."""
    return (os.environ if environ is None else environ).get(DIR) or None


def path_list(name: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """An ``os.pathsep``-separated list of paths (``STUBCACHE_SEED_DIRS``,
    ``STUBCACHE_TRUSTED_ROOTS``), empty items dropped."""
    raw = (os.environ if environ is None else environ).get(name, "")
    return [p for p in raw.split(os.pathsep) if p.strip()]


def require_hit(environ: Mapping[str, str] | None = None) -> bool:
    """``STUBCACHE_REQUIRE_HIT``: a miss raises instead of building."""
    return flag(REQUIRE_HIT, environ)


def remote_configured(environ: Mapping[str, str] | None = None) -> bool:
    """``STUBCACHE_REMOTE`` names a remote store (its settings are checked by
    :func:`stubcache.remote.config.config_from_env`)."""
    return bool((os.environ if environ is None else environ).get(REMOTE, "").strip())


def lock_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``STUBCACHE_LOCK_TIMEOUT`` in seconds (default 600)."""
    raw = (os.environ if environ is None else environ).get(LOCK_TIMEOUT)
    if raw is None or raw.strip() == "":
        return DEFAULT_LOCK_TIMEOUT
    return seconds(LOCK_TIMEOUT, raw)


def max_size(environ: Mapping[str, str] | None = None) -> int | None:
    """``STUBCACHE_MAX_SIZE`` in bytes, or ``None`` when unset or ``off`` (no cap; which of
    the two it is, ``sizecap.env_cap`` tells apart)."""
    raw = (os.environ if environ is None else environ).get(MAX_SIZE, "")
    if not raw.strip() or raw.strip().lower() == "off":
        return None
    from .units import parse_size

    try:
        return parse_size(raw)
    except ValueError:
        raise SettingsError(MAX_SIZE, raw,
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
    LOCK_TIMEOUT: lock_timeout,
    MAX_SIZE: max_size,
    REQUIRE_HIT: require_hit,
    REMOTE_INSECURE: lambda env: flag(REMOTE_INSECURE, env),
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


# --- the root's own configuration (stubcache-root.json) ------------------------------------------

#: The cap of a root nobody configured (docs/cache.md#size-cap): room for ~1500 torch-header
#: entries (~1.3 MiB each) or tens of thousands of header-free ones (15-50 KiB), far more than
#: the working set of any host, yet a bound on what names that embed a pid pile up.
DEFAULT_MAX_SIZE = 2 << 30
NO_CAP = "off"  # the value that turns the cap off, in STUBCACHE_MAX_SIZE or `config set max_size`
DEFAULT_TOOLCHAIN_MAX_AGE = 30 * 86400.0


def parse_cap(text: Any) -> int | None:
    """A cap in bytes, or ``None`` for :data:`NO_CAP`."""
    from .units import parse_size

    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    if not isinstance(text, str):
        raise ValueError(f"bad size {text!r}")
    if text.strip().lower() == NO_CAP:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ValueError(f"{exc}; or {NO_CAP!r} for no cap") from None


def parse_age(text: Any) -> float:
    from .units import parse_duration

    if isinstance(text, (int, float)) and not isinstance(text, bool) and text >= 0:
        return float(text)
    if not isinstance(text, str):
        raise ValueError(f"bad duration {text!r}")
    return parse_duration(text)


#: the settings a root's configuration holds (``stubcache config``): name -> parser of the stored value
ROOT_SETTINGS: dict[str, Callable[[Any], Any]] = {"max_size": parse_cap, "toolchain_max_age": parse_age}
