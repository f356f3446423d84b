"""A miss's compile, begun by the compact path before the full path is imported.

An engine's first call of a new stub in a root it has built in pays ~10 ms of imports and key
work (the cache, the key, the fingerprint, the builder) before its compiler starts. The process
whose turn it is to serve a request with no hit record (:func:`stubcache.hit.request_turn`)
therefore starts the compile here, from a **start template**: the direct build's command with
the stub's name and build directory left open, which the full path leaves in the root's
``v1/state/start-<digest>.json`` after a direct build (``digest``: the process's environment,
as :func:`stubcache.hit.request_digest` takes it, and the key variables' values;
:func:`template_digest`). The full path takes the
compile over only if it is the very command, source and directory it would run
(:meth:`stubcache.cache.core.CacheCore.get_or_build_since`, ``begun``); anything else (a hit by
key, another command, a failed lookup) stops it: its whole session killed, its directory removed.

Only for a plain call (a drop-in ``load_inline`` with ``no_implicit_headers=True``, not ``verbose``, no flags,
no include paths, ASCII sources that need nothing of torch's), in a root that passes the private
rule, with ``STUBCACHE_REQUIRE_HIT`` unset. The template is read as a hit record is (a regular
file owned by this user or root, writable by no one else, capped): it names a program to run,
as a record names a library to load. This module is imported on a miss only.
"""

from __future__ import annotations

import os
import time

from . import (FLAG_TRUE, LAYOUT, Miss, default_root, env_holds, key_env_rows, open_layout, open_private_subdir,
               open_state, read_private, record_name, request_digest, staging_name, torch_is, versions)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from typing import Any

TEMPLATE_FORMAT = 1
TEMPLATE_CAP = 64 << 10
# The slots of a template's command: the stub's name, and its build directory (a path no build
# directory has: the full path compares the filled-in command with its own, word for word).
NAME_SLOT = "stubcache_name_slot_0d5e"
DIR_SLOT = "/stubcache-build-dir-slot-0d5e"
PREFIX_SLOT = f"-ffile-prefix-map={DIR_SLOT}=."  # prefix_map_flags(DIR_SLOT): DIR_SLOT is no path
ORIGIN = "started before the lookup"  # how the full path's log line names such a compile


def prefix_map_flags(build_dir: str) -> list[str]:
    """Map the random staging directory to ``.`` in file names, debug info and macros: its real
    path and, where it differs, the path as named (stubcache.build.buildinputs uses this one)."""
    real = os.path.realpath(build_dir)
    return [f"-ffile-prefix-map={d}=." for d in dict.fromkeys((real, build_dir))]


def template_name(digest: str) -> str:
    return f"start-{digest}.json"


def template_digest() -> str | None:
    """The digest naming this process's start template: its environment as a record's digest
    takes it, and the key variables' values (two environments that differ only there, ``LANG``
    set or not, keep a template each instead of overwriting one)."""
    return request_digest("start", (key_env_rows(),))


class StartTemplate:
    """A start template: ``cmd`` (the direct build's command, with :data:`NAME_SLOT`,
    :data:`DIR_SLOT` and :data:`PREFIX_SLOT` for what differs between builds), ``env`` (the key
    environment variables' values it was made under, as in a hit record) and ``torch`` (the torch
    directory its include flags name, ``None``: none)."""

    __slots__ = ("cmd", "env", "torch")

    def __init__(self, cmd: list[str], env: list[Any], torch: str | None) -> None:
        self.cmd = cmd
        self.env = env
        self.torch = torch

    def to_dict(self) -> dict[str, Any]:
        return {"format": TEMPLATE_FORMAT, "cmd": self.cmd, "env": self.env, "torch": self.torch}

    @classmethod
    def from_dict(cls, data: object) -> "StartTemplate | None":
        """The template in ``data`` (as read from a file), or ``None`` if it is not a well-formed one."""
        if type(data) is not dict or data.get("format") != TEMPLATE_FORMAT:
            return None
        cmd, env, torch = data.get("cmd"), data.get("env"), data.get("torch", False)
        if type(cmd) is not list or not cmd or len(cmd) > 256 or type(env) is not list:
            return None
        for word in cmd:
            if type(word) is not str or not word or "\0" in word:
                return None
        for row in env:
            if not (type(row) is list and len(row) == 2 and type(row[0]) is str
                    and (row[1] is None or type(row[1]) is str)):
                return None
        if torch is not None and type(torch) is not str:
            return None
        return cls(cmd, env, torch)

    def command(self, name: str, build_dir: str) -> list[str]:
        """The command for stub ``name`` built in ``build_dir``."""
        out: list[str] = []
        for word in self.cmd:
            if word == PREFIX_SLOT:
                out += prefix_map_flags(build_dir)
            else:
                out.append(word.replace(DIR_SLOT, build_dir).replace(NAME_SLOT, name))
        return out


