"""The compact hit path: a recorded hit, verified and loaded without importing the cache.

It is the hit layer's package module itself, not a module of its own: an engine process pays
~0.2 ms for every module a hit imports, whatever it holds (finding, reading, unmarshalling), and
the package is imported anyway. The fronts that ask it first are :mod:`stubcache.hit.front`
(``StubCache``) and the package ``stubcache``'s own ``load_inline``, which hands this module
its arguments (:func:`dropin_call`) and a :class:`Miss` to the full drop-in; a request with no
record yet waits here for another process serving it (:func:`request_turn`).

How a hit works, and every check it makes: the comment below (kept out of the bytecode, which
every engine process loads)."""

# An engine process pays for every module a hit imports (about 0.1–0.2 ms each after ``import torch``,
# whatever it holds), so a warm start must not import the cache, the store, the spec or the
# fingerprint only to find that the entry it loaded last time is still there. The full path
# (:mod:`stubcache.cache.core`) therefore leaves a **hit record** after it has served a request that
# qualifies (a direct build whose tracked inputs are unchanged, from a private root, see
# :meth:`stubcache.cache.core.CacheCore.remember_hit`): ``<root>/v1/state/hit-<digest>.json``, where the digest is of
# the request itself (a drop-in call's arguments, or a spec's canonical form) and of what the
# process looks like (interpreter, ``sys.path``, ``PATH``, compiler-cache variables, the uid).
#
# The record names the entry (key, library, checksum, size) and the stat signatures of everything
# the key was derived from (the fingerprint memo's validators, the key environment variables'
# values, the source files of the modules that compute keys), of the entry's tracked inputs
# (as stubcache.key.inputs checks them without reading a file) and of the entry's manifest. A hit
# through it runs the checks the full path runs, on the same objects:
#
# - the root, ``v1/``, ``entries/`` and the entry directory are each opened without following a
#   link and must pass the private trust rule (owned by this user or root, writable by no one
#   else), and the root must have no ``stubcache-root.json`` (a shared root takes the full path);
# - the record itself is read only from such a root, and only if this user or root owns it and
#   no one else can write it (a record names the library to load: it is trusted like the entry);
# - no variants of the key exist, the entry holds exactly its manifest and library, the manifest
#   is the one the record was made from (same signature; published entries are never modified);
# - the entry is pinned (a shared ``flock`` on its pin, the last-used stamp refreshed) and then
#   checked to be the entry that was opened, the library is opened without following a link,
#   trust-checked, checksummed through that descriptor, loaded by its real path, and the mapped
#   file compared with the descriptor (the direct way of :mod:`stubcache.storage.mapped`, which lives
#   here); the hit is counted.
#
# Anything unexpected (no record, a stale one, another environment, a contended pin, a setting
# that needs checking) is not an error here: the caller takes the full path, which decides and
# reports. Nothing on this path imports another stubcache module.
#
# The per-process tables (pins, verified libraries, open library descriptors, real paths, event
# file) live here so that the full path and this one share them.
#

from __future__ import annotations

import os
import stat
import sys
import time
import _thread
import threading

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from ctypes import CDLL
    from typing import Any

    from .early import Begun

LAYOUT = "v1"  # the layout directory under a root (stubcache.storage.store imports it from here)
RECORD_FORMAT = 4  # 4: signatures hold the ctime; 3: shadow rows may name ANY_PTH; 2: the key's modules moved
DROPIN_MARK = "__stubcache_dropin__"  # an attribute set on the drop-ins (stubcache.build.torchjit)
CONFIG_NAME = "stubcache-root.json"  # a root's own configuration (stubcache.storage.trust imports it from here)
MANIFEST_NAME = "manifest.json"  # an entry's record (stubcache.storage.manifest imports it from here)
# What stubcache.edge.fsroot opens with (tests/test_hit_records.py checks they agree).
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
RECORD_CAP = 1 << 20
_FS_ENCODING = sys.getfilesystemencoding()  # os.fsencode's (os.environ's names and values)
LIBRARY_CAP = 4 << 30  # stubcache.edge.fsroot.LIBRARY_CAP
LAST_USED_RESOLUTION = 1.0  # seconds: a hit rewrites a last-used stamp older than this
NEVER_HIT_ATIME_NS = 0  # a pin's atime from publish until its first hit (see Store.publish)
# The source files (under the package directory) of the modules whose code decides a key: a
# record holds only while they are unchanged (an upgrade of stubcache replaces them). A package's
# own module is its __init__.py (tests/test_hit_records.py checks that each exists).
KEY_MODULE_FILES = ("key/__init__.py", "key/flagscan.py", "edge/kpath.py", "key/fingerprint.py", "key/toolchain.py",
                    "key/derive.py", "edge/cjson.py", "storage/manifest.py", "dropin/compat.py", "__init__.py",
                    "hit/front.py", "hit/__init__.py")
# Environment variables that torch's cpp_extension, the compiler drivers (gcc, clang, nvcc) or
# the linker read when forming or running build commands and that can change the output; the
# table in docs/cache.md says what each one does. MAX_JOBS, TMPDIR and the diagnostics-only
# variables are not here: they do not change the library. (Used by the key's fingerprint; kept
# here because a start template's name holds their values: stubcache.hit.early.)
KEY_ENV_VARS = (
    "CXX", "CC", "CUDA_HOME", "CUDA_PATH", "CUDA_INC_PATH", "CUDNN_HOME", "CUDNN_PATH",
    "ROCM_HOME", "ROCM_PATH", "HIP_HOME", "PYTORCH_ROCM_ARCH", "TORCH_CUDA_ARCH_LIST",
    "TORCH_XPU_ARCH_LIST", "PYTORCH_NVCC", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN",
    "TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES", "TORCH_NO_COMPILER_WRAPPER",
    "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "GCC_EXEC_PREFIX",
    "COMPILER_PATH", "SOURCE_DATE_EPOCH", "CCC_OVERRIDE_OPTIONS", "LD_RUN_PATH", "GNUTARGET",
    "LDEMULATION", "LC_ALL", "LC_CTYPE", "LANG",
)
# stubcache.edge.settings' flag words (tests/test_hit_records.py checks that they agree)
FLAG_TRUE = ("1", "true", "yes", "on")
_FLAG_VALUES = ("", "0", "false", "no", "off") + FLAG_TRUE
# The variables stubcache reads that need the full path (each is validated there, and may change
# what a hit means). A hit through a record runs under the others: STUBCACHE_DIR (the root it
# names), a well-formed STUBCACHE_REQUIRE_HIT, STUBCACHE_PATCH_TORCH (read by `stubcache run`'s
# start-up hook, set in every engine process under it) and names stubcache does not read, which
# the full path ignores too. tests/test_hit_records.py checks this against every STUBCACHE_ name
# in the package.
FULL_PATH_SETTINGS = (b"STUBCACHE_LOCK_TIMEOUT", b"STUBCACHE_MAX_SIZE", b"STUBCACHE_SEED_DIRS",
                      b"STUBCACHE_TRUSTED_ROOTS", b"STUBCACHE_FAULT")
