"""The differential key-soundness fuzzer (issue 19): random include trees, a random edit, and
then, in a fresh process, what ``StubCache`` loads must be exactly what a bare compiler build
of the same inputs gives now. A miss is fine; a stale hit (or a library that differs) fails.

Each example builds a world under a fresh directory:

* physical directories ``store/<name>/inc`` (names with spaces, ``$``, ``#``, ``:``, unicode
  and a non-UTF-8 byte), each holding some of the headers ``h0.h`` … and maybe ``up.h`` beside
  ``inc``;
* search slots, each one physical ``inc`` spelled directly, through a symlink, or as
  ``x/../inc`` where ``x`` may be a symlink to another directory (the kernel resolves that
  ``..`` from where ``x`` points), passed as ``-I``, ``-iquote``, ``-isystem``, ``-idirafter``
  or ``extra_include_paths``;
* headers holding ``+ <weight>`` lines, ``#pragma once``, ``#include_next``, ``#include "../up.h"``;
  the stub's ``value()`` is the sum of what the includes expand to inside its body.

Then one to three edits: change a header (same size, within the same second), create a
header that may shadow another, delete one, replace a directory with a symlink to another,
re-point a symlink, create or edit ``up.h``, put a header where a directory or a link to
nowhere stood (a header's place in a directory may hold either: the compiler passes over both).

The default run keeps to a few examples (CI) and two fixed ones (a class-1 trap and the
first failure found); ``STUBCACHE_FUZZ_EXAMPLES=N`` runs N with a random seed (a longer run
by hand).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

LONG = int(os.environ.get("STUBCACHE_FUZZ_EXAMPLES", "0") or 0)
EXAMPLES = LONG or 6
HEADERS = 3

CHILD = """
import json, os, sys, stubcache
spec = stubcache.StubSpec(**json.loads(os.environ["SPEC"]))
cache = stubcache.StubCache()
try:
    e = cache.get_or_build(spec)
except stubcache.BuildError:
    print(json.dumps({"value": "error"}))
    sys.exit(0)
