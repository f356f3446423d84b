"""The build-time half of input tracking (see :mod:`stubcache.key.inputs` for what is tracked and
how a lookup checks it): the compiler's include search order, the dependency lists the compiler
and the linker write, and :func:`track`, which turns them into the record a manifest keeps.

Only builds import this module (through :mod:`stubcache.build.buildinputs`, and the toolchain
probe for the compiler's search path); a hit never does.
"""

from __future__ import annotations

import os
import stat

from ..edge import kpath
from .flagscan import option_values
from ..hit import WAS, WAS_DIR, WAS_LINK, name_appeared
from .inputs import dir_sig, recordable, signature, slack_ns
from ..storage.store import file_sha256

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    import re
    import subprocess
    from typing import Any, Callable, Iterable, Sequence


class SearchPath:
    """The compiler's include search order for one command line, as it reports it (``-v``)."""

    __slots__ = ("dirs", "missing", "cc1", "driver_version")

    def __init__(self, dirs: list[str], missing: list[str], cc1: str | None = None,
                 driver_version: str | None = None) -> None:
        self.dirs = dirs  # quote-only dirs, then the <...> dirs, in search order
        self.missing = missing  # dirs the compiler ignored (nonexistent or duplicate): they may count later
        # Who answered, through whatever wraps CXX: the compiler proper it ran and the driver's
        # version line (compared with the fingerprint's record of the real compiler).
        self.cc1 = cc1
        self.driver_version = driver_version


def start_search_path(cmd: list[str], cwd: str | None = None, source: str | None = None,
                      language: str | None = "c++") -> "subprocess.Popen[bytes]":
    """Start the compiler ``cmd`` (with all include-affecting flags) reporting its search order,
    preprocessing ``source`` (default: nothing; ``cmd`` may then ask for its dependency list) as
    ``language`` (``None``: as the file's name and ``cmd``'s own ``-x`` say, as its compile did).
    With a source, in a session of its own: its preprocessor holds the pipe, so stopping it means
    ending the session (:func:`stubcache.hit.early.stop_session`), not the driver alone."""
    import subprocess

    lang = ["-x", language] if language else []
    return subprocess.Popen([*cmd, *lang, "-E", "-v", source or os.devnull, "-o", os.devnull],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                            start_new_session=source is not None)


def finish_search_path(proc: "subprocess.Popen[bytes]") -> SearchPath:
    """Parse what :func:`start_search_path` printed."""
    import subprocess

    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return parse_search_path(out.decode("utf-8", "surrogateescape"))  # directory names are bytes


def search_path(cmd: list[str], cwd: str | None = None) -> SearchPath:
    """Ask the compiler ``cmd`` for its search order and wait for the answer."""
    return finish_search_path(start_search_path(cmd, cwd))


def parse_search_path(text: str) -> SearchPath:
    """The directories in a compiler's ``-v`` output, in search order."""
    dirs: list[str] = []
    missing: list[str] = []
    inside = False
    started = False  # the search list (or the notes before it) began: no command lines after
    cc1 = version = None
    for line in text.splitlines():
        if not started and line.startswith(" ") and cc1 is None:
            import shlex

            try:
                first = shlex.split(line)[0]
            except (ValueError, IndexError):
                first = ""
            if os.path.isabs(first):
                cc1 = os.path.realpath(first)
        elif not started and version is None and " version " in line and not line.startswith(" "):
            version = line.strip()
        if line.startswith(("ignoring ", "#include ")):
            started = True
        if line.startswith(("ignoring nonexistent directory", "ignoring duplicate directory")):
            # A duplicate (same inode as a directory searched) is searched again once a symlink
            # in its spelling is re-pointed: like a missing one, its candidates are recorded.
            missing.append(kpath.tidy(line.split('"')[1] if '"' in line else line.split()[-1]))
        elif line.startswith("#include ") and "search starts here" in line:
            inside = True
        elif line.startswith("End of search list"):
            inside = False
        elif inside and line.startswith(" "):
            d = line.strip()
            if d.endswith(" (framework directory)"):
                continue
            dirs.append(kpath.tidy(d))  # as given: `link/..` is where the link points, then up
    return SearchPath(dirs, missing, cc1, version)


OWN_DIR_PROBES = ("-print-file-name=include", "-print-libgcc-file-name")


def compiler_dirs(cmd: list[str]) -> list[str]:
    """The compiler's own directory (gcc's ``lib/gcc/<target>/<version>``, clang's resource dir)."""
    import subprocess

    outs = []
    for probe in OWN_DIR_PROBES:
        try:
            outs.append(subprocess.run([*cmd, probe], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       check=False, timeout=60).stdout.decode("utf-8", "surrogateescape"))
        except (OSError, subprocess.SubprocessError):
            outs.append("")
    return compiler_dirs_from(outs)


def compiler_dirs_from(outputs: list[str]) -> list[str]:
    """:func:`compiler_dirs` from the outputs of the :data:`OWN_DIR_PROBES`, in order."""
    out: list[str] = []
    for probe, text in zip(OWN_DIR_PROBES, outputs):
        p = text.strip()
        if os.path.isabs(p) and os.path.exists(p):
            d = os.path.dirname(os.path.realpath(p))
            if probe.endswith("libgcc-file-name") and "/clang/" in d:
                d = os.path.dirname(os.path.dirname(d))  # <resource>/lib/linux -> <resource>
            if d not in out:
                out.append(d)
    return out