FULL_PATH_PREFIX = b"STUBCACHE_REMOTE"  # the fleet tier's settings

# --- per-process tables, shared with stubcache.cache.core -------------------------------------------
PROCESS_LOCK = threading.RLock()
PINS: dict[tuple[str, str], int] = {}  # (root, key) -> the pin's fd, held for the process's life
LIB_FDS: dict[str, int] = {}  # library path -> the fd it was checksummed through
REAL_PATHS: dict[str, str] = {}  # library path -> the real path it was first loaded by
VERIFIED: dict[str, tuple[int, int, int, int]] = {}  # library path -> (dev, ino, size, mtime_ns) when checksummed
_event_lock = threading.Lock()
# (root, key) of hits counted here whose entry the full path has not looked up since in this
# process: its first lookup then counts no second hit (see counted_here).
COUNTED: set[tuple[str, str]] = set()
_event_fds: dict[str, tuple[int, int]] = {}  # events dir -> (fd, pid that opened it)


def sig(st: os.stat_result) -> list[int]:
    # A file's stat signature: device, inode, size, modification and change time (a rewrite
    # whose mtime was put back, `touch -r`, `cp -p`, a tar extraction, still moves the ctime,
    # which no user can set).
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def path_sig(path: str) -> list[int] | None:
    if type(path) is not str:
        raise TypeError("a path must be str")
    try:
        return sig(os.stat(path))
    except OSError:
        return None


def torch_is(directory: object) -> bool:
    # False if this process has imported a torch from another directory than ``directory`` (the
    # one a key was derived from: None for no torch). A program that changed its working
    # directory or its import path after importing torch can be told nothing else by sys.path.
    mod = sys.modules.get("torch")
    if mod is None:
        return True
    file = getattr(mod, "__file__", None)
    return type(file) is str and os.path.dirname(file) == directory


def private_ok(st: os.stat_result) -> bool:
    # The private trust rule (stubcache.storage.trust.TrustPolicy.check without a group): not a link,
    # owned by this user or root, writable by no one else.
    return (not stat.S_ISLNK(st.st_mode) and st.st_uid in (os.geteuid(), 0)
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def load_json_bytes(data: bytes) -> object:
    json = sys.modules.get("json")
    if json is not None:
        return json.loads(data)
    from ..edge import cjson

    return cjson.loads(data)


def sha256_fd(fd: int, size: int) -> str:
    # SHA-256 of an open file's content, read from offset 0 (``size``: its expected size).
    import hashlib  # (here: `import stubcache` imports this module, and a process that never
    # loads need not pay for OpenSSL's, ~3 ms outside an engine)

    h = hashlib.sha256()
    offset = 0
    chunk_size = min(max(size, 1 << 16), 1 << 20)
    while True:
        chunk = os.pread(fd, chunk_size, offset)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        offset += len(chunk)


# --- the drop-in's module names (dropin_call and stubcache.dropin.compat share them) ---------------------

versions: dict[str, tuple[int, Any]] = {}  # name -> (version, the call it was last loaded with)
versions_lock = threading.Lock()


def frozen(value: Any) -> Any:
    # A hashable form of a load_inline argument (lists become tuples, dicts sorted items).
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, frozen(v)) for k, v in value.items()))
    return value


def versioned(name: str, call: Any) -> str:
    # The module name torch would give this call: ``name``, then ``name_v1``, ``name_v2``, ...
    # each time one process loads ``name`` with different inputs than the last time.
    #
    # A Python extension module is initialised once per interpreter per name, so a second module
    # built under the same name would come back as the first one; torch's versioner avoids that,
    # and so does this (a new name is a new key, built and cached like any other).
    #
    with versions_lock:
        cur = versions.get(name)
        if cur is None:
            cur = versions[name] = (0, call)
        elif cur[1] != call:
            cur = versions[name] = (cur[0] + 1, call)
    return name if cur[0] == 0 else f"{name}_v{cur[0]}"


# --- what a request looks like -----------------------------------------------------------------


def quick_settings() -> bool:
    # True if no setting in the environment needs the full path (:data:`FULL_PATH_SETTINGS`, the
    # fleet tier's) and ``STUBCACHE_REQUIRE_HIT``, if set, is well-formed.
    data = getattr(os.environ, "_data", None)
    if data is None:
        return False
    for name in data:
        if name.startswith(b"STUBCACHE_") and (name in FULL_PATH_SETTINGS or name.startswith(FULL_PATH_PREFIX)):
            return False
    flag = data.get(b"STUBCACHE_REQUIRE_HIT")
    return flag is None or flag.strip().lower().decode("latin-1") in _FLAG_VALUES


