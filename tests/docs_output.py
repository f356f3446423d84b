"""Output shown in the docs, made by the program (tests/test_docs_output.py).

A fenced block in ``docs/*.md`` preceded by ``<!-- output: NAME -->`` is the transcript of the
scenario ``NAME`` in :data:`SCENARIOS`: shell commands run in a scratch directory against a real
cache root (real builds of small header-free stubs, real processes, a real ``redis-server`` for
the remote ones), each shown as ``$ COMMAND`` followed by what it printed (stdout and stderr, in
order). The test compares every marked block with a fresh run after :func:`normalize`;
``STUBCACHE_WRITE_DOCS=1`` rewrites the blocks from the fresh run instead (then review the diff).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SHOWN_TMP = "/tmp/demo"  # the scratch directory as the docs show it (its cache root: /tmp/demo/cache)
MARKER = re.compile(r"^( *)<!-- output: ([\w.-]+) -->\n\1```\n(.*?)\n\1```$", re.DOTALL | re.MULTILINE)


def stub_spec(name: str, value: int) -> str:
    """A header-free stub's spec as JSON (``StubSpec.to_json()``): builds in well under a second."""
    from stubcache import StubSpec

    return StubSpec(name, f'extern "C" int {name}_value(void) {{ return {value}; }}\n').to_json()