print(json.dumps({"value": cache.load_entry(e).value(), "published": e.published}))
"""

# Characters a directory name gets (one of them is a byte that is not UTF-8).
NAME_CHARS = "ab $#:\u20ac\udcff"


def _names():
    return st.text(alphabet=NAME_CHARS, min_size=1, max_size=4).map(lambda s: "d" + s)


@st.composite
def worlds(draw):
    n_dirs = draw(st.integers(2, 3))
    names = draw(st.lists(_names(), min_size=n_dirs, max_size=n_dirs, unique=True))
    weights = iter(draw(st.permutations(range(1, 200)))[:60])
    dirs = []
    for _ in range(n_dirs):
        headers = {}
        for k in range(HEADERS):
            if draw(st.booleans()):
                headers[k] = {"weight": next(weights), "once": draw(st.booleans()),
                              "next": draw(st.booleans()), "up": draw(st.integers(0, 3)) == 0}
        # A header's place may hold what the compiler passes over: a directory, or a link to
        # nowhere (``away/<dir>/h<k>.h``) that an edit may make resolve.
        blockers = {k: draw(st.sampled_from(["dir", "dangling"])) for k in range(HEADERS)
                    if k not in headers and draw(st.integers(0, 2)) == 0}
        dirs.append({"headers": headers, "up": next(weights) if draw(st.booleans()) else None, "blockers": blockers})
    # Every header exists somewhere, so most worlds compile.
    for k in range(HEADERS):
        if not any(k in d["headers"] for d in dirs):
            dirs[draw(st.integers(0, n_dirs - 1))]["headers"][k] = {"weight": next(weights), "once": False,
                                                                   "next": False, "up": False}
    slots = []
    for _ in range(draw(st.integers(1, 3))):
        slots.append({"dir": draw(st.integers(0, n_dirs - 1)),
                      "spelling": draw(st.sampled_from(["plain", "link", "dotdot", "dotdot-link"])),
                      "other": draw(st.integers(0, n_dirs - 1)),
                      "kind": draw(st.sampled_from(["-I", "-iquote", "-isystem", "-idirafter", "path"]))})
    includes = [draw(st.sampled_from(['"', "<"])) for _ in range(HEADERS)]
    edits = draw(st.lists(st.tuples(st.sampled_from(["change", "create", "delete", "dir-to-link", "repoint",
                                                     "up", "unblock"]),
                                    st.integers(0, n_dirs - 1), st.integers(0, n_dirs - 1),
                                    st.integers(0, HEADERS - 1), st.integers(200, 999)),
                          min_size=1, max_size=3))
    return {"names": names, "dirs": dirs, "slots": slots, "includes": includes, "edits": edits}


def _header_text(k: int, h: dict) -> str:
    lines = ["#pragma once"] if h["once"] else []
    lines.append(f"+ {h['weight']}")
    if h["up"]:
        lines.append('#if __has_include("../up.h")\n#include "../up.h"\n#endif')
    if h["next"]:
        lines.append(f"#if __has_include_next(<h{k}.h>)\n#include_next <h{k}.h>\n#endif")
    return "\n".join(lines) + "\n"


class World:
    def __init__(self, base: str, w: dict) -> None:
        self.base = base
        self.w = w
        self.store = os.path.join(base, "store")
        self.links = os.path.join(base, "links")
        os.makedirs(self.links)
        self.phys = []
        for name, d in zip(w["names"], w["dirs"]):
            top = os.path.join(self.store, name)
            os.makedirs(os.path.join(top, "inc"))
            os.makedirs(os.path.join(top, "x"))
            for k, h in d["headers"].items():
                self._write(os.path.join(top, "inc", f"h{k}.h"), _header_text(k, h))
            if d["up"] is not None:
                self._write(os.path.join(top, "up.h"), f"+ {d['up']}\n")
            for k, kind in d.get("blockers", {}).items():
                if k in d["headers"]:
                    continue
                place = os.path.join(top, "inc", f"h{k}.h")
                if kind == "dir":
                    os.mkdir(place)
                else:
                    os.symlink(os.path.join(base, "away", name, f"h{k}.h"), place)
            self.phys.append(top)
        self.cflags: list[str] = []
        self.include_paths: list[str] = []
        self.link_paths: list[str] = []
        for i, slot in enumerate(w["slots"]):
            top, other = self.phys[slot["dir"]], self.phys[slot["other"]]
            if slot["spelling"] == "plain":
                path = os.path.join(top, "inc")
            elif slot["spelling"] == "link":
                path = os.path.join(self.links, f"l{i}")
                os.symlink(os.path.join(top, "inc"), path)
                self.link_paths.append(path)
            elif slot["spelling"] == "dotdot":
                path = os.path.join(top, "x", "..", "inc")
            else:  # top/y -> other/x: top/y/../inc is other/inc to the kernel, top/inc on paper
                y = os.path.join(top, f"y{i}")
                if not os.path.lexists(y):
                    os.symlink(os.path.join(other, "x"), y)
                self.link_paths.append(y)
                path = os.path.join(y, "..", "inc")
            if slot["kind"] == "path":
                self.include_paths.append(path)
            else:
                self.cflags += [slot["kind"], path]

    @staticmethod
    def _write(path: str, text: str) -> None:
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as fh:
            fh.write(text)

    def source(self) -> str:
        inc = "".join(f'#include {q}h{k}.h{q if q == chr(34) else ">"}\n' for k, q in enumerate(self.w["includes"]))
        return f'extern "C" int value(void) {{ return 0\n{inc}; }}\n'

    def spec(self) -> dict:
        return {"name": "fuzz", "cpp_sources": self.source(), "extra_cflags": self.cflags,
                "extra_include_paths": self.include_paths}

    def edit(self, what: str, a: int, b: int, k: int, weight: int) -> None:
        inc_a = os.path.join(self.phys[a], "inc")
        header = os.path.join(inc_a, f"h{k}.h")
        if what == "change" and os.path.isfile(header):
            with open(header, encoding="utf-8") as fh:
                text = fh.read()
            lines = text.split("\n")
            idx = next(i for i, ln in enumerate(lines) if ln.startswith("+ "))
            lines[idx] = f"+ {weight}"  # often the same size, within the same second
            self._write(header, "\n".join(lines))
        elif what == "create" and os.path.isdir(inc_a) and not os.path.lexists(header):
            self._write(header, _header_text(k, {"weight": weight, "once": False, "next": weight % 2 == 0,
                                                 "up": weight % 3 == 0}))
        elif what == "delete" and os.path.isfile(header):
            os.unlink(header)
        elif what == "dir-to-link" and a != b and not os.path.islink(inc_a):
            os.rename(inc_a, os.path.join(self.phys[a], f"old-inc-{weight}"))
            os.symlink(os.path.join(self.phys[b], "inc"), inc_a)
        elif what == "repoint" and self.link_paths:
            link = self.link_paths[weight % len(self.link_paths)]
            target = os.path.join(self.phys[b], "x" if os.path.basename(link).startswith("y") else "inc")
            os.unlink(link)
            os.symlink(target, link)
        elif what == "up":
            self._write(os.path.join(self.phys[a], "up.h"), f"+ {weight}\n")
        elif what == "unblock" and (os.path.islink(header) or os.path.isdir(header)) and not os.path.isfile(header):
            text = _header_text(k, {"weight": weight, "once": False, "next": weight % 2 == 0, "up": False})
            if os.path.islink(header):  # make it resolve
                target = os.readlink(header)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                self._write(target, text)
            else:
                os.rmdir(header)
                self._write(header, text)

    def bare(self, n: int):
        """What a bare compiler build of the same inputs gives now: the value, or "error"."""
        out = os.path.join(self.base, f"bare{n}.so")
        src = os.path.join(self.base, f"bare{n}.cpp")
        self._write(src, self.source())
        cmd = [os.environ.get("CXX", "c++"), *[f"-I{p}" for p in self.include_paths], "-fPIC", "-std=c++20",
               *_torch_words(self.cflags), src, "-shared", "-o", out]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return "error"
        import ctypes

        return ctypes.CDLL(out).value()

    def cached(self, root: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STUBCACHE_")}
        env.update(SPEC=json.dumps(self.spec()), STUBCACHE_DIR=root)
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _torch_words(flags: list[str]) -> list[str]:
    """The words torch's build would hand the compiler for ``extra_cflags``: its ninja line joins
    the flags with spaces and a shell splits them again, so a flag holding a blank (a directory
    named ``d a``) becomes two words (the oracle is torch's behaviour, which the drop-in keeps;
    flags with quotes do not occur here)."""
    out: list[str] = []
    for flag in flags:
        out += flag.split()
    return out


def _check(world: dict) -> None:
    base = tempfile.mkdtemp(prefix="stubcache-fuzz-")
    try:
        w = World(base, world)
        root = os.path.join(base, "cache")
        got, want = w.cached(root)["value"], w.bare(0)
        assert got == want, f"first build: cache loaded {got}, a bare build gives {want}"
        for n, edit in enumerate(world["edits"], 1):
            w.edit(*edit)
            got, want = w.cached(root)["value"], w.bare(n)
            assert got == want, f"after {world['edits'][:n]}: cache loaded {got}, a bare build gives {want}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _h(weight: int, once: bool = False, next_: bool = False, up: bool = False) -> dict:
    return {"weight": weight, "once": once, "next": next_, "up": up}


# Always run, whatever the seed: a class-1 trap (``D0/y0/../inc`` with ``y0 -> D1/x`` is D1/inc
# to the kernel, D0/inc, which holds decoys, on paper), and the first failure the fuzzer
# found (a header created in a search directory whose name is not UTF-8).
TRAP = {"names": ["da", "db"],
        "dirs": [{"headers": {0: _h(10), 1: _h(13), 2: _h(14)}, "up": None}, {"headers": {1: _h(11), 2: _h(12)}, "up": None}],
        "slots": [{"dir": 0, "spelling": "dotdot-link", "other": 1, "kind": "-I"},
                  {"dir": 0, "spelling": "link", "other": 0, "kind": "-isystem"}],
        "includes": ["<", '"', "<"], "edits": [("change", 1, 0, 1, 600), ("repoint", 0, 0, 0, 0)]}
FOUND_NON_UTF8_DIR = {
    "names": ["d\udcff\u20ac$a", "d\u20ac\udcff\udcffb", "d$b"],
    "dirs": [{"headers": {0: _h(176, once=True, up=True), 2: _h(185, up=True)}, "up": None},
             {"headers": {0: _h(182, once=True, up=True), 1: _h(47, up=True)}, "up": None},
             {"headers": {}, "up": None}],
    "slots": [{"dir": 1, "spelling": "plain", "other": 0, "kind": "-I"},
              {"dir": 0, "spelling": "plain", "other": 0, "kind": "-I"},
              {"dir": 0, "spelling": "plain", "other": 0, "kind": "-I"}],
    "includes": ['"', '"', '"'], "edits": [("change", 0, 0, 0, 200), ("create", 1, 0, 2, 200)]}


# Found next: two spellings of one directory (gcc ignores the second as a duplicate), then a
# symlink in the second re-pointed: it is searched again, and `"../up.h"` resolves there.
FOUND_DUPLICATE_DIR = {
    "names": ["d:", "d  \u20ac"],
    "dirs": [{"headers": {}, "up": 1}, {"headers": {0: _h(2, up=True), 1: _h(3, up=True), 2: _h(4, up=True)},
                                        "up": None}],
    "slots": [{"dir": 0, "spelling": "dotdot-link", "other": 1, "kind": "-I"},
              {"dir": 0, "spelling": "dotdot-link", "other": 1, "kind": "-I"}],
    "includes": ['"', '"', '"'], "edits": [("change", 0, 0, 0, 200), ("repoint", 0, 0, 0, 201)]}


# A header's place in an earlier directory held a directory, then a link to nowhere: each made
# into a header later was not noticed (the compiler had passed over both, and neither was recorded).
PASSED_OVER = {
    "names": ["da", "db"],
    "dirs": [{"headers": {2: _h(9)}, "up": None, "blockers": {0: "dir", 1: "dangling"}},
             {"headers": {0: _h(5), 1: _h(6), 2: _h(7)}, "up": None}],
    "slots": [{"dir": 0, "spelling": "plain", "other": 0, "kind": "-I"},
              {"dir": 1, "spelling": "plain", "other": 0, "kind": "-I"}],
    "includes": ['"', "<", "<"], "edits": [("unblock", 0, 0, 0, 300), ("unblock", 0, 0, 1, 301)]}


# Found in a long run: a directory named with a blank, passed as ``["-I", ".../d /inc"]``. Flags
# are split into words as torch's build file splits them, so both builds fail (the oracle splits
# them too, see _torch_words).
FOUND_BLANK_IN_FLAG = {
    "names": ["d ", "da"],
    "dirs": [{"headers": {0: _h(5), 1: _h(6), 2: _h(7)}, "up": None}, {"headers": {0: _h(8)}, "up": None}],
    "slots": [{"dir": 0, "spelling": "plain", "other": 0, "kind": "-I"},
              {"dir": 1, "spelling": "plain", "other": 0, "kind": "path"}],
    "includes": ['"', "<", "<"], "edits": [("change", 0, 0, 0, 300)]}


# Found when the derandomized run met it (2026-12-03): an -isystem directory spelled `da/x/../inc`
# (x a plain directory); gcc names the header it finds there `da/inc/h1.h` (it simplifies the
# path) but lists the directory as given, so the header was filed under no search directory and
# `h1.h` appearing in an earlier -I directory went unnoticed.
FOUND_SIMPLIFIED_DIR = {
    "names": ["d:", "da", "d::"],
    "dirs": [{"headers": {2: _h(3)}, "up": None}, {"headers": {1: _h(2)}, "up": None},
             {"headers": {0: _h(1, up=True)}, "up": None}],
    "slots": [{"dir": 0, "spelling": "plain", "other": 0, "kind": "-I"},
              {"dir": 1, "spelling": "dotdot", "other": 0, "kind": "-isystem"},
              {"dir": 2, "spelling": "plain", "other": 0, "kind": "-I"}],
    "includes": ['"', '"', '"'], "edits": [("create", 0, 0, 1, 200)]}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(world=TRAP)
@example(world=FOUND_DUPLICATE_DIR)
@example(world=FOUND_NON_UTF8_DIR)
@example(world=FOUND_BLANK_IN_FLAG)
@example(world=FOUND_SIMPLIFIED_DIR)
@example(world=PASSED_OVER)
@given(world=worlds())
def test_what_loads_is_what_a_bare_build_gives_now(world):
    _check(world)  # no fixtures: each example makes (and removes) its own directory and root