def default_root() -> str | None:
    # The cache root :func:`stubcache.storage.store.default_root` names, where that needs no import:
    # ``STUBCACHE_DIR``, or on Linux platformdirs' ``user_cache_dir`` rule; else ``None``.
    env = os.environ.get("STUBCACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    if sys.platform != "linux":
        return None
    # Only the cases every platformdirs release answers alike: XDG_CACHE_HOME unset or empty
    # ($HOME/.cache, HOME absolute), or a plain absolute path. A relative, padded or ~ value
    # (releases differ: verbatim, stripped or ignored) or a relative HOME is left to platformdirs.
    base = os.environ.get("XDG_CACHE_HOME", "")
    if base:
        if os.path.isabs(base) and base == base.strip() and "~" not in base:
            return os.path.join(base, "stubcache")
        return None
    home = os.environ.get("HOME", "")
    if os.path.isabs(home) and home == home.strip() and "~" not in home:
        return os.path.join(os.path.expanduser("~/.cache"), "stubcache")
    return None


def request_digest(kind: str, request: tuple[Any, ...]) -> str | None:
    # The digest that names a request's record: ``request`` (plain values only: str, bool, None,
    # int, and lists, tuples and dicts of them) with the process's interpreter, ``sys.path``,
    # ``PATH``, compiler-cache variables, ``HOME`` and ``XDG_CONFIG_HOME`` (they name a compiler
    # cache's config files) and uid. ``None`` for a request holding anything else.
    # Serialised by marshal's version 0 (no interning flags, no back-references: equal values
    # give equal bytes, and distinct ones distinct bytes), 4x faster than repr on a source text.
    if not _plain(request):
        return None
    data = getattr(os.environ, "_data", None)
    if data is None:
        return None
    import hashlib
    import marshal

    wrappers = sorted([(k, v) for k, v in data.items() if k.startswith((b"CCACHE_", b"SCCACHE_", b"BUILDCACHE_"))])
    # HOME and XDG_CONFIG_HOME name the config files a compiler cache reads (its `compiler =`);
    # a non-str sys.path entry (a pathlib.Path a program appended) by its repr.
    path = [p if type(p) is str else repr(p) for p in sys.path]
    blob = marshal.dumps((RECORD_FORMAT, kind, request, os.geteuid(), sys.executable, path, data.get(b"PATH", b""),
                          wrappers, data.get(b"HOME"), data.get(b"XDG_CONFIG_HOME")), 0)
    return hashlib.sha256(blob).hexdigest()[:32]


def _plain(value: object, depth: int = 0) -> bool:
    t = type(value)
    if t in (str, bool, int) or value is None:
        return True
    if depth > 8:
        return False
    if t in (list, tuple):
        for v in value:  # type: ignore[attr-defined]
            if not _plain(v, depth + 1):
                return False
        return True
    if t is dict:
        for k, v in value.items():  # type: ignore[attr-defined]
            if type(k) is not str or not _plain(v, depth + 1):
                return False
        return True
    return False


def record_name(digest: str) -> str:
    return f"hit-{digest}.json"


class HitRecord:
    # What a hit through a record needs, written by the full path after it served the request
    # (see the module docstring): the entry's ``key`` and ``base`` key, ``library`` (file name),
    # ``sha256`` and ``size``, the ``name`` it is counted under, the manifest's stat signature, the
    # key environment variables' values (``env``: name, value or ``None``), the ``validators``
    # (path, stat signature or ``None`` for absent) of everything the key was derived from, and
    # the entry's tracked inputs as :func:`stubcache.key.inputs.still_valid` checks them without
    # reading a file: ``tracked`` (path, signature with ctime) and ``shadows`` (directory, its
    # signature, the names that must not appear there while it differs).

    __slots__ = ("key", "base", "name", "library", "sha256", "size", "manifest", "env", "validators",
                 "tracked", "shadows", "torch")

    def __init__(self, key: str, base: str, name: str, library: str, sha256: str, size: int, manifest: list[int],
                 env: list[Any], validators: list[Any], tracked: list[Any], shadows: list[Any],
                 torch: str | None) -> None:
        self.key = key
        self.base = base
        self.name = name
        self.library = library
        self.sha256 = sha256
        self.size = size
        self.manifest = manifest
        self.env = env
        self.validators = validators
        self.tracked = tracked
        self.shadows = shadows
        self.torch = torch  # the torch directory the key was derived from (None: no torch)

    def to_dict(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, **{k: getattr(self, k) for k in self.__slots__}}

    @classmethod
    def from_dict(cls, data: object) -> "HitRecord | None":
        # The record in ``data`` (as read from a file), or ``None`` if it is not a well-formed
        # one of this format.
        if type(data) is not dict or data.get("format") != RECORD_FORMAT:
            return None
        key, base, name, library, sha, size = (data.get(k) for k in ("key", "base", "name", "library", "sha256",
                                                                     "size"))
        for text in (key, base, name, library, sha):
            if type(text) is not str or not text or "/" in text or "\0" in text or text in (".", ".."):
                return None
        if not (key.isascii() and key.isalnum() and base.isascii() and base.isalnum() and name.isascii()  # type: ignore[union-attr]
                and name.isidentifier()):  # type: ignore[union-attr]  # str: the loop above checked
            return None
        if type(size) is not int or size < 0 or not _ints(data.get("manifest"), 5):
            return None
        env, validators, tracked, shadows = (data.get(k) for k in ("env", "validators", "tracked", "shadows"))
        if not (type(env) is list and type(validators) is list and type(tracked) is list and type(shadows) is list):
            return None
        torch = data.get("torch", False)
        if torch is not None and type(torch) is not str:
            return None
        # The rows' shapes are checked where they are used (_still_holds): a row that is not
        # what the full path writes fails its comparison or raises there, and the record is ignored.
        return cls(key, base, name, library, sha, size, data["manifest"], env, validators, tracked, shadows, torch)  # type: ignore[arg-type]


def _ints(value: object, n: int) -> bool:
    return type(value) is list and len(value) == n and all(type(v) is int for v in value)


# --- reading and verifying ---------------------------------------------------------------------


class Hit:
    # A verified entry found through a record: its ``key``, library ``path`` (under the root),
    # ``fd`` (open on the library, checksummed through it, kept for the process) and ``record``.

    __slots__ = ("key", "path", "fd", "record")

    def __init__(self, key: str, path: str, fd: int, record: HitRecord) -> None:
        self.key = key
        self.path = path
        self.fd = fd
        self.record = record


def open_private_dir_at(dfd: int, name: str) -> int:
    # Open a directory below ``dfd`` without following a link; it must pass the private rule.
    fd = os.open(name, O_DIR, dir_fd=dfd)
    if not private_ok(os.fstat(fd)):
        os.close(fd)
        raise PermissionError(name)
    return fd


def read_record(state_fd: int, digest: str) -> HitRecord | None:
    # The record for ``digest`` in the ``state/`` directory open as ``state_fd`` (see read_private).
    return HitRecord.from_dict(read_private(state_fd, record_name(digest), RECORD_CAP))


def read_private(state_fd: int, name: str, cap: int) -> object:
    # The JSON in ``name`` below ``state_fd`` if that is a regular file (not a link) owned by this
    # user or root, writable by no one else, at most ``cap`` bytes, else ``None``.
    try:
        fd = os.open(name, O_READ, dir_fd=state_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not private_ok(st) or st.st_size > cap:
            return None
        data = os.pread(fd, st.st_size + 1, 0)  # sized to the file: a 1 MiB buffer costs 50 us
        if len(data) != st.st_size:
            return None  # changed while read: the full path
        return load_json_bytes(data)
    except (OSError, ValueError, TypeError, RecursionError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def _still_holds(record: HitRecord) -> bool:
    # Whether everything the record's key was derived from is as it was (see HitRecord); False
    # for a row of any other shape.
    try:
        return _unchanged(record)
    except (TypeError, ValueError, OverflowError):
        return False


def key_env_rows() -> list[list[str | None]]:
    # [name, value or None for unset] of each KEY_ENV_VARS variable: what a record or a start
    # template holds (checked by env_holds) and what a template's name is made of.
    get = os.environ.get
    return [[name, get(name)] for name in KEY_ENV_VARS]


def staging_name(prefix: str) -> str:
    # A new build's directory name in ``staging/`` (stubcache.storage.store.Store.new_staging,
    # stubcache.hit.early): it carries the builder's pid, so prune leaves a live builder's alone.
    return f"{prefix}-{os.getpid()}-{os.urandom(6).hex()}"


def env_holds(env: list[Any]) -> bool:
    # Whether each (name, value or None for unset) row of ``env`` is this process's environment.
    data = os.environ._data  # type: ignore[attr-defined]  # (request_digest checked it exists)
    for name, value in env:
        # os.environ's own encoding of names and values (os.fsencode's, without its call)
        raw = data.get(name.encode(_FS_ENCODING, "surrogateescape")) if type(name) is str else False
        if raw is None:
            if value is not None:
                return False
        elif type(value) is not str or raw != value.encode(_FS_ENCODING, "surrogateescape"):
            return False
    return True


def _unchanged(record: HitRecord) -> bool:
    if not torch_is(record.torch) or not env_holds(record.env):
        return False
    stat_ = os.stat
    seen: dict[str, Any] = {}  # path -> its stat (None: absent), for a shadow row of the same directory
    for path, want in record.validators:
        if type(path) is not str:
            return False
        try:
            st = seen[path] = stat_(path)
        except OSError:
            if want is not None:
                return False
            seen[path] = None
            continue
        if [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] != want:
            return False
    for path, want in record.tracked:  # the tracked inputs, as stubcache.key.inputs checks them
        if type(path) is not str:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        if [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] != want:
            return False  # touched, maybe changed: the full path hashes it
    for directory, want, names in record.shadows:
        if type(directory) is not str or type(names) is not list:
            return False
        # (PATH's directories are validators, for the compiler, and shadow rows, for as and ld)
        dst = seen.get(directory, seen)
        if dst is seen:
            try:
                dst = seen[directory] = stat_(directory)
            except OSError:
                dst = seen[directory] = None
        if dst is None:
            same = want is None
        else:
            same = [dst.st_dev, dst.st_ino, dst.st_mtime_ns, dst.st_ctime_ns] == want
            if not same and not stat.S_ISDIR(dst.st_mode):
                return False  # no longer a directory: a file on sys.path may be a zip archive
        if not same and appeared(directory, names):
            return False
    return True


ANY_PTH = "*.pth"  # a shadow row's name for any file ending in .pth (site.addsitedir processes them)
KNOWN_PTH = "+"  # prefixes a shadow row's name for a .pth file that was there (ANY_PTH allows it)
# A shadow row's name for something that was at a candidate's path and that the compiler passed
# over: ``rel + WAS + "d"`` (a directory) or ``rel + WAS + "l" + target`` (a symbolic link that
# resolved to nothing it would read; its target's path is a candidate of its own). A name holds
# no NUL byte, and os.path.lexists is False for a path with one (what an older reader sees).
WAS = "\0"
WAS_DIR = "d"
WAS_LINK = "l"


def appeared(directory: str, names: list[Any]) -> bool:
    # Whether any of a shadow row's ``names`` exists in ``directory`` now (asked once the
    # directory changed): a name, or for :data:`ANY_PTH` a ``.pth`` file the row does not name
    # with :data:`KNOWN_PTH`; True for a name that is not a str and for a directory that cannot
    # be listed for :data:`ANY_PTH`.
    for rel in names:
        if type(rel) is not str:
            return True
        if rel == ANY_PTH:
            try:
                listing = os.listdir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError:
                return True
            for n in listing:
                if n.endswith(".pth") and KNOWN_PTH + n not in names:
                    return True
        elif rel[:1] != KNOWN_PTH and name_appeared(directory, rel):
            return True
    return False


def name_appeared(directory: str, rel: str) -> bool:
    # Whether a shadow row's name (not ANY_PTH) exists in ``directory`` now, or for a :data:`WAS`
    # name, whether what is there is no longer what the compiler passed over (gone is fine).
    cut = rel.find(WAS)
    if cut < 0:
        return os.path.lexists(os.path.join(directory, rel))
    path, was = os.path.join(directory, rel[:cut]), rel[cut + 1:]
    try:
        st = os.lstat(path)
        if was == WAS_DIR:
            return not stat.S_ISDIR(st.st_mode)
        if was[:1] == WAS_LINK and stat.S_ISLNK(st.st_mode):
            return os.readlink(path) != was[1:]
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError):
        return True
    return True


def open_private_subdir(dfd: int, name: str, make: bool = False) -> int:
    # ``name`` below ``dfd`` opened as open_private_dir_at does; with ``make``, made (0700) first if
    # missing: the layout directories of a private root, as stubcache.storage.store.Store.ensure
    # makes them.
    try:
        return open_private_dir_at(dfd, name)
    except FileNotFoundError:
        if not make:
            raise
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
        except FileExistsError:
            pass
        return open_private_dir_at(dfd, name)


def open_layout(root: str, make: bool = False) -> int | None:
    # ``root``'s layout directory (``v1/``, made if missing with ``make``) opened under the private
    # rule, where the compact path may act: a root that passes the private rule and has no
    # configuration; ``None`` for any other root (the full path reads its configuration). Raises
    # OSError (FileNotFoundError: no root, or no ``v1/`` without ``make``).
    rfd = os.open(root, O_DIR)
    try:
        if not private_ok(os.fstat(rfd)):
            return None
        try:
            os.stat(CONFIG_NAME, dir_fd=rfd, follow_symlinks=False)
            return None  # a root with a configuration (shared, or narrowed): the full path reads it
        except FileNotFoundError:
            pass
        return open_private_subdir(rfd, LAYOUT, make)
    finally:
        os.close(rfd)


def open_state(root: str, make: bool = False) -> int | None:
    # ``root``'s ``v1/state/`` (made if missing with ``make``), as :func:`open_layout` opens ``v1/``.
    base_fd = open_layout(root, make)
    if base_fd is None:
        return None
    try:
        return open_private_subdir(base_fd, "state", make)
    finally:
        os.close(base_fd)


def find(root: str, digest: str) -> Hit | None:
    # The entry the record ``digest`` in ``root`` names, after every check the full path makes
    # on a hit (see the module docstring), pinned and counted as a hit; ``None`` if anything is
    # not as expected (the caller takes the full path). The library is not loaded here.
    try:
        base_fd = open_layout(root)
    except OSError:
        return None
    if base_fd is None:
        return None
    try:
        return _find_in(os.path.join(root, LAYOUT), base_fd, digest)
    except OSError:
        return None
    finally:
        os.close(base_fd)


def _find_in(base: str, base_fd: int, digest: str) -> Hit | None:
    state_fd = open_private_dir_at(base_fd, "state")
    try:
        record = read_record(state_fd, digest)
    finally:
        os.close(state_fd)
    if record is None or not _still_holds(record):
        return None
    key = record.key
    if key == record.base:
        try:
            os.stat(f"variants/{key}", dir_fd=base_fd, follow_symlinks=False)
            return None  # variants of this key, which the full path would try first
        except FileNotFoundError:
            pass
    else:  # an entry with tracked inputs is found through its variant marker
        os.stat(f"variants/{record.base}/{key}", dir_fd=base_fd, follow_symlinks=False)
    entries_fd = open_private_dir_at(base_fd, "entries")
    try:
        efd = open_private_dir_at(entries_fd, key)
        try:
            names = os.listdir(efd)
            if sorted(names) != sorted([MANIFEST_NAME, record.library]):
                return None
            if sig(os.stat(MANIFEST_NAME, dir_fd=efd, follow_symlinks=False)) != record.manifest:
                return None
            if not _pin(base, base_fd, key):
                return None
            # Pinned now: prune can no longer take it. Is the directory we read still the entry?
            if os.stat(key, dir_fd=entries_fd, follow_symlinks=False).st_ino != os.fstat(efd).st_ino:
                return None
            path = os.path.join(base, "entries", key, record.library)
            fd = _checked_library(efd, path, record)
            if fd is None:
                return None
        finally:
            os.close(efd)
    finally:
        os.close(entries_fd)
    record_event(os.path.join(base, "events"), _hit_line(key, record.name), 0o600)
    COUNTED.add((os.path.dirname(base), key))
    return Hit(key, path, fd, record)


def counted_here(root: str, key: str) -> bool:
    # True (once) if this process already counted a hit of ``key`` in ``root`` through a record:
    # the full path's lookup of the same entry (a later ``get_or_build``) is then not a second hit.
    try:
        COUNTED.remove((root, key))
    except KeyError:
        return False
    return True


def _checked_library(efd: int, path: str, record: HitRecord) -> int | None:
    # The library's fd, opened without following a link, trust-checked and (once per process
    # per file) checksummed through that descriptor; kept in ``LIB_FDS``.
    with PROCESS_LOCK:
        kept = LIB_FDS.get(path)
    if kept is not None:
        st = os.fstat(kept)
        if VERIFIED.get(path) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
            return kept
        return None
    fd = os.open(record.library, O_READ, dir_fd=efd)
    try:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if not stat.S_ISREG(st.st_mode) or not private_ok(st) or st.st_size > LIBRARY_CAP:
            os.close(fd)
            return None
        if VERIFIED.get(path) != ident:
            if st.st_size != record.size or sha256_fd(fd, st.st_size) != record.sha256:
                os.close(fd)
                return None  # the full path quarantines it
            VERIFIED[path] = ident
    except BaseException:
        os.close(fd)
        raise
    with PROCESS_LOCK:
        keep = LIB_FDS.setdefault(path, fd)
    if keep != fd:
        os.close(fd)
    return keep


def _pin(base: str, base_fd: int, key: str) -> bool:
    # The shared pin of :meth:`stubcache.storage.store.Store.pin` in a private root, without waiting:
    # False if it cannot be taken at once (the full path waits, bounded, and says why).
    slot = (os.path.dirname(base), key)
    if slot in PINS:
        return True
    import fcntl

    pfd = open_private_dir_at(base_fd, "pins")
    try:
        try:
            fd = os.open(key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_CREAT, 0o600,
                         dir_fd=pfd)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            if os.stat(key, dir_fd=pfd, follow_symlinks=False).st_ino != st.st_ino:
                os.close(fd)
                return False  # prune replaced it meanwhile
            if st.st_atime_ns == NEVER_HIT_ATIME_NS or time.time() - st.st_mtime > LAST_USED_RESOLUTION:
                touch(fd, st)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(pfd)
    with PROCESS_LOCK:
        if slot in PINS:
            os.close(fd)
        else:
            PINS[slot] = fd
    return True


def touch(fd: int, st: os.stat_result) -> None:
    # Set a pin's times to now (the last-used stamp), where that cannot reach another file: a
    # pin with one link (a member's hard link to a file outside the root has two), and as root
    # only our own. Best-effort: never fails a load.
    try:
        if st.st_nlink == 1 and (os.geteuid() != 0 or st.st_uid == 0):
            os.utime(fd)
    except OSError:
        pass


def dlopen_hit(hit: Hit) -> int | None:
    # ``dlopen`` a verified hit's library by its real path, then check the mapping against the
    # checksummed descriptor: the handle, or ``None`` (nothing left loaded) if the mapping is not
    # that file.
    real = REAL_PATHS.get(hit.path)
    if real is None:
        real = REAL_PATHS[hit.path] = os.path.realpath(hit.path)
    return _load_checked(real, os.fstat(hit.fd), hit.fd)


def load(hit: Hit) -> CDLL | None:
    # :func:`dlopen_hit` as a ``ctypes.CDLL`` of that handle.
    handle = dlopen_hit(hit)
    if handle is None:
        return None
    import ctypes

    return ctypes.CDLL(REAL_PATHS[hit.path], handle=handle)


# --- what the loader mapped (the direct way of stubcache.storage.mapped) ---------------------------------

MAPPED: set[str] = set()  # paths loaded and whose mapping was checked in this process
_RTLD_DI_LINKMAP = 2
_PT_LOAD = 1
_dlinfo: Any = None  # libc's dlinfo through ctypes, looked up on first use (False: unavailable)


def _load_address(handle: int) -> int | None:
    # ``l_addr`` of the loaded object ``handle`` (``dlinfo(RTLD_DI_LINKMAP)``), or ``None``.
    global _dlinfo
    import ctypes

    if _dlinfo is None:
        try:
            # Looked up in the program's global scope (ctypes.pythonapi is dlopen(NULL), as
            # CDLL(None) is, without making another library object: ~0.07 ms in an engine process).
            _dlinfo = ctypes.pythonapi["dlinfo"]
        except (OSError, AttributeError):
            _dlinfo = False
    if not _dlinfo:
        return None
    lm = ctypes.c_void_p()
    if _dlinfo(ctypes.c_void_p(handle), _RTLD_DI_LINKMAP, ctypes.byref(lm)) != 0 or not lm.value:
        return None
    return ctypes.c_size_t.from_address(lm.value).value  # struct link_map's first field, l_addr


def program_header(fd: int, p_type: int) -> tuple[int, int, int] | None:
    # ``(p_offset, p_vaddr, p_filesz)`` of the first program header of type ``p_type`` in the
    # ELF64 little-endian file open as ``fd`` (read with ``pread``); ``None`` if there is none or
    # the file is not such an ELF file. (stubcache.build.loadcheck reads PT_INTERP with it.)
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    phoff = int.from_bytes(head[32:40], "little")
    phentsize = int.from_bytes(head[54:56], "little")
    phnum = int.from_bytes(head[56:58], "little")
    if phentsize < 56 or not 0 < phnum < 256:
        return None
    table = os.pread(fd, phentsize * phnum, phoff)
    for i in range(0, len(table) - 55, phentsize):
        if int.from_bytes(table[i:i + 4], "little") == p_type:
            return (int.from_bytes(table[i + 8:i + 16], "little"), int.from_bytes(table[i + 16:i + 24], "little"),
                    int.from_bytes(table[i + 32:i + 40], "little"))
    return None


def first_segment(fd: int, handle: int) -> str | None:
    # ``/proc/self/map_files`` name of the first loadable segment of the object ``handle``,
    # whose file is open as ``fd``: ``start-end`` as the loader maps it (page-aligned ``p_vaddr``
    # to ``p_vaddr + p_filesz``, shifted by the load address). ``None`` if not ELF64 little-endian.
    found = program_header(fd, _PT_LOAD)
    if found is None:
        return None
    _, vaddr, filesz = found
    base = _load_address(handle)
    if base is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    start = base + (vaddr & ~(page - 1))
    end = base + ((vaddr + filesz + page - 1) & ~(page - 1))
    return f"{start:x}-{end:x}"


def _mapped_ok(real: str, st: os.stat_result, handle: int, fd: int) -> bool:
    # The direct way of :func:`stubcache.storage.mapped.check_mapped`: True if the object's first
    # mapping is the verified file (or ``real`` passed before in this process); False if that
    # cannot be established here (the full path then runs the whole check and decides).
    if real in MAPPED:
        return True
    try:
        span = first_segment(fd, handle)
        mapped = os.stat(f"/proc/self/map_files/{span}") if span else None
    except PermissionError:
        # /proc/self/map_files needs CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN (Linux 5.9 on): an
        # ordinary user's process, or root's in a container, finds the mappings by name instead.
        try:
            maps, view = mappings_against(real, st, fd)
        except OSError:
            return False
        if maps and all((dev, ino) in ((st.st_dev, st.st_ino), view) for dev, ino, _ in maps):
            MAPPED.add(real)
            return True
        return False
    except (OSError, ValueError, OverflowError):
        mapped = None
    if mapped is not None and (mapped.st_dev, mapped.st_ino) == (st.st_dev, st.st_ino):
        MAPPED.add(real)
        return True
    return False


def mappings(path: str, fd: int | None = None) -> tuple[list[tuple[int, int, str]], tuple[int, int] | None]:
    # ``(dev, inode, address range)`` of each mapping of ``path`` in this process, from
    # /proc/self/maps (0.1 ms in a bare process, 0.4-0.6 ms in one with torch loaded); with
    # ``fd``, also the ``(dev, inode)`` that file shows there (see :func:`_view_map`), else None.
    # The mapping made for that is never among the rows: it names the path too, and a file
    # swapped back to the path would otherwise pass as the loader's.
    view = _view_map(fd) if fd is not None else None
    try:
        with open("/proc/self/maps", "rb") as fh:
            data = fh.read()
    finally:
        if view is not None:
            view[0].close()
    name = os.fsencode(path)
    out = []
    i = data.find(name)
    while i != -1:  # only the lines naming the path are parsed (a torch process has hundreds)
        start = data.rfind(b"\n", 0, i) + 1
        end = data.find(b"\n", i)
        parts = data[start:end if end != -1 else len(data)].split(None, 5)
        if len(parts) == 6 and parts[5] in (name, name + b" (deleted)"):  # the kernel's spelling
            if view is None or int(parts[0].split(b"-")[0], 16) != view[1]:
                out.append((*_dev_ino(parts), parts[0].decode()))
        i = data.find(name, end if end != -1 else len(data))
    if view is None:
        return out, None
    start = data.find(b"\n%08x-" % view[1]) + 1  # (the kernel's %08lx; the first line is the executable's)
    if start == 0:
        return out, None
    parts = data[start:data.find(b"\n", start)].split(None, 5)
    return out, (_dev_ino(parts) if len(parts) >= 5 else None)


def mappings_against(path: str, st: os.stat_result, fd: int | None) -> tuple[list[tuple[int, int, str]],
                                                                          tuple[int, int] | None]:
    # :func:`mappings` of ``path``, read again with the verified descriptor ``fd`` (its pair, and
    # its own mapping left out) where a row is not ``st``'s pair: btrfs, overlayfs before 6.8.
    maps, view = mappings(path)
    if fd is not None and any((dev, ino) != (st.st_dev, st.st_ino) for dev, ino, _ in maps):
        maps, view = mappings(path, fd)
    return maps, view


def _dev_ino(parts: list[bytes]) -> tuple[int, int]:
    major, minor = (int(x, 16) for x in parts[3].split(b":"))
    return os.makedev(major, minor), int(parts[4])


def _view_map(fd: int) -> tuple[Any, int] | None:
    # A private mapping of the file open as ``fd`` and its address, for mappings() to read back
    # the ``(dev, inode)`` the kernel shows in /proc/self/maps for that very file. Where that is
    # not what fstat says (btrfs shows the filesystem's device, fstat the subvolume's; overlayfs
    # before Linux 6.8 shows the underlying layer's file), the loader's mapping of the same file
    # shows the same pair, and this needs no capability (unlike /proc/self/map_files). On btrfs
    # the pair is unique per subvolume only: a file of another subvolume with the same inode
    # number, put at the library's path, shows the same pair (see docs/cache.md, "Integrity").
    # None if the file cannot be mapped.
    import ctypes
    import mmap

    try:
        size = min(mmap.PAGESIZE, os.fstat(fd).st_size)  # (mmap refuses a length past the end)
        if size <= 0:
            return None
        m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # (writable copy: from_buffer needs it)
    except (OSError, ValueError, OverflowError):
        return None
    try:
        cell = ctypes.c_char.from_buffer(m)
        address = ctypes.addressof(cell)
        del cell  # (an exported buffer would keep close() from unmapping it)
    except BaseException:
        m.close()
        raise
    return m, address


def _load_checked(real: str, st: os.stat_result, fd: int) -> int | None:
    # ``dlopen`` ``real`` as ``ctypes.CDLL(real)`` does (``_ctypes.dlopen`` with ctypes' default
    # mode; a drop-in call returns a path, and the library object CDLL would make around the
    # handle costs an engine process ~0.1 ms), then check its mapping against ``fd``: the
    # handle, or ``None`` (unloaded) on a mismatch. (tests/test_private_interfaces.py holds
    # _ctypes.dlopen to CDLL's handle.)
    import ctypes
    import _ctypes

    handle: int = _ctypes.dlopen(real, ctypes.DEFAULT_MODE)
    if not _mapped_ok(real, st, handle, fd):
        _ctypes.dlclose(handle)
        return None
    return handle


# --- events --------------------------------------------------------------------------------------


def _hit_line(key: str, name: str) -> bytes:
    # key and name are checked plain (hex, identifier): no JSON escaping can be needed
    return b'{"t":%r,"ev":"hit","key":"%s","name":"%s"}\n' % (round(time.time(), 3), key.encode(), name.encode())


def record_event(events_dir: str, line: bytes, mode: int) -> None:
    # Append one event line to this process's event file under ``events_dir`` (made on the
    # first event, with ``mode``, never through a link, and held with a shared ``flock`` as the
    # "alive" marker before any write; see :mod:`stubcache.storage.events`). Never fails a load.
    try:
        with _event_lock:
            pid = os.getpid()
            known = _event_fds.get(events_dir)
            if known is None or known[1] != pid:  # reopen after fork
                fd = _open_event_file(events_dir, pid, mode)
                if fd is None:
                    return
                _event_fds[events_dir] = (fd, pid)
            else:
                fd = known[0]
            os.write(fd, line)
    except (OSError, ValueError):
        pass


def _open_event_file(events_dir: str, pid: int, mode: int) -> int | None:
    import fcntl

    node = os.uname().nodename
    if not node or "/" in node or node in (".", ".."):
        node = "host"
    dfd = os.open(events_dir, O_DIR)
    try:
        fd = os.open(f"{node}-{pid}-{os.urandom(6).hex()}.jsonl",
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_APPEND, mode,
                     dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        os.fchmod(fd, mode)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # "alive" marker; never waits
    except OSError:
        os.close(fd)
        return None
    return fd


# --- a caller's build_directory ------------------------------------------------------------------


def placed_copy(dfd: int, name: str, size: int, sha256: str) -> tuple[int, os.stat_result] | None:
    # An fd on ``name`` in the build directory open as ``dfd`` if it already is our copy of a
    # library of ``size`` bytes and checksum ``sha256`` (a regular file of ours, one link, writable
    # by nobody else, those bytes), else None (see :mod:`stubcache.dropin.builddir`).
    try:
        fd = os.open(name, O_READ, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
                and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                and st.st_size == size and sha256_fd(fd, size) == sha256):
            return fd, st
    except OSError:
        pass
    os.close(fd)
    return None


# A library placed in a build directory: readable and executable by all, written by its owner
# only, whatever the umask (a copy a group member could write after it was hashed would be
# loaded with their bytes; the mapping check compares inodes only), less what the umask takes.
PLACED_MODE = 0o755


def copy_checked(src_fd: int, dst_fd: int, size: int, sha256: str) -> bool:
    # Copy the file open as ``src_fd`` (from offset 0) to ``dst_fd``, hashing what was read: True
    # if those were ``size`` bytes of checksum ``sha256`` (what a placed copy must hold).
    import hashlib  # (see sha256_fd)

    h = hashlib.sha256()
    offset = 0
    while offset <= size:
        chunk = os.pread(src_fd, min(1 << 20, size + 1 - offset), offset)
        if not chunk:
            break
        h.update(chunk)
        offset += len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst_fd, view):]
    return offset == size and h.hexdigest() == sha256


def temp_name(name: str) -> str:
    # ``.<name>.<pid>.<random>.tmp``: the temporary file renamed to ``name`` (hidden; its writer's
    # pid for stubcache.storage.locking.temp_pid). ``name`` is checked by the caller.
    return f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"


def _place_copy(dfd: int, name: str, hit: Hit) -> tuple[int, os.stat_result] | None:
    # Our copy of the hit's library written to a fresh temporary name in the build directory open
    # as ``dfd`` (its flock held) and renamed to ``name``, which replaces a link there and never
    # follows it: an fd on it and its stat, or ``None`` with nothing left behind (the full path,
    # stubcache.dropin.builddir.place, then places it and reports what fails).
    tmp = temp_name(name)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PLACED_MODE, dir_fd=dfd)
    except OSError:
        return None
    try:
        if copy_checked(hit.fd, fd, hit.record.size, hit.record.sha256):
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            return fd, os.fstat(fd)
    except OSError:
        pass
    except BaseException:  # interrupted (KeyboardInterrupt): nothing left behind either
        _discard(dfd, tmp, fd)
        raise
    _discard(dfd, tmp, fd)
    return None


