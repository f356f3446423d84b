"""Shared fixtures: a private cache root per test, a compiler wrapper that counts compiles,
and a helper to run Python snippets in fresh OS processes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
# Test-only helpers shared with the benchmarks live there (``_synthetic``: synthetic store entries).
BENCH = REPO / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))


# The torch-free core (``-m core``, below) is what runs on every supported Python;
# torch's wheel is there only for some. A test needs torch if it imports it, builds through
# load_inline or checks the drop-in: those files are listed here, single tests elsewhere carry
# ``@pytest.mark.torch``. Where torch is missing they skip with that reason (the files that import
# it at module level are not even collected), so the core never fails for a missing torch.
HAS_TORCH = importlib.util.find_spec("torch") is not None
TORCH_FILES = ("test_dropin.py", "test_torch_builds.py", "test_kvarena_arena.py", "gpu")
if not HAS_TORCH:
    collect_ignore = ["test_dropin.py", "test_torch_builds.py", "test_kvarena_arena.py", "gpu"]


# The torch-free core, ``-m core``: what .ci/run runs on every supported Python besides the full
# suite on one. The issue-18 list: direct builds and hits in fresh processes, herds and
# exactly-once, locking and kill -9, trust and hostile roots, prune/verify/stats/ls/doctor, seeds
# and require-hit, the fleet tier with a real redis-server; and the version-sensitive parts (the
# private CPython interfaces, deep trees, descriptor leaks). Tests there that need torch are not in it.
CORE_FILES = (
    "test_core_processes.py", "test_locking.py", "test_trust.py", "test_hostile_root.py",
    "test_audit_trust.py", "test_prune.py", "test_stats.py", "test_cli.py", "test_remote.py",
    "test_remote_hostile.py", "test_remote_fetch.py", "test_fsroot_trees.py", "test_private_interfaces.py",
    "test_resource_leaks.py", "test_layering.py", "test_settings.py", "test_evict.py", "test_first_hour.py",
    "test_hit_records.py", "test_probe_memo.py", "test_results.py", "test_depfile_parse.py", "test_loadcheck.py",
    "test_import_path.py", "test_toolchain_probe.py", "test_link_prefetch.py", "test_early_start.py",
    "test_tracking_during_compile.py",
)


def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(tests_dir).parts
        if rel and rel[0] in TORCH_FILES:
            item.add_marker(pytest.mark.torch)
        if rel and rel[0] in CORE_FILES and item.get_closest_marker("torch") is None:
            item.add_marker(pytest.mark.core)
        if not HAS_TORCH and item.get_closest_marker("torch") is not None:
            item.add_marker(pytest.mark.skip(reason="needs torch, which is not installed here"))


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    """A private cache root, also exported as STUBCACHE_DIR for child processes."""
    root = tmp_path / "cache"
    monkeypatch.setenv("STUBCACHE_DIR", str(root))
    # The user's own state (the toolchain probes' memo, stubcache.key.probememo): one per test too,
    # so a test's first build probes as on a fresh host.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("STUBCACHE_REQUIRE_HIT", raising=False)
    monkeypatch.delenv("STUBCACHE_LOCK_TIMEOUT", raising=False)
    for name in list(os.environ):
        if name.startswith("STUBCACHE_REMOTE"):  # the fleet tier only where a test turns it on
            monkeypatch.delenv(name)
    return root


@pytest.fixture(scope="session")
def btrfs_dir(tmp_path_factory) -> Path:
    """A directory on a real btrfs filesystem (a loop-mounted image, made here; root only). On
    btrfs, ``stat`` reports each subvolume's own device while ``/proc/self/maps`` shows the
    filesystem's: the mapping check must not take that for another file."""
    if os.geteuid() != 0 or not shutil.which("mkfs.btrfs") or not shutil.which("mount"):
        pytest.skip("needs root, mkfs.btrfs (btrfs-progs) and mount to make a btrfs filesystem")
    base = tmp_path_factory.mktemp("btrfs")
    image, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    with open(image, "wb") as fh:
        fh.truncate(256 << 20)  # sparse: only what the tests write takes disk space
    for cmd in (["mkfs.btrfs", "-q", "-f", str(image)], ["mount", "-o", "loop", str(image), str(mnt)]):
        made = subprocess.run(cmd, capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make a btrfs filesystem here ({' '.join(cmd[:2])}: {made.stderr.strip()[-200:]})")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # a process still holds it
        image.unlink()


class CxxWrapper:
    """A ``CXX`` that logs every compile (an invocation with a source file, not one that only
    preprocesses it: the direct build's search probe reads ``main.cpp`` too) and then runs c++.

    ``STUBCACHE_TEST_CXX_SLEEP`` (seconds) makes each compile sleep first, to widen windows for
    crash tests; ``STUBCACHE_TEST_CXX_MARK`` is a file created when a compile starts.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / "cxx-wrapper.sh"
        self.log = directory / "cxx.log"
        # The compiler CXX names when the run sets one (the clang combination: CXX=clang++), else c++.
        real = shutil.which(os.environ.get("CXX") or "c++") or shutil.which("c++") or "c++"
        self.real = real
        self.path.write_text(textwrap.dedent(f"""\
            #!/bin/sh
            case " $* " in
              *" -E "*) ;;
              *.cpp*|*.cu\\ *|*.c\\ *)
                line=$(echo "$$ $*" | tr '\\n' ' ')  # one line per compile, whatever its arguments hold
                echo "$line" >> "{self.log}"
                if [ -n "$STUBCACHE_TEST_CXX_MARK" ]; then : > "$STUBCACHE_TEST_CXX_MARK"; fi
                if [ -n "$STUBCACHE_TEST_CXX_SLEEP" ]; then sleep "$STUBCACHE_TEST_CXX_SLEEP"; fi
                ;;
            esac
            exec "{real}" "$@"
            """))
        self.path.chmod(0o755)

    @property
    def is_gcc(self) -> bool:
        """True if the compiler behind the wrapper is gcc (specs files, ``-B`` for cc1plus and
        GNU as are gcc's; clang takes the flags and ignores or handles them differently)."""
        out = subprocess.run([self.real, "--version"], capture_output=True, text=True).stdout
        return "clang" not in out.lower()

    def compiles(self) -> int:
        if not self.log.exists():
            return 0
        return len([ln for ln in self.log.read_text().splitlines() if ln.strip()])

    def reset(self) -> None:
        if self.log.exists():
            self.log.unlink()


@pytest.fixture
def cxx(tmp_path, monkeypatch) -> CxxWrapper:
    """Install a compile-counting compiler wrapper as CXX (inherited by child processes)."""
    d = tmp_path / "cxx"
    d.mkdir()
    w = CxxWrapper(d)
    monkeypatch.setenv("CXX", str(w.path))
    return w


def run_py(code: str, *, env: dict | None = None, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process (inheriting os.environ plus ``env``)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


_spawned: list[subprocess.Popen] = []
_TESTS_DIR = str(Path(__file__).resolve().parent) + os.sep
_popen_init = subprocess.Popen.__init__


def _tracked_popen_init(self, *args, **kwargs):
    _popen_init(self, *args, **kwargs)
    pipes = (self.stdin, self.stdout, self.stderr) != (None, None, None)
    if pipes and sys._getframe(1).f_code.co_filename.startswith(_TESTS_DIR):
        _spawned.append(self)


@pytest.fixture(autouse=True)
def _reap_spawned(monkeypatch):
    """The processes with pipes that a test starts itself (``subprocess.Popen`` called from a file
    under tests/, :func:`spawn_py` included) have their pipes closed once they have exited: after
    the test if it reaped them (``kill(); wait()``), else after a later test or at the end of the
    session, when any still running are killed. The suite runs with ResourceWarning as an error;
    processes the library starts are not tracked, so a pipe stubcache leaks still fails."""
    monkeypatch.setattr(subprocess.Popen, "__init__", _tracked_popen_init)
    yield
    _close_exited(kill=False)


def _close_exited(kill: bool) -> None:
    for p in list(_spawned):
        if p.poll() is None:
            if not kill:
                continue
            p.kill()
            p.wait()
        _spawned.remove(p)
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None and not f.closed:
                f.close()


def pytest_sessionfinish(session, exitstatus):
    _close_exited(kill=True)


def spawn_py(code: str, *, env: dict | None = None) -> subprocess.Popen:
    """Start ``code`` in a fresh Python process without waiting (reaped after the test)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(ready: Callable[[], object], what: str, *, timeout: float = 60,
               proc: subprocess.Popen | None = None) -> None:
    """Poll ``ready()`` until it is true: how a test waits for another process to reach a state
    (never a fixed sleep). Fails after ``timeout`` seconds, or at once if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process {proc.pid} exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


def open_files(pid: int) -> set[str]:
    """The files process ``pid`` holds open (its ``/proc`` descriptor table)."""
    names = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return names
    for fd in fds:
        try:
            names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return names


def run_on_pty(code: str, env: dict) -> str:
    """Run ``code`` with stdin/stdout/stderr on a pseudo-terminal; return what it wrote."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, env=env,
                            close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")