def plain_source(args: dict[str, Any]) -> str | None:
    """The ``main.cpp`` a drop-in call with these arguments builds, if the call may start its
    compile early (see the module docstring), else ``None``."""
    if (args["no_implicit_headers"] is not True or args["verbose"] or args["functions"] is not None or args["extra_cflags"]
            or args["extra_ldflags"] or args["extra_include_paths"] or args["extra_cuda_cflags"]
            or args["cuda_sources"] or args["with_cuda"]):
        return None
    sources = args["cpp_sources"]
    if type(sources) is str:
        sources = [sources]
    elif type(sources) not in (list, tuple) or not sources:
        return None
    for text in sources:
        if type(text) is not str or not text.isascii() or "\0" in text:
            return None
    from ..key import mentions_torch  # (the full path's rule: the full path imports it next anyway)

    return None if mentions_torch(sources) else "\n".join(sources)  # main.cpp, as stubcache.build.builder writes it


class Begun:
    """A compile begun here: ``cmd`` run by ``proc`` in ``build_dir`` (its own session) since
    ``started_ns``, on ``source`` (``main.cpp``), in the staging directory ``staging``. The full
    path takes it (:meth:`take`) or it is stopped (:meth:`discard`): one of the two, once."""

    __slots__ = ("proc", "cmd", "build_dir", "started_ns", "staging", "source")

    def __init__(self, proc: subprocess.Popen[bytes], cmd: list[str], build_dir: str, started_ns: int,
                 staging: str, source: str) -> None:
        self.proc: subprocess.Popen[bytes] | None = proc
        self.cmd = cmd
        self.build_dir = build_dir
        self.started_ns = started_ns
        self.staging = staging
        self.source = source

    def take(self) -> subprocess.Popen[bytes] | None:
        """The compile's process, now the caller's (``None``: taken or stopped already)."""
        proc, self.proc = self.proc, None
        return proc

    def discard(self) -> None:
        """Stop the compile (if not taken) and remove its staging directory."""
        proc = self.take()
        if proc is None:
            return
        try:
            stop_session(proc)
        finally:
            _remove(self.staging)


def stop_session(proc: subprocess.Popen[bytes]) -> None:
    """Kill a compiler driver started in its own session, and every program it started (so no
    cc1plus, as or ld keeps writing in its directory), and reap it."""
    if proc.poll() is None:  # (not reaped: its pid, the session's id, is still its own)
        import signal

        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    if proc.returncode is None or proc.stdout is not None and not proc.stdout.closed:
        proc.communicate()


def _remove(path: str) -> None:
    from ..edge import fsroot

    fsroot.rmtree(path)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def read_template(state_fd: int, digest: str) -> StartTemplate | None:
    """The template for ``digest`` in the ``state/`` directory open as ``state_fd``, read as a
    hit record is; ``None`` if there is none or it is not one to trust."""
    return StartTemplate.from_dict(read_private(state_fd, template_name(digest), TEMPLATE_CAP))


def begin(name: str, args: dict[str, Any], miss: Miss) -> None:
    """Start the compile of drop-in call ``args`` (stub ``name``) in a new staging directory of
    the default root, from this environment's start template, and hand it to ``miss`` (its
    ``begun``); nothing where none may start or anything is not as expected (the full path then
    builds as usual). Never raises but for an interrupt, and leaves nothing running then."""
    if name in versions or len(name) > 100:  # loaded here already (the full path's memo answers,
        return  # most likely), or a name the spec refuses
    source = plain_source(args)
    root = default_root()
    # (with STUBCACHE_REQUIRE_HIT a miss may not build: the full path raises)
    if source is None or root is None or os.environ.get("STUBCACHE_REQUIRE_HIT", "").strip().lower() in FLAG_TRUE:
        return
    digest = template_digest()
    if digest is None:
        return
    staging = proc = None
    try:
        state_fd = open_state(root)
        if state_fd is None:
            return
        try:
            template = read_template(state_fd, digest)
            if template is not None and miss.digest is not None and _exists(state_fd, record_name(miss.digest)):
                # A record that did not answer: most likely the key still hits (a validator
                # moved); or one written since this process looked (the full path leaves it
                # before the template, so a build that served this very call is seen here).
                return
        finally:
            os.close(state_fd)
        if template is None or not torch_is(template.torch) or not env_holds(template.env):
            return
        started_ns = time.time_ns()
        base_fd = open_layout(root)
        if base_fd is None:
            return
        try:
            sfd = open_private_subdir(base_fd, "staging", make=True)
        finally:
            os.close(base_fd)
        try:
            dir_name = staging_name(os.urandom(8).hex())  # (as a probe's early compile names it: no key yet)
            os.mkdir(dir_name, 0o700, dir_fd=sfd)
            staging = os.path.join(root, LAYOUT, "staging", dir_name)
            os.mkdir(f"{dir_name}/build", 0o700, dir_fd=sfd)
        finally:
            os.close(sfd)
        build_dir = os.path.join(staging, "build")
        with open(os.path.join(build_dir, "main.cpp"), "xb") as fh:  # (O_EXCL: a link there is not followed)
            fh.write(source.encode())
        cmd = template.command(name, build_dir)
        import subprocess

        proc = subprocess.Popen(cmd, cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TMPDIR=build_dir), start_new_session=True)
        miss.begun = Begun(proc, cmd, build_dir, started_ns, staging, source)
    except BaseException as exc:
        try:
            if proc is not None:
                stop_session(proc)
        finally:
            if staging is not None:
                _remove(staging)
        if not isinstance(exc, Exception):
            raise  # an interrupt; anything else only cost the head start