def _discard(dfd: int, tmp: str, fd: int) -> None:
    try:
        os.unlink(tmp, dir_fd=dfd)
    except OSError:
        pass
    os.close(fd)


def build_directory_problem(st: os.stat_result) -> str | None:
    # Why a build directory (its ``fstat``) cannot take a library, or ``None``: it must belong
    # to this user or root and not be writable by others unless sticky.
    if st.st_uid not in (os.geteuid(), 0):
        return (f"it belongs to uid {st.st_uid}, not to you or root; another user could replace the "
                "library after it is written there")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (f"it is writable by others (mode {stat.S_IMODE(st.st_mode):o}) and not sticky; another "
                "user could replace the library after it is written there")
    return None


def load_placed(hit: Hit, directory: str, module_name: str) -> str | None:
    # For a drop-in call with a ``build_directory``: load ``<directory>/<module_name>.so`` if it
    # already is our verified copy of the hit's library, else a copy placed there now (a new
    # directory: a container's fresh /tmp), that very file (by its real path, then the mapping
    # checked against the descriptor it was checksummed or written through), and return the path
    # as torch would; ``None`` where that cannot be done here (the full path then places it and
    # reports why). Holds the directory's ``flock`` meanwhile, as
    # :func:`stubcache.dropin.builddir.place` does, without waiting for it.
    import fcntl

    name = f"{module_name}.so"
    try:
        dfd = os.open(directory, O_DIR)
    except OSError:
        return None
    try:
        if build_directory_problem(os.fstat(dfd)) is not None:
            return None
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None
        found = placed_copy(dfd, name, hit.record.size, hit.record.sha256) or _place_copy(dfd, name, hit)
        if found is None:
            return None
        fd, st = found
        try:
            path = os.path.join(directory, name)
            if _load_checked(os.path.realpath(path), st, fd) is None:
                return None
            return path
        except OSError:
            return None  # (the loader's error: the full path loads it again, and reports it)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)  # drops the flock