class Session:
    """A scratch directory with a cache root, a ``stubcache`` command on ``PATH`` that runs this
    checkout, and the transcript of the commands shown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = tmp / "cache"
        self.rc = 0
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        (bin_dir / "stubcache").write_text(f'#!/bin/sh\nexec {sys.executable} -m stubcache "$@"\n')
        (bin_dir / "stubcache").chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("STUBCACHE_") and k != "CXX"}
        self.env = dict(env, PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=str(REPO),
                        STUBCACHE_DIR=str(self.root), TZ="UTC", COLUMNS="100", PYTHONUNBUFFERED="1")
        self.lines: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def spec(self, name: str, value: int) -> str:
        (self.tmp / f"{name}.json").write_text(stub_spec(name, value))
        return f"{name}.json"

    def sh(self, cmd: str, *, show: bool = True, note: str = "", **env: str) -> str:
        """Run ``cmd`` with bash in the scratch directory; record ``$ cmd`` and its output
        (``echo $?`` shows the exit status of the command before)."""
        if cmd == "echo $?":  # each command runs in its own shell
            self.lines += ["$ echo $?", str(self.rc)]
            return str(self.rc)
        proc = subprocess.run(["bash", "-c", cmd], check=False, cwd=self.tmp, env=dict(self.env, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                              timeout=300)
        self.rc = proc.returncode
        if show:
            self.lines.append(f"$ {cmd}" + (f"        # {note}" if note else ""))
            self.lines += proc.stdout.rstrip("\n").split("\n") if proc.stdout.strip() else []
        return proc.stdout

    def gap(self) -> None:
        self.lines.append("")

    def load(self, spec_file: str) -> None:
        """Another process loads the entry of ``spec_file`` (a hit) and exits."""
        code = ("from stubcache import StubCache, StubSpec\n"
                f"StubCache().get_or_build(StubSpec.from_json(open({spec_file!r}).read()))")
        subprocess.run([sys.executable, "-c", code], cwd=self.tmp, env=self.env, check=True, timeout=120)

    def hold(self, spec_file: str) -> None:
        """A live process that has loaded the entry of ``spec_file`` (until the scenario ends)."""
        code = ("import sys; from stubcache import StubCache, StubSpec\n"
                f"StubCache().get_or_build(StubSpec.from_json(open({spec_file!r}).read()))\n"
                "print('ready', flush=True); sys.stdin.read()")
        p = subprocess.Popen([sys.executable, "-c", code], cwd=self.tmp, env=self.env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        self.procs.append(p)

    def dead_pid(self) -> int:
        p = subprocess.Popen(["true"])
        p.wait()
        return p.pid

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()

    def transcript(self) -> str:
        text = "\n".join(self.lines).rstrip("\n")
        return text.replace(str(self.tmp), SHOWN_TMP)


# --- scenarios -------------------------------------------------------------------------------


def three_entries(s: Session) -> None:
    s.sh(f"stubcache warm {s.spec('alloc', 1)} {s.spec('launcher', 2)} {s.spec('shim', 3)}", show=False)


def cli_ls(s: Session) -> None:
    three_entries(s)
    s.sh("stubcache ls")
    s.gap()
    s.sh("stubcache ls --format json --name shim")


def cli_prune(s: Session) -> None:
    three_entries(s)
    s.load("alloc.json")
    s.load("launcher.json")
    s.sh("stubcache prune --dry-run --max-size 50K --older-than 14d")
    s.gap()
    s.hold("shim.json")
    key = s.sh("stubcache ls --format csv --name launcher", show=False).splitlines()[1].split(",")[0]
    (s.root / "v1" / "staging" / f"{key}-{s.dead_pid()}-k0").mkdir(parents=True)  # a killed builder's
    s.sh("stubcache prune --max-size 1K --yes", note='"shim" is loaded by a running process')


def cli_prune_never_hit(s: Session) -> None:
    s.sh(f"stubcache warm {s.spec('stub1', 1)} {s.spec('stub2', 2)}", show=False)
    s.load("stub1.json")
    s.sh("stubcache prune --max-size 30K --dry-run", note="stub1 was hit by a second process, stub2 never")


def cli_stats_reset(s: Session) -> None:
    s.sh(f"stubcache warm {s.spec('stub1', 1)}", show=False)
    s.load("stub1.json")
    s.sh("stubcache stats --reset")
    s.sh("stubcache stats | head -7")


def cli_rm(s: Session) -> None:
    s.sh(f"stubcache warm {s.spec('stub1', 1)} {s.spec('stub2', 2)} {s.spec('stub3', 3)}", show=False)
    s.hold("stub1.json")
    two = s.sh("stubcache ls --format csv --name stub2", show=False).splitlines()[1].split(",")[0][:8]
    three = s.sh("stubcache explain stub3.json --format json", show=False)
    spec3 = re.search(r'"spec_key": "([0-9a-f]+)"', three).group(1)[:8]  # type: ignore[union-attr]
    s.sh("stubcache explain stub3.json | head -3")
    s.sh(f"stubcache rm {two} --dry-run")
    s.sh(f"stubcache rm {two} --yes")
    s.sh(f"stubcache rm {two} --yes")
    s.sh(f"stubcache rm {spec3} --yes", note="stub3's spec key, as `explain` prints it")
    s.sh("stubcache rm --name 'stub*' --yes", note="stub1 is loaded by a running process")
    s.sh("echo $?")


def cli_clear_stats(s: Session) -> None:
    s.sh(f"stubcache warm {s.spec('hello', 1)}", show=False)
    s.load("hello.json")
    s.sh("stubcache clear --stats --yes")
    s.sh("stubcache prune --older-than 30d --yes")


def cli_clear_no_terminal(s: Session) -> None:
    three_entries(s)
    s.sh("stubcache clear")
    s.sh("echo $?")


def cli_doctor(s: Session) -> None:
    three_entries(s)
    s.sh("stubcache init", show=False)
    key = s.sh("stubcache ls --format csv --name shim", show=False).splitlines()[1].split(",")[0]
    os.chmod(s.root / "v1" / "entries" / key, 0o775)
    s.sh("stubcache doctor")
    s.sh("stubcache doctor --fix")


def ops_compile_error(s: Session) -> None:
    code = textwrap.dedent("""\
        from stubcache import BuildError, StubCache, StubSpec
        try:
            StubCache().get_or_build(StubSpec("broken", "int x = ;\\n"))
        except BuildError as e:
            print(f"{type(e).__module__}.{type(e).__name__}: {e}")
        """)
    (s.tmp / "broken.py").write_text(code)
    out = s.sh("python broken.py", show=False)
    s.lines += out.rstrip("\n").split("\n")


def ops_phases(s: Session) -> None:
    code = textwrap.dedent("""\
        import logging, stubcache
        logging.basicConfig(format="%(message)s")
        logging.getLogger("stubcache").setLevel(logging.DEBUG)
        stubcache.load_inline("phases", 'extern "C" int f(void) { return 1; }', is_python_module=False,
                              no_implicit_headers=True)
        """)
    (s.tmp / "phases.py").write_text(code)
    state = {"XDG_STATE_HOME": str(s.tmp / "state")}
    # A host and a root that have built before, from a script beside it (the same sys.path: the
    # same environment, so its start template applies)
    (s.tmp / "other.py").write_text('import stubcache\nstubcache.load_inline("other", "int g() { return 2; }", '
                                    'is_python_module=False, no_implicit_headers=True)\n')
    s.sh("python other.py", show=False, **state)
    s.sh("cat phases.py")
    s.sh("python phases.py", **state)


def cache_build_error(s: Session) -> None:
    code = ('import stubcache\ntry:\n    stubcache.load_inline("broken", "int f() { return nope; }", '
            'is_python_module=False, no_implicit_headers=True)\nexcept stubcache.BuildError as e:\n'
            '    print(f"BuildError: {e}")\n')
    (s.tmp / "broken.py").write_text(code)
    s.lines.append('>>> stubcache.load_inline("broken", "int f() { return nope; }", is_python_module=False, '
                   "no_implicit_headers=True)")
    s.lines += s.sh("python broken.py", show=False).rstrip("\n").split("\n")


def _with_redis(s: Session, body: Callable[[Session, str], None]) -> None:
    from .redis_server import RedisServer

    with RedisServer("--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru") as server:
        s.env.update(STUBCACHE_REMOTE=server.url, STUBCACHE_REMOTE_SECRET="0123456789abcdef" * 2)
        body(s, server.url)


def remote_ls(s: Session) -> None:
    def body(s: Session, url: str) -> None:
        s.sh(f"stubcache warm {s.spec('kv_alloc', 1)}", show=False)
        s.sh("stubcache ls --remote")
    _with_redis(s, body)


def remote_prune(s: Session) -> None:
    def body(s: Session, url: str) -> None:
        s.sh(f"stubcache warm {s.spec('kv_alloc', 1)}", show=False)
        time.sleep(1.1)
        s.sh("stubcache prune --remote --max-age 1s --dry-run")
    _with_redis(s, body)


def remote_stats(s: Session) -> None:
    def body(s: Session, url: str) -> None:
        s.sh(f"stubcache warm {s.spec('kv_alloc', 1)}", show=False)
        s.sh("STUBCACHE_DIR=$PWD/host-b stubcache warm kv_alloc.json", show=False)  # a second host
        s.sh("STUBCACHE_DIR=$PWD/host-b stubcache stats | tail -7")
    _with_redis(s, body)


def remote_doctor(s: Session) -> None:
    def body(s: Session, url: str) -> None:
        s.sh(f"stubcache warm {s.spec('kv_alloc', 1)}", show=False)
        s.lines += [ln for ln in s.sh("stubcache doctor", show=False).split("\n") if "] remote" in ln]
    _with_redis(s, body)


def cache_verbose(s: Session) -> None:
    (s.tmp / "hello.py").write_text('import stubcache\nstubcache.load_inline("hello", \'extern "C" int hello(void) '
                                    '{ return 1; }\', is_python_module=False, no_implicit_headers=True, verbose=True)\n')
    s.lines += s.sh("python hello.py", show=False).rstrip("\n").split("\n")


def cli_verify(s: Session) -> None:
    three_entries(s)
    s.sh("stubcache verify")


def cli_explain_stale(s: Session) -> None:
    import json

    (s.tmp / "inc").mkdir()
    (s.tmp / "inc" / "val.h").write_text("#define VAL 1\n")
    (s.tmp / "spec.json").write_text(json.dumps({
        "name": "explained", "cpp_sources": '#include "val.h"\nextern "C" int value(void) { return VAL; }\n',
        "extra_include_paths": [str(s.tmp / "inc")]}))
    s.sh("stubcache warm spec.json", show=False)
    (s.tmp / "inc" / "val.h").write_text("#define VAL 2\n")
    s.sh("stubcache explain spec.json | grep -v '^fingerprint\\.'")


def cli_explain_closest(s: Session) -> None:
    import json

    s.sh(f"stubcache warm {s.spec('launcher', 1)}", show=False)
    spec = json.loads(stub_spec("launcher", 1))
    spec["extra_cflags"] = ["-O2"]
    (s.tmp / "launcher-O2.json").write_text(json.dumps(spec))
    s.sh("stubcache explain launcher-O2.json | grep -v '^fingerprint\\.'")


def cli_warm(s: Session) -> None:
    import json

    s.spec("alloc", 1)
    (s.tmp / "specs.json").write_text(json.dumps([json.loads(stub_spec("launcher", 2)),
                                                  json.loads(stub_spec("shim", 3))]))
    s.sh("stubcache warm alloc.json")
    s.sh("stubcache warm specs.json")


def cli_warm_not_stored(s: Session) -> None:
    s.spec("alloc", 1)
    (s.tmp / "blk").write_text("")
    s.sh("stubcache --cache-dir blk/cache warm alloc.json")
    s.sh("echo $?")


def cli_stats(s: Session) -> None:
    three_entries(s)
    s.load("alloc.json")
    s.load("shim.json")
    s.sh("stubcache stats")


def cli_stats_prometheus(s: Session) -> None:
    s.sh(f"stubcache warm {s.spec('alloc', 1)}", show=False)
    s.load("alloc.json")
    s.sh("stubcache stats --format prometheus | head -6")


def cli_config(s: Session) -> None:
    s.sh("stubcache init", show=False)
    s.sh("stubcache config")
    s.sh("stubcache config set max_size off")
    s.sh("STUBCACHE_MAX_SIZE=1G stubcache config", note="a user can tighten a root's cap, never loosen it")
    s.sh("stubcache config set max_size 2G")
    s.sh("STUBCACHE_MAX_SIZE=1G stubcache config")
    s.sh("stubcache config set max_size 10")


SCENARIOS: dict[str, Callable[[Session], None]] = {
    "cli-ls": cli_ls, "cli-prune": cli_prune, "cli-prune-never-hit": cli_prune_never_hit,
    "cli-stats-reset": cli_stats_reset, "cli-rm": cli_rm, "cli-clear-stats": cli_clear_stats,
    "cli-clear-no-terminal": cli_clear_no_terminal, "cli-verify": cli_verify,
    "cli-explain-stale": cli_explain_stale, "cli-explain-closest": cli_explain_closest, "cli-warm": cli_warm,
    "cli-warm-not-stored": cli_warm_not_stored, "cli-stats": cli_stats, "cli-stats-prometheus": cli_stats_prometheus,
    "cli-config": cli_config, "cli-doctor": cli_doctor,
    "ops-compile-error": ops_compile_error, "ops-phases": ops_phases, "cache-build-error": cache_build_error,
    "cache-verbose": cache_verbose,
    "remote-ls": remote_ls, "remote-doctor": remote_doctor, "remote-prune": remote_prune, "remote-stats": remote_stats,
}


def run_scenario(name: str) -> str:
    """The transcript of scenario ``name``, run in a fresh scratch directory under ``/tmp``
    (always there, whatever ``TMPDIR`` says: ``doctor``'s output depends on it)."""
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="stubcache-docs-", dir="/tmp"))
    s = Session(tmp)
    try:
        SCENARIOS[name](s)
    finally:
        s.close()
        subprocess.run(["chmod", "-R", "u+rwX", str(tmp)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    return s.transcript()


# --- comparing -------------------------------------------------------------------------------

_SIZE = re.compile(r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)\b")
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}
_MASKS = [  # (pattern, replacement), in order: what must vary between runs and machines
    # Logged only where the search probe finishes before the compiler does (a race on a loaded
    # machine: CI once ran the compile faster): shown in the docs, not required of a run.
    (re.compile(r"^stubcache: \w+: \d+ inputs tracked while the compiler runs\n", re.M), ""),
    (re.compile(r"rediss?://[^\s),]+"), "<URL>"),
    (re.compile(r"free space: .*"), "free space: <FREE>"),
    (re.compile(r"within .* used\)"), "within <MEM>"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"), "<TIME>"),
    (re.compile(r"\(\d+ bytes\)"), "(<N> bytes)"),
    (re.compile(r'"(size|created|last_used|build_seconds)": [\d.e+-]+'), r'"\1": <N>'),
    (re.compile(r"(?<![\w/])/[^\s:()'\",;]*"), "<PATH>"),
    (re.compile(r"[0-9a-f]{8,}"), "<HEX>"),
    (re.compile(r"\b(pid|process) \d+"), r"\1 <PID>"),
    (re.compile(r"<HEX>-\d+-\w+"), "<HEX>-<PID>-<R>"),
    (re.compile(r"\b\d+(?:\.\d+)?(?:s|ms|m|h|d|w)\b"), "<T>"),
    (re.compile(r"\b\d+(?:\.\d+)? ms\b"), "<T>"),
    (re.compile(r"\b(?:c\+\+|g\+\+|gcc|clang|x86_64-linux-gnu-g\+\+-\d+)\b"), "<CC>"),
    (re.compile(r"\d+\.\d+\.\d+(?:[+-][\w.+-]*)?"), "<VER>"),
    (re.compile(r"\d+(?:\.\d+)? ms round trip"), "<T> round trip"),
    (re.compile(r"[ \t]+"), " "),
]


def normalize(text: str) -> tuple[str, list[float]]:
    """The text with what must vary masked (times, ages, paths, keys, pids, versions, compiler
    names; runs of spaces, so table columns may widen), and the sizes it shows, in bytes."""
    sizes = [float(m.group(1)) * _UNITS[m.group(2)] for m in _SIZE.finditer(text)]
    text = _SIZE.sub("<SIZE>", text)
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return "\n".join(line.rstrip() for line in text.split("\n")), sizes


def sizes_agree(a: list[float], b: list[float]) -> bool:
    """Sizes "within reason": each within a factor of two (another compiler, another libc)."""
    return len(a) == len(b) and all((x == y == 0) or (x > 0 and y > 0 and 0.5 <= x / y <= 2) for x, y in zip(a, b))


def marked_blocks() -> list[tuple[Path, str, str, str]]:
    """(file, scenario, indent, block text) for every marked block in docs/ (not performance.md)."""
    out = []
    for path in sorted(DOCS.glob("*.md")):
        if path.name == "performance.md":
            continue
        for m in MARKER.finditer(path.read_text()):
            indent, name, body = m.group(1), m.group(2), m.group(3)
            out.append((path, name, indent, "\n".join(line[len(indent):] for line in body.split("\n"))))
    return out


def rewrite(path: Path, name: str, text: str) -> None:
    """Replace the block marked ``name`` in ``path`` with ``text``."""
    doc = path.read_text()

    def repl(m: re.Match) -> str:
        if m.group(2) != name:
            return m.group(0)
        ind = m.group(1)
        body = "\n".join((ind + line) if line else line for line in text.split("\n"))
        return f"{ind}<!-- output: {name} -->\n{ind}```\n{body}\n{ind}```"

    path.write_text(MARKER.sub(repl, doc))