def pinned_prefixes(own_dirs: list[str], torch_dir: str | None, python_include: str | None) -> list[str]:
    """Resolved directories whose contents the fingerprint pins (see the module docstring):
    ``own_dirs`` are the compiler's own directories and its C++ standard library's default
    header directories (probed with its identity), then torch's and Python's."""
    roots = list(own_dirs)
    if torch_dir:
        roots += [os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")]
    if python_include:
        roots.append(python_include)
    out = []
    for r in roots:
        for form in (os.path.realpath(r), kpath.tidy(r)):
            form = form.rstrip("/") + "/"
            if form not in out:
                out.append(form)
    return out


class RealPaths:
    """``os.path.realpath`` for one build's many paths, each directory resolved once (a build's
    inputs share a few dozen directories): the last component is still checked for a link every
    time, and a path ending in ``..`` is resolved whole."""

    def __init__(self) -> None:
        self._dirs: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        head, name = os.path.split(path)
        if not head or name in ("", ".", ".."):
            return os.path.realpath(path)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return os.path.realpath(path)
        except OSError:
            pass  # realpath keeps a last component it cannot read as named, as here
        real_dir = self._dirs.get(head)
        if real_dir is None:
            real_dir = self._dirs[head] = os.path.realpath(head)
        return os.path.join(real_dir, name)


def is_pinned(path: str, pinned: Sequence[str], real: str | None = None) -> bool:
    """Whether ``path`` (as the compiler named it) is a file whose contents the fingerprint pins:
    the file it resolves to lies under a pinned prefix, and so does the path as named. A symlink
    from a user directory into a pinned one is not pinned: the link may be pointed elsewhere
    later. A path with ``..`` steps (clang names ``<gcc dir>/../../../../include/c++/12``) is
    pinned when its resolved form is and no step before the last ``..`` is a symlink outside a
    pinned directory: the kernel resolves ``..`` from where such a link points, not on paper.
    ``real``: ``os.path.realpath(path)``, where the caller has it already."""
    real = (os.path.realpath(path) if real is None else real).rstrip("/") + "/"  # a directory matches its own prefix
    if not any(real.startswith(p) for p in pinned):
        return False
    lexical = kpath.tidy(path).rstrip("/") + "/"
    if not kpath.has_dotdot(lexical):
        return any(lexical.startswith(p) for p in pinned)
    parts = lexical.strip("/").split("/")
    last = len(parts) - 1 - parts[::-1].index("..")
    prefix = ""
    for part in parts[:last]:
        prefix += "/" + part
        if part != ".." and os.path.islink(prefix):
            where = os.path.realpath(os.path.dirname(prefix)).rstrip("/") + "/"
            if not any(where.startswith(p) for p in pinned):
                return False
    return True


# What a dependency file cannot say: a name holding a line break, or ending in a backslash
# (gcc writes ``a\ b`` both for a name "a\" followed by the separator and for "a b"). Such a build is never published:
# the file the compiler read cannot be named, so it cannot be tracked.
UNEXPRESSED = "<a file whose name the dependency output cannot express>"


def parse_depfile(path: str) -> list[str]:
    """The prerequisites named in a dependency file: make syntax as gcc and GNU as write it
    (``\\ `` and ``\\#`` escapes, ``$$``, backslash-newline continuations), or the one-name-a-line
    layout that ld (raw names) and lld (make escapes) write with ``--dependency-file``. A name the
    file cannot express unambiguously comes back as :data:`UNEXPRESSED`."""
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8", "surrogateescape")  # names are bytes: keep them
    except OSError:
        return []
    if not text:
        return []
    if "\n\n" in text and _is_linker_layout(text):
        return _parse_linker_depfile(text, os.path.dirname(path))
    return _parse_make_depfile(text)


def _first_line(text: str) -> str:
    return text.split("\n", 1)[0]


def _is_linker_layout(text: str) -> bool:
    """ld's and lld's layout: ``target:`` then `` \\\n  name`` per input, a blank line, phonies."""
    return _first_line(text).endswith(": \\") and text.split("\n", 2)[1].startswith("  ")


def _parse_linker_depfile(text: str, base: str) -> list[str]:
    head, _, rest = text.partition(": \\\n  ")
    block, sep, phonies = ("  " + rest).partition("\n\n")
    names = block[2:].split(" \\\n  ")
    # Each input again as a phony target: the two lists agree unless a name held a line break.
    if not sep or "\n" + phonies != "".join(f"\n{n}:\n" for n in names) or any("\n" in n for n in names):
        return [UNEXPRESSED]
    out = []
    for raw in names:
        escaped = _make_words(raw)
        if escaped is None:  # ambiguous read as make escapes (lld's): neither spelling is sure
            out.append(UNEXPRESSED)
            continue
        cooked = escaped[0] if len(escaped) == 1 else None
        if cooked is None or cooked == raw:
            out.append(raw)  # ld writes names as they are
            continue
        # lld escapes like make, ld.bfd does not: the spelling that names an existing file.
        there = [n for n in (raw, cooked) if os.path.lexists(os.path.join(base, n))]
        out.append(there[0] if len(there) == 1 else UNEXPRESSED)
    return out


def _parse_make_depfile(text: str) -> list[str]:
    # gcc, clang and GNU as break a long line as " \<newline>": a backslash that ends a line with
    # no blank before it ends a name (which gcc writes unescaped), and read as a break it would
    # name another file, one that may exist (``x\`` read as ``x``).
    at = text.find("\\\n")
    while at != -1:
        if text[at - 1:at] != " ":
            return [UNEXPRESSED]
        at = text.find("\\\n", at + 2)
    # gcc writes one rule; a line break inside a name shows as a second line that is no rule.
    joined = text.replace("\\\n", " ")
    lines = [ln for ln in joined.split("\n") if ln.strip()]
    out: list[str] = []
    for line in lines:
        target, colon, rest = line.partition(": ")
        if not colon:
            if line.endswith(":") and len(lines) > 1:
                continue  # a phony target (-MP)
            return [UNEXPRESSED]
        words = _make_words(rest)
        if words is None:
            return [UNEXPRESSED]
        out += words
    return out


def _make_words(text: str) -> list[str] | None:
    """Split make prerequisites, undoing gcc's escapes (see libcpp's ``munge``): 2N+1
    backslashes and a blank are N backslashes and the blank, 2N and a blank end a word after N;
    ``\\#`` is ``#``; ``$$`` is ``$``; any other backslash is itself. None where a name ends in a
    backslash (gcc leaves it undoubled: ambiguous)."""
    out: list[str] = []
    token: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            j = i
            while j < n and text[j] == "\\":
                j += 1
            run = j - i
            nxt = text[j] if j < n else ""
            if nxt in (" ", "\t"):
                token.append("\\" * (run // 2))
                if run % 2:
                    token.append(nxt)
                else:
                    return None  # a name ending in backslashes: what gcc wrote is ambiguous
                i = j + 1
                continue
            if nxt == "#":
                token.append("\\" * (run - 1) + "#")
                i = j + 1
                continue
            if nxt == "":
                return None
            token.append("\\" * run)
            i = j
            continue
        if c == "$" and i + 1 < n and text[i + 1] == "$":
            token.append("$")
            i += 2
            continue
        if c in " \t":
            if token:
                out.append("".join(token))
                token = []
        else:
            token.append(c)
        i += 1
    if token:
        out.append("".join(token))
    return out


class Tracked:
    """What :func:`track` found: ``files`` ``{path: sha256}`` for the key, ``record`` for the
    manifest's ``inputs`` field, and ``unstable``: files written while the build ran."""

    __slots__ = ("files", "record", "unstable")

    def __init__(self, files: dict[str, Any], record: dict[str, Any], unstable: list[str]) -> None:
        self.files = files
        self.record = record
        self.unstable = unstable


_HAS_INCLUDE: re.Pattern[str] | None = None
_QUOTED: re.Pattern[str] | None = None


def has_include_names(texts: Iterable[str]) -> list[str]:
    """The header names tested by ``__has_include``/``__has_include_next`` in ``texts`` (literal
    ``"name"`` and ``<name>`` arguments). A name that is absent at build time reads no file, so
    the dependency output never mentions it; a file appearing under it later flips the test."""
    global _HAS_INCLUDE
    out: list[str] = []
    for text in texts:
        if "__has_include" not in text:
            continue
        if _HAS_INCLUDE is None:  # compiled when first needed: ~0.5 ms of a cold build otherwise
            import re

            _HAS_INCLUDE = re.compile(r'__has_include(?:_next)?\s*\(\s*(?:"([^"\n]+)"|<([^>\n]+)>)\s*\)')
        for quoted, angled in _HAS_INCLUDE.findall(text):
            name = _up_to_nul(quoted or angled)
            if name and name not in out:
                out.append(name)
    return out


def quoted_include_names(text: str) -> list[str]:
    """The names of the ``#include "name"`` lines in a header's text."""
    global _QUOTED
    if '"' not in text:
        return []
    if _QUOTED is None:
        import re

        _QUOTED = re.compile(r'^[ \t]*#[ \t]*include(?:_next)?[ \t]*"([^"\n]+)"', re.M)
    return [name for name in map(_up_to_nul, _QUOTED.findall(text)) if name]


def _up_to_nul(name: str) -> str:
    # gcc reads a header name up to a NUL byte in it (clang refuses it): so does tracking, and
    # no recorded name can hold one (a NUL marks what the compiler passed over: hit.WAS).
    return kpath.tidy(name.partition("\0")[0])


def unsettled(before: os.stat_result, after: os.stat_result, started_ns: int) -> bool:
    """Whether a file hashed between ``before`` and ``after`` (its stats) may not hold what was
    read, nor what a build that began at ``started_ns`` read: it changed meanwhile, or it changed
    at or after that start (less the file system's timestamp slack), so its signature cannot be
    trusted yet."""
    return signature(before) != signature(after) or after.st_ctime_ns >= started_ns - slack_ns(after.st_ctime_ns)


def track(deps: Iterable[str], build_dir: str, pinned: list[str], search: SearchPath | None,
          started_ns: int, probes: Iterable[str] = (), remembered: dict[str, Any] | None = None) -> Tracked:
    """Hash every dependency that is neither the build's own file nor pinned; record the shadow
    candidates of each header (pinned ones too: a new file in a user directory shadows them as
    well); flag files changed since ``started_ns`` (the compile's start): their content may not
    be what the compiler read. ``probes`` are names tested by ``__has_include`` in the sources
    (those in tracked headers are added here): the file each resolves to now is tracked, and a
    name found nowhere is recorded as absent in every searched directory. ``remembered``: this
    user's hash memo (:func:`hash_memo`) if read already; its rows are checked by signature here."""
    tracker = Tracker(build_dir, pinned, search, started_ns, probes, remembered)
    tracker.add_deps(deps)
    return tracker.result()


class Tracker:
    """:func:`track` in steps: dependencies added in their order (:meth:`add_deps`, in as many
    calls as they come), :meth:`settle` (the ``__has_include`` names resolved and the shadow
    candidates found for what was added so far), :meth:`result`. A build whose compiler is still
    running may track the headers it is predicted to read, settle, and add the rest once it has
    ended; :meth:`recheck` then flags a file tracked early that changed since it was hashed.
    The result is the one :func:`track` gives for the same dependencies in the same order."""

    def __init__(self, build_dir: str, pinned: list[str], search: SearchPath | None, started_ns: int,
                 probes: Iterable[str] = (), remembered: dict[str, Any] | None = None) -> None:
        self.build_dir = build_dir
        self.skip = os.path.realpath(build_dir).rstrip("/") + "/"
        self.realpath = RealPaths()
        self.remembered = hash_memo() if remembered is None else remembered
        self.pinned = pinned
        self.search = search
        self.started_ns = started_ns
        self.learned: dict[str, list[Any]] = {}
        self.files: dict[str, str] = {}
        self.sigs: dict[str, list[Any]] = {}
        self.seen: dict[str, list[Any]] = {}  # every hashed file's signature when it was hashed
        self.unstable: list[str] = []
        self.headers: list[str] = []
        self.pinned_headers: list[str] = []
        self.beside: dict[str, set[Any]] = {}
        self.probes = list(probes)
        self.resolved = 0  # probes[:resolved] are resolved (tracked or in absent_names)
        self.absent_names: list[str] = []
        self.shadows: dict[str, Any] | None = None
        self.shadow_unstable: list[str] = []  # candidates that appeared while the build ran
        self.present: dict[str, Any] = {}  # candidates that existed when looked for (not chosen): their lstat
        self.settled_at: tuple[int, int, int, int] | None = None  # what the shadows were found for

    def add_deps(self, deps: Iterable[str]) -> None:
        for dep in deps:
            if dep == UNEXPRESSED:
                self.unstable.append(dep)  # read by the build, but under a name that cannot be tracked
                continue
            # As the compiler named it, never collapsed on paper: `link/../x.h` is the x.h beside
            # the link's target, which the kernel opens again on every check.
            self._add(kpath.tidy(os.path.join(self.build_dir, dep)))

    def _add(self, path: str, probe: bool = False) -> None:
        if path in self.files or path in self.pinned_headers:
            return
        real = self.realpath(path)
        if real.startswith(self.skip):
            return
        is_header = not path.endswith((".o", ".a", ".so")) and ".so." not in os.path.basename(path)
        if is_pinned(path, self.pinned, real):
            if is_header:
                self.pinned_headers.append(path)
                # Its contents are pinned, but what it probes for may lie outside (libstdc++'s
                # __has_include(<tbb/tbb.h>) finds /usr/include or a user directory).
                for name in has_include_names([_read_text(path)]):
                    if name not in self.probes:
                        self.probes.append(name)
            return
        try:
            st0 = os.stat(path)
            known = self.remembered.get(path) if st0.st_size >= HASH_MEMO_MIN_SIZE else None
            fd = -1 if known is not None and known[0] == signature(st0) else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            if not probe and not _driver_temporary(path):
                self.unstable.append(path)  # read by the build, gone now
            return
        if fd < 0:  # hashed by an earlier build of this user's, and unchanged since (signature)
            digest, st1 = known[1], st0  # type: ignore[index]  # (known is set: fd < 0)
        else:
            try:
                digest = file_sha256(fd)
                st1 = os.fstat(fd)
            finally:
                os.close(fd)
        sig = signature(st1)
        if unsettled(st0, st1, self.started_ns):
            self.unstable.append(path)
        elif fd >= 0 and st1.st_size >= HASH_MEMO_MIN_SIZE:
            self.learned[path] = [sig, digest]
        self.files[path] = digest
        self.seen[path] = sig
        if recordable(sig) is not None:
            self.sigs[path] = sig
        if is_header:
            self.headers.append(path)
            text = _read_text(path)
            tested = has_include_names([text])
            for name in tested:
                if name not in self.probes:
                    self.probes.append(name)
            for name in quoted_include_names(text) + tested:
                # A quoted include looks beside the including file first: a file appearing
                # there later is found instead of the one the compiler read.
                self.beside.setdefault(os.path.dirname(path), set()).add(name)

    def settle(self) -> None:
        """Resolve the ``__has_include`` names seen so far (tracking the file each finds, which
        may add more) and find the shadow candidates of the headers tracked so far."""
        while self.resolved < len(self.probes):  # may grow while headers found here are scanned
            name = self.probes[self.resolved]
            self.resolved += 1
            found = _resolve_probe(name, self.search)
            if found is None:
                self.absent_names.append(name)
            else:
                self._add(found, probe=True)
        state = (len(self.headers), len(self.pinned_headers), len(self.absent_names),
                 sum(len(v) for v in self.beside.values()))
        if self.search is not None and state != self.settled_at:
            self.shadow_unstable, self.present = [], {}
            self.shadows = shadow_candidates(self.headers + self.pinned_headers, self.search, self.pinned,
                                             self.absent_names, self.beside, self.started_ns, self.shadow_unstable,
                                             self.present)
            self.settled_at = state

    def recheck(self) -> None:
        """After the compiler has ended: flag each file hashed so far whose signature is not the
        one it was hashed with (it changed after that, perhaps before the compiler read it), and
        each ``__has_include`` name found nowhere then that resolves now (it appeared, perhaps
        before the compiler tested it: a test leaves no trace in the dependency list), and each
        header taken for a pinned one that no longer resolves under a pinned prefix, and each
        shadow candidate that exists now, or that existed then and is not the same now."""
        now: list[Any] | None
        for path, sig in self.seen.items():
            try:
                now = signature(os.stat(path))
            except OSError:
                now = None
            if now != sig and path not in self.unstable:
                self.unstable.append(path)
        for name in self.absent_names:
            found = _resolve_probe(name, self.search)
            if found is not None and found not in self.unstable:
                self.unstable.append(found)
        fresh = RealPaths()  # (a link re-pointed meanwhile: the header may no longer be pinned)
        for path in self.pinned_headers:
            if not is_pinned(path, self.pinned, fresh(path)) and path not in self.unstable:
                self.unstable.append(path)
        for path, was in self.present.items():
            # A candidate that was there, not chosen (a directory, a dangling link, another
            # spelling's file), and is not the same now (a file put in a directory's place):
            # tracking after the compile would have seen it new.
            try:
                now = passed_over(os.lstat(path))
            except OSError:
                now = None
            if now != was and path not in self.unstable:
                self.unstable.append(path)
        for directory, (sig, names) in (self.shadows or {}).items():
            # A shadow candidate that appeared since it was looked for, as one that exists once
            # the compile has ended would be: it may have been found first.
            if sig is None or dir_sig(directory) != sig:
                for rel in names:
                    path = os.path.join(directory, rel.partition(WAS)[0])
                    if name_appeared(directory, rel) and path not in self.unstable:
                        self.unstable.append(path)

    def result(self) -> Tracked:
        self.settle()
        record: dict[str, Any] = {"sigs": self.sigs}
        if self.search is not None:
            record["search"] = self.search.dirs  # the search order, as the compiler named its directories
            record["shadows"] = self.shadows
        if self.learned:
            remember_hashes(self.remembered, self.learned)
            self.learned = {}
        return Tracked(self.files, record, self.unstable + self.shadow_unstable)


# The SHA-256 of large tracked inputs (libc, libm, libstdc++ and the loader, which every link
# reads: 6 MiB, ~8 ms of hashing per build here), kept per user and host with their signatures
# (stubcache.key.probememo: this user's own state directory, never a cache root others can
# write). A file whose signature (device, inode, size, modification and change times) is the
# one recorded is not read again: the rule by which a hit trusts an entry's tracked inputs
# (stubcache.key.inputs.still_valid).
HASH_MEMO_KEY = "tracked input hashes v1"
HASH_MEMO_MIN_SIZE = 64 << 10  # smaller files cost less to hash than to remember
HASH_MEMO_MAX = 512  # files kept; the memo starts afresh past it


def hash_memo() -> dict[str, tuple[list[Any], str]]:
    """path -> (signature, sha256) from this user's memo; empty if there is none (or it is odd)."""
    from . import probememo

    out: dict[str, tuple[list[Any], str]] = {}
    data = probememo.read(HASH_MEMO_KEY)
    rows = data.get("files") if data else None
    if isinstance(rows, dict):
        for path, row in rows.items():
            if (isinstance(row, list) and len(row) == 2 and isinstance(row[0], list) and len(row[0]) == 5
                    and all(type(v) is int for v in row[0]) and isinstance(row[1], str) and len(row[1]) == 64):
                out[path] = (row[0], row[1])
    return out


def remember_hashes(known: dict[str, tuple[list[Any], str]], learned: dict[str, list[Any]]) -> None:
    from . import probememo

    rows: dict[str, list[Any]] = {} if len(known) + len(learned) > HASH_MEMO_MAX else {
        p: [sig, digest] for p, (sig, digest) in known.items()}
    rows.update(learned)
    probememo.write(HASH_MEMO_KEY, {"files": rows})


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:  # names are bytes
            return fh.read()
    except OSError:
        return ""


def _resolve_probe(name: str, search: SearchPath | None) -> str | None:
    """Where a ``__has_include`` name resolves now (first match in search order), or None."""
    if os.path.isabs(name):
        return name if os.path.isfile(name) else None
    for d in (search.dirs if search is not None else []):
        cand = os.path.join(d, name)
        if os.path.isfile(cand):
            return cand
    return None


def _driver_temporary(path: str) -> bool:
    """The compiler driver's own temporary object or assembly (``/tmp/ccXXXXXX.o``/``.s``),
    deleted after use.
    glibc ignores ``TMPDIR`` in a process whose effective and real ids differ, so it can land
    outside the build directory."""
    import re

    return re.fullmatch(r"cc[A-Za-z0-9]{6}\.[os]", os.path.basename(path)) is not None


def _unpinned_test(pinned: Sequence[str]) -> Callable[[str], bool]:
    """``not is_pinned(d, pinned)``, each directory resolved once (for one build's candidates:
    many share a directory, and each test resolves it with ``realpath``)."""
    pinned = list(pinned)
    seen: dict[str, bool] = {}

    def unpinned(d: str) -> bool:
        known = seen.get(d)
        if known is None:
            known = seen[d] = not is_pinned(d, pinned)
        return known

    return unpinned


def shadow_candidates(headers: list[str], search: SearchPath, pinned: Sequence[str] = (),
                      absent_names: Sequence[str] = (), beside: dict[str, Any] | None = None, started_ns: int | None = None,
                      unstable: list[Any] | None = None, present: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{directory: [dir signature, [names]]}``: for each header found under search directory D
    as ``rel``, the paths ``E/rel`` for every directory E searched before D (and every directory
    the compiler skipped as missing), and ``P/name`` for each ``#include "name"`` in a tracked
    header in directory P (``beside``: a quoted include looks beside the including file first),
    that do not exist now; for each of ``absent_names`` (a ``__has_include`` that found
    nothing), that name in every directory.
    Each candidate is filed under its deepest existing ancestor (whose mtime changes when a name
    appears in it) as the one name that would have to appear there. Directories under a pinned
    prefix are left out: their contents are pinned by version like the headers in them."""
    dirs = search.dirs
    unpinned = _unpinned_test(pinned)

    open_dirs = {d for d in dirs + search.missing if unpinned(d)}
    missing = [d for d in search.missing if d in open_dirs]
    cands: set[str] = set()
    for p, names in (beside or {}).items():
        if unpinned(p):
            cands.update(n if os.path.isabs(n) else os.path.join(p, n) for n in names)
    real_dirs: list[str] | None = None
    for header in headers:
        under = [(k, header[len(d.rstrip("/")) + 1:]) for k, d in enumerate(dirs) if header.startswith(d.rstrip("/") + "/")]
        if not under:
            # gcc names a header as it simplified the path (`dir/x/../inc` is `dir/inc` where
            # `x` is a plain directory) but lists its search directory as given: the header's
            # directory is then known by where both resolve.
            if real_dirs is None:
                real_dirs = [os.path.realpath(d).rstrip("/") + "/" for d in dirs]
            real = os.path.realpath(header)
            under = [(k, real[len(r):]) for k, r in enumerate(real_dirs) if real.startswith(r)]
        for k, rel in under:
            for e in dirs[:k] + missing:
                if e in open_dirs:
                    cands.add(os.path.join(e, rel))
    for name in absent_names:
        if os.path.isabs(name):
            cands.add(name)
            continue
        for e in dirs + missing:
            if e in open_dirs:
                cands.add(os.path.join(e, name))
    return file_candidates(cands, pinned, None, started_ns, unstable, present)


def passed_over(st: os.stat_result) -> list[int]:
    """What :meth:`Tracker.recheck` compares of something at a candidate's path that the compiler
    did not choose: a directory's type alone (any directory is passed over, and one written to
    during the build, a busy ``/tmp``, is no change), else its identity and change time."""
    if stat.S_ISDIR(st.st_mode):
        return [stat.S_IFDIR]
    return [st.st_dev, st.st_ino, st.st_mode, st.st_ctime_ns]


MAX_LINKS = 40  # Linux's limit on the links one path resolution follows (MAXSYMLINKS)


def file_candidates(cands: Iterable[str], pinned: Sequence[str] = (), out: dict[str, Any] | None = None,
                    started_ns: int | None = None, unstable: list[Any] | None = None,
                    present: dict[str, Any] | None = None) -> dict[str, Any]:
    """File absolute paths that would change the build if they appeared into ``out``
    (``{directory: [dir signature, [names]]}``, see :func:`shadow_candidates`). A candidate
    that exists already is not one; if it appeared after ``started_ns`` (while the build ran:
    the compiler may have searched before it did) it goes to ``unstable``. One that the
    compiler passed over (a directory, or a symbolic link, at the candidate's path or on the
    way to it) is filed as what it is (:data:`~stubcache.hit.WAS`), and a link's target path
    becomes a candidate too: resolved as the kernel would, through at most ``MAX_LINKS`` links."""
    unpinned = _unpinned_test(pinned)
    is_dir: dict[str, bool] = {}  # many candidates share their missing directories

    def isdir(d: str) -> bool:
        known = is_dir.get(d)
        if known is None:
            known = is_dir[d] = os.path.isdir(d)
        return known

    out = {} if out is None else out

    def file(anc: str, rel: str) -> None:
        slot = out.get(anc)
        if slot is None:
            slot = out[anc] = [recordable(dir_sig(anc)), []]
        if rel not in slot[1]:
            slot[1].append(rel)

    todo = [(c, 0) for c in sorted(set(cands))]  # (candidate, links followed to reach it)
    seen = {c for c, _ in todo}

    def passed_over_link(anc: str, name: str, rest: str, depth: int) -> None:
        # ``anc/name`` is a link the compiler went through to nothing it could read: filed as that
        # link (re-pointing it changes ``anc``), and where it points is a candidate.
        try:
            target = os.readlink(os.path.join(anc, name))
        except OSError:
            file(anc, name)  # (gone meanwhile: watched as a name)
            return
        file(anc, name + WAS + WAS_LINK + target)
        follow = os.path.join(anc, target, rest) if rest else os.path.join(anc, target)
        if follow not in seen and depth < MAX_LINKS:  # (beyond: ELOOP, the compiler finds nothing)
            seen.add(follow)
            todo.append((follow, depth + 1))

    first_st: dict[str, Any] = {}  # anc/first -> its lstat (None: absent), shared by a missing directory's candidates
    k = 0
    while k < len(todo):
        c, depth = todo[k]
        k += 1
        st = None
        if isdir(os.path.dirname(c)):  # (else nothing can be at c: no lstat, one per directory)
            try:
                st = os.lstat(c)
            except (OSError, ValueError):
                pass
        if st is not None:  # present and not chosen (#include_next, or another spelling) ...
            if (started_ns is not None and unstable is not None and not stat.S_ISDIR(st.st_mode)
                    and st.st_ctime_ns >= started_ns - slack_ns(st.st_ctime_ns)):
                unstable.append(c)  # ... unless it appeared while the compiler searched
            if present is not None:  # (what it was: Tracker.recheck looks again)
                present[c] = passed_over(st)
            parent, name = os.path.split(c)
            if unpinned(parent) and name:
                if stat.S_ISDIR(st.st_mode):
                    file(parent, name + WAS + WAS_DIR)
                elif stat.S_ISLNK(st.st_mode) and not os.path.isfile(c):
                    passed_over_link(parent, name, "", depth)  # dangling, a loop, or to a directory
            continue
        anc = os.path.dirname(c)
        while not isdir(anc) and anc not in ("/", ""):
            anc = os.path.dirname(anc)
        if not unpinned(anc):
            continue  # inside a pinned directory (a nested search dir's spelling): pinned too
        rel = c[len(anc.rstrip("/")) + 1:]  # c lies under anc as spelled (no relpath: it collapses `..`)
        first, _, rest = rel.partition(os.sep)
        head = os.path.join(anc, first)
        if head in first_st:
            fst = first_st[head]
        else:
            try:
                fst = first_st[head] = os.lstat(head)
            except (OSError, ValueError):
                fst = first_st[head] = None
        if fst is None:
            rel = first  # nothing under it can appear unless this name does
        elif stat.S_ISLNK(fst.st_mode) and rest:
            passed_over_link(anc, first, rest, depth)  # dangling, a loop, or a link to a file
            continue
        file(anc, rel)
    return out


def files_named_by_flags(flags: Iterable[str]) -> list[str]:
    """Absolute paths of existing files that flags name (``@RESPONSE`` files and the ones they
    name, ``-specs=FILE``, ``-fprofile-use=FILE``, ``-fplugin=FILE``, ``-Wl,--version-script,FILE``
    …): the compiler reads them, but not all of them reach its dependency output. Any flag value
    that is an absolute path to a regular file counts."""
    out: list[str] = []
    todo = list(flags)
    seen = 0
    while todo and seen < 1000:  # response files can name each other
        flag = todo.pop(0)
        seen += 1
        words = [flag[1:]] if flag.startswith("@") else []
        if flag.startswith(("-Wl,", "-Wa,", "-Wp,", "-Xlinker")):
            words += flag.split(",")[1:]
        words += [w.split("=", 1)[1] for w in [flag, *words] if "=" in w]
        words.append(flag)
        for w in words:
            w = w[1:] if w.startswith("@") else w
            if os.path.isabs(w) and w not in out and os.path.isfile(w):
                out.append(w)
                if flag.startswith("@") or (w != flag and flag.endswith("@" + w)):
                    import shlex

                    try:
                        todo += shlex.split(_read_text(w))
                    except ValueError:
                        pass
    return out


def search_list_candidates(deps: Iterable[str], dirs: Sequence[str]) -> list[str]:
    """Paths where a new file would change what the link read from a search list the driver
    walks itself (``dirs``: its ``libraries:`` list, for start files such as ``crti.o`` and, as
    ``-L``, the libraries it adds, ``-lstdc++``, ``-lc``): for each object, archive or shared
    library in ``deps`` found in one of ``dirs``, the same name in every directory before it."""
    index: dict[str, int] = {}
    for i, d in enumerate(dirs):
        if os.path.isabs(d):
            index.setdefault(kpath.tidy(d), i)
    out: list[str] = []
    for dep in deps:
        base = os.path.basename(dep)
        if not base.endswith((".o", ".so", ".a")):  # (a versioned libX.so.N is named, not searched for)
            continue
        at = index.get(os.path.dirname(kpath.tidy(dep)))
        if at:
            out += [os.path.join(d, base) for d in dirs[:at] if os.path.isabs(d)]
    return out


def prefix_list_candidates(deps: Iterable[str], dirs: Sequence[str]) -> list[str]:
    """Paths where a new file would change what a search along ``dirs`` found (GNU as's ``-I``
    directories for ``.include`` and ``.incbin``): for each of ``deps`` under one of ``dirs``, its
    path below that directory in every directory before it."""
    roots = [kpath.tidy(d) for d in dirs if os.path.isabs(d)]
    out: list[str] = []
    for dep in deps:
        path = kpath.tidy(dep)
        for i, root in enumerate(roots):
            if path.startswith(root + "/"):
                out += [os.path.join(r, path[len(root) + 1:]) for r in roots[:i]]
                break
    return out


def assembler_include_dirs(flags: Sequence[str]) -> list[str]:
    """GNU as's ``-I`` directories among compiler flags (``-Wa,-I,DIR``, ``-Wa,-IDIR``,
    ``-Xassembler -I -Xassembler DIR``), in order."""
    words: list[str] = []
    for i, f in enumerate(flags):
        if f.startswith("-Wa,"):
            words += f[4:].split(",")
        elif f == "-Xassembler" and i + 1 < len(flags):
            words.append(flags[i + 1])
    return option_values(words, "-I")


SPECS_DEPTH = 10  # %include levels of specs files followed


def specs_files(names: Iterable[str], dirs: Sequence[str]) -> tuple[list[str], list[str]]:
    """The specs files gcc reads for ``-specs=`` ``names`` and what they ``%include``
    (``%include_noerr``), recursively: a relative name is looked up along ``dirs`` (its start-file
    directories, :func:`stubcache.build.buildinputs._startfile_dirs`), the first regular file
    found. Returns ``(read, watch)``: the files read (absolute names given too), and the paths
    where a new file would be read instead (the name in every directory before the one it was
    found in, or in all of them, or an absolute ``%include_noerr`` name that does not exist)."""
    read: list[str] = []
    watch: list[str] = []
    todo = [(n, 0) for n in names]
    while todo:
        name, depth = todo.pop(0)
        if not name or "\0" in name:
            continue
        found = None
        if os.path.isabs(name):
            if os.path.isfile(name):
                found = name
            else:
                watch.append(name)
        else:
            for d in dirs:
                if not os.path.isabs(d):
                    continue
                path = os.path.join(d, name)
                if os.path.isfile(path):
                    found = path
                    break
                watch.append(path)
        if found is None or found in read:
            continue
        read.append(found)
        if depth < SPECS_DEPTH:
            todo += [(inc, depth + 1) for inc in _specs_includes(found)]
    return read, list(dict.fromkeys(watch))


def _specs_includes(path: str) -> list[str]:
    # The files a specs file names in %include <FILE> and %include_noerr <FILE> lines.
    out = []
    for line in (_small_text(path) or "").splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0] in ("%include", "%include_noerr"):
            arg = words[1].strip()
            if arg.startswith("<") and arg.endswith(">"):
                out.append(arg[1:-1])
    return out


SCRIPT_CAP = 1 << 20  # a linker script read for the names it hands the linker (libc.so's is 0.3 KiB)
_NOT_SCRIPTS = (b"\x7fELF", b"!<arch>\n", b"!<thin>\n")


class ScriptNames:
    """What the linker scripts a link read hand the linker (:func:`script_names`): ``pairs``,
    ``(script, name)`` with names as :func:`library_candidates` takes them; ``included``, the
    files their ``INCLUDE`` commands read, found as ld finds them (:data:`UNEXPRESSED` for one
    that cannot be); ``watch``, where the same name appearing would be included instead."""

    __slots__ = ("pairs", "included", "watch")

    def __init__(self) -> None:
        self.pairs: list[tuple[str, str]] = []
        self.included: list[str] = []
        self.watch: list[str] = []


SCRIPT_INCLUDE_DEPTH = 10  # INCLUDEs followed, nested; a loop ends at a file seen


def script_names(deps: Iterable[str], search_dirs: Iterable[str] = ()) -> ScriptNames:
    """What the linker scripts among ``deps`` (files the linker read) ask the linker to find:
    ``NAME`` for a ``-lNAME`` and ``:FILE`` for a file named by a relative path, in their
    ``INPUT``, ``GROUP`` and ``AS_NEEDED`` lists (Debian's ``libncurses.so`` is
    ``INPUT(libncurses.so.6 -ltinfo)``), and the same of the scripts they ``INCLUDE``. ld
    (2.40, checked) looks for an included file in its working directory (a build's private one)
    and then along the ``-L`` list, ``search_dirs`` here, and its dependency file names it as
    written: so it is found here again along ``search_dirs`` and tracked, and the name watched
    in the directories before it. A file that is not a regular file, is over :data:`SCRIPT_CAP`
    or cannot be read names nothing."""
    out = ScriptNames()
    dirs = [kpath.tidy(d) for d in search_dirs if os.path.isabs(d)]
    seen: set[str] = set()
    todo = [(dep, 0) for dep in deps
            if os.path.basename(dep).endswith((".so", ".a")) or ".so." in os.path.basename(dep)]  # a library's name
    while todo:
        path, level = todo.pop(0)
        text = _small_text(path, _NOT_SCRIPTS)
        if not text:
            continue
        names, includes = _script_inputs(text)
        out.pairs += [(path, name) for name in names]
        for name in includes:
            if os.path.isabs(name):
                found: str | None = name if os.path.isfile(name) else None
                before: list[str] = []
            else:
                at = next((i for i, d in enumerate(dirs) if os.path.isfile(os.path.join(d, name))), None)
                found = None if at is None else os.path.join(dirs[at], name)
                before = dirs if at is None else dirs[:at]
            if found in seen:
                continue
            out.watch += [os.path.join(d, name) for d in before]
            if found is None:
                out.included.append(UNEXPRESSED)  # read by the link, from where this cannot tell
            elif level < SCRIPT_INCLUDE_DEPTH:
                seen.add(found)
                out.included.append(found)
                todo.append((found, level + 1))
    return out


def script_dir_candidates(pairs: Iterable[tuple[str, str]], deps: Iterable[str]) -> list[str]:
    """Where a new file would change what a script's ``INPUT(FILE)`` links (``pairs`` from
    :func:`script_names`): ld (2.40, checked) looks for such a file in the script's own directory
    before the ``-L`` list, so ``FILE`` there is watched wherever the one linked was found (its
    build directory, which ld tries first too, is private). ``-lNAME`` in a script follows the
    ``-L`` list alone (:func:`library_candidates`)."""
    read = {kpath.tidy(d) for d in deps}
    out: list[str] = []
    for script, name in pairs:
        if name.startswith(":"):
            beside = kpath.tidy(os.path.join(os.path.dirname(script), name[1:]))
            if beside not in read:
                out.append(beside)
    return out


def _small_text(path: str, not_if: tuple[bytes, ...] = ()) -> str | None:
    # A regular file's text (links followed, never blocking on a FIFO, at most SCRIPT_CAP bytes),
    # or None: another type, too big, unreadable, or starting with one of ``not_if``.
    from ..edge import fsroot

    try:
        fd = fsroot.open_regular(None, path, follow=True)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size > SCRIPT_CAP or (not_if and os.pread(fd, 8, 0).startswith(not_if)):
            return None
        return fsroot.read_fd(fd, SCRIPT_CAP, path).decode("latin-1")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _script_inputs(text: str) -> tuple[list[str], list[str]]:
    # The names in the INPUT and GROUP lists of a linker script's text, and the files it
    # INCLUDEs, read as ld's lexer reads them, without ``re`` (its patterns cost a fresh engine
    # process's first build ~0.5 ms of compiling, after its compiler has finished): /* comments */
    # anywhere and # comments outside a list dropped; a word ends at a blank, a comma, a
    # semicolon, an =, a brace, a parenthesis or a quote; a "quoted" name is a file name; a
    # keyword is a whole word.
    names: list[str] = []
    includes: list[str] = []
    depth = 0  # inside an INPUT or GROUP list: its parentheses still open
    expect_list = expect_include = False
    for word, quoted in _script_words(text):
        if expect_include and (quoted or word not in ("(", ")")):
            includes.append(word)
        elif depth:
            if quoted:
                if word and not word.startswith("/"):
                    names.append(":" + word)
            elif word == "(":
                depth += 1
            elif word == ")":
                depth -= 1
            elif word.startswith("-l") and len(word) > 2:
                names.append(word[2:])
            elif word != "AS_NEEDED" and not word.startswith(("/", "-")):  # (sub/x.a: searched too)
                names.append(":" + word)
        elif expect_list and word == "(" and not quoted:
            depth = 1
        expect_list = not depth and not quoted and word in ("INPUT", "GROUP")
        expect_include = not depth and not quoted and word == "INCLUDE"
    return names, includes


_SCRIPT_BREAKS = frozenset(" \t\n\r\f\v,;={}()\"")


def _script_words(text: str) -> list[tuple[str, bool]]:
    # A linker script's words (each with whether it was quoted), its parentheses as words of
    # their own, comments left out: /* ... */ anywhere (one never closed is read on, watching
    # more), and # to the end of the line where a word would begin outside every parenthesis
    # (inside an INPUT or GROUP list, ld reads # as part of a name).
    words: list[tuple[str, bool]] = []
    depth = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = i + 2 if end < 0 else end + 2  # (never closed: ld refuses it; the rest is read)
            continue
        if c == "#" and depth == 0:
            end = text.find("\n", i)
            i = n if end < 0 else end + 1
            continue
        if c == '"':
            end = text.find('"', i + 1)
            end = n if end < 0 else end
            words.append((text[i + 1:end], True))
            i = end + 1
            continue
        if c in "()":
            depth = depth + 1 if c == "(" else max(depth - 1, 0)
            words.append((c, False))
            i += 1
            continue
        if c in _SCRIPT_BREAKS:
            i += 1
            continue
        start = i
        i += 1
        while i < n and text[i] not in _SCRIPT_BREAKS and not text.startswith("/*", i):
            i += 1
        words.append((text[start:i], False))
    return words


def library_candidates(deps: Iterable[str], lib_dirs: Iterable[str], lib_names: Iterable[str],
                       library_path: str | None) -> list[str]:
    """Paths where a new file would change what ``-lNAME`` links: for each library the linker
    read from a directory of the ``-L`` list (``lib_dirs``, given to the driver or through
    ``-Wl,``, in order; then ``LIBRARY_PATH``), ``libNAME.so`` and ``libNAME.a`` in every
    directory searched before it, and ``libNAME.so`` beside a chosen ``libNAME.a`` (the linker
    prefers the shared one in one directory). A library found in a default directory of the
    linker is shadowed by the whole list. ``lib_names``: the ``NAME`` of each ``-lNAME``."""
    names = list(lib_names)
    dirs = [kpath.tidy(d) for d in lib_dirs if os.path.isabs(d)]
    dirs += [kpath.tidy(d) for d in (library_path or "").split(":") if os.path.isabs(d)]
    wanted = {}
    files: list[str] | None
    for n in names:
        files = [n[1:]] if n.startswith(":") else [f"lib{n}.so", f"lib{n}.a"]
        for f in files:
            wanted[f] = files
    deep = {f: files for f, files in wanted.items() if "/" in f}  # a script's sub/libx.a: ld searches it too
    out: list[str] = []
    for dep in deps:
        base = os.path.basename(dep)
        files = wanted.get(base)
        if files is not None:
            where = os.path.dirname(kpath.tidy(dep))
        elif deep:
            tidy = kpath.tidy(dep)
            found = next((f for f in deep if tidy.endswith("/" + f)), None)
            if found is None:
                continue
            files, where = deep[found], tidy[:-len(found) - 1]
        else:
            continue
        before = dirs[:dirs.index(where)] if where in dirs else dirs
        out += [os.path.join(d, f) for d in before for f in files]
        if base.endswith(".a") and files[0].endswith(".so"):
            out.append(os.path.join(where, files[0]))
    return out