# --- serving a request: what the fronts share ----------------------------------------------------


class Miss:
    # A request the compact path did not serve, handed to the full path: ``digest`` names the
    # record the full path leaves for it (``None``: none can be), ``since`` is when this process
    # began waiting for another one serving the same request (``None``: it did not wait; see
    # CacheCore.get_or_build_since), ``turn`` the request lock it holds (see request_turn),
    # closed by :meth:`release` once the record is there or cannot be: the next process's turn.

    # ``begun``: the compile this process began for it (stubcache.hit.early.begin, asked by the
    # drop-in's front where the process holds the turn), for the full path to take over
    # (take_begun) or, left here, stopped by :meth:`release`.

    __slots__ = ("digest", "since", "turn", "begun")

    def __init__(self, digest: str | None = None, since: float | None = None, turn: int | None = None) -> None:
        self.digest = digest
        self.since = since
        self.turn = turn
        self.begun: Begun | None = None

    def take_begun(self) -> Begun | None:
        begun, self.begun = self.begun, None
        return begun

    def release(self) -> None:
        turn, self.turn = self.turn, None
        begun, self.begun = self.begun, None
        try:
            if begun is not None:
                begun.discard()
        finally:
            if turn is not None:
                os.close(turn)


def serve(root: str, digest: str, make_root: bool = False) -> tuple[Hit | None, Miss]:
    # The hit the record ``digest`` in ``root`` names (see find), with the Miss to hand on if it
    # cannot be loaded. No record: one process at a time serves the request and leaves the
    # record; the others wait for it (request_turn) and take that (a herd's waiters then import
    # nothing more than this module).
    found = find(root, digest)
    if found is not None:
        return found, Miss(digest)
    since = time.time()
    turn = request_turn(root, digest, make_root)
    if turn == WAITED:
        return find(root, digest), Miss(digest, since)
    return None, Miss(digest, since, turn)


# load_inline's parameters that become spec fields, in stubcache.key.FIELDS' order (the name
# aside): a call is these values, frozen, as stubcache.dropin.compat forms it from FIELDS
# (tests/test_hit_records.py checks that the two agree).
FORWARDED = ("cpp_sources", "cuda_sources", "functions", "extra_cflags", "extra_cuda_cflags", "extra_ldflags",
             "extra_include_paths", "with_cuda", "is_python_module", "with_pytorch_error_handling",
             "no_implicit_headers")


def dropin_call(args: dict[str, Any]) -> Any:
    # A ``stubcache.load_inline`` call (``args``: its arguments by name) served through the record
    # the full drop-in left for the very same call: what torch would return (the library's path),
    # or a Miss for the full drop-in (stubcache.dropin.compat.load_inline_recording), which serves
    # it and leaves the record. A call the record cannot answer (a Python module, CUDA, include
    # paths, a setting to check, a second version of a name in this process) is a Miss with no
    # digest. A ``verbose`` call (which shows what the full path loads) takes the full path with
    # the digest and the turn: it leaves the record for the same call without ``verbose``, which
    # would otherwise find none and begin a compile the key then makes needless.
    name = args["name"]
    build_directory = args["build_directory"]
    if not (args["is_python_module"] is False and args["cuda_sources"] is None
            and args["functions"] is None and not args["extra_include_paths"] and args["sycl_sources"] is None
            and args["extra_sycl_cflags"] is None and args["with_sycl"] is None and args["with_cuda"] is not True
            and args["gil_not_used"] is False and type(name) is str and name.isascii() and name.isidentifier()
            and args["cpp_sources"] and (build_directory is None or type(build_directory) is str)
            and quick_settings()):
        return Miss()
    call = tuple([frozen(args[f]) for f in FORWARDED])
    known = versions.get(name)
    root = default_root()
    if (known is not None and known != (0, call)) or root is None:
        return Miss()
    digest = request_digest("load_inline", (name, call))
    if digest is None:
        return Miss()
    if args["verbose"]:
        since = time.time()
        turn = request_turn(root, digest)
        return Miss(digest, since) if turn == WAITED else Miss(digest, since, turn)
    found, miss = serve(root, digest)
    if found is not None:
        if build_directory is not None:
            result = load_placed(found, build_directory, name)
        elif dlopen_hit(found) is not None:
            result = REAL_PATHS[found.path]  # the real path it was loaded (and checked) by
        else:
            result = None
        if result is not None:
            miss.release()
            with versions_lock:
                versions.setdefault(name, (0, call))
            return result
    return miss


# --- whose turn it is to serve a request that has no record yet ----------------------------------

# How long a request waits for another process that is serving it (building, usually) before it
# takes the full path itself, which waits on the key's build lock, bounded, with the notice and
# the terminal's status line naming the builder (stubcache.edge.progress.STATUS_AFTER after that:
# a direct build, what a herd waits for, is done well within it).
REQUEST_WAIT = 1.0
WAITED = -1  # request_turn's answer: another process served the request meanwhile


def request_lock_name(digest: str) -> str:
    return f"hit-{digest}.lock"


def request_turn(root: str, digest: str, make_root: bool = False) -> int | None:
    # Called when no record answers the request ``digest`` in ``root``: whose turn it is to
    # serve it. The request's lock (``v1/state/hit-<digest>.lock``, an exclusive ``flock``) is
    # taken without waiting: its fd is returned, held, and the caller takes the full path and
    # closes the fd once that has left its record. If another process holds it (serving the same
    # request, which a herd of engines starting at once does), this waits until that process
    # lets go, at most :data:`REQUEST_WAIT` seconds, and returns :data:`WAITED`: ``find`` again,
    # and the full path if there is still no record. ``None``: no lock here (no root and not
    # ``make_root``, not a private root, an odd file); take the full path. A missing root (with
    # ``make_root``: the request is known to be valid, a StubSpec) and, in a private root, a
    # missing ``v1/state`` are made (0700), as the full path would make them.
    #
    # Only a shortcut: the full path's build lock is what makes builds happen once (invariant 1).
    # A process that dies drops the lock (a kernel flock). The wait is a blocking shared ``flock``
    # in a helper thread, so it ends the moment the holder lets go and costs nothing meanwhile;
    # the thread owns its descriptor (nothing else can be given that number while it waits) and
    # closes it as soon as the lock is granted, so a wait that timed out leaves nothing held.
    import fcntl

    try:
        try:
            state_fd = open_state(root, make=True)
        except FileNotFoundError:
            if not make_root:
                return None  # the full path makes it, once it has checked the request
            os.makedirs(root, mode=0o700, exist_ok=True)  # as Store.ensure makes a missing root
            state_fd = open_state(root, make=True)
        if state_fd is None:
            return None  # a shared (or narrowed) root: the full path reads its configuration
        try:
            fd = os.open(request_lock_name(digest), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         0o600, dir_fd=state_fd)
        finally:
            os.close(state_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not private_ok(st):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        pass
    # The helper is a bare _thread thread (documented, threading's own layer), not a
    # threading.Thread: in an engine forked after ``import torch`` (a herd), threading's start-up
    # handshake and bookkeeping cost each waiter ~0.8 ms of CPU against ~0.1 ms, paid while the
    # process that builds needs that CPU. It behaves as a daemon thread would.
    done = _thread.allocate_lock()
    done.acquire()

    def wait() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:
            pass
        finally:
            os.close(fd)  # drops the shared lock at once
            done.release()

    try:
        _thread.start_new_thread(wait, ())
    except BaseException:
        os.close(fd)
        raise
    done.acquire(True, REQUEST_WAIT)
    return WAITED
