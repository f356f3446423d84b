"""A direct build tracks the headers its compile is predicted to read while the compiler runs
(stubcache.build.buildinputs.pretrack: the search probe preprocesses main.cpp and lists them), in
real processes with the real compiler: the record is the one tracking after the compile makes,
and what changes between that early tracking and the compiler's reads is caught as a change
during the build (not published under the key; built again, then the entry holds the new file)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

EARLY = "inputs tracked while the compiler runs"
OTHER = "the compile read other files than predicted"

BUILD = r"""
import json, logging, sys
from stubcache import StubCache, StubSpec
from stubcache.build import buildinputs
if sys.argv[1] == "late":  # tracking only after the compile, as before early tracking
    def _refuse(*a, **k):
        raise RuntimeError("early tracking off")
    buildinputs.pretrack = _refuse
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("%(message)s"))
logging.getLogger("stubcache").addHandler(handler)
logging.getLogger("stubcache").setLevel(logging.DEBUG)
spec = StubSpec("tracked_early", open(sys.argv[2]).read(), is_python_module=False, no_implicit_headers=True,
                extra_include_paths=[sys.argv[3]])
cache = StubCache()
entry = cache.get_or_build(spec)
print(json.dumps({"v": cache.load(spec).v(), "manifest": str(entry.path.rsplit("/", 1)[0] + "/manifest.json")}))
"""

SOURCE = """
#include <stddef.h>
#include <stdint.h>
#include <atomic>
#include "cfg.h"
#if __has_include("nowhere_%(tag)s.h")
#error "not there"
#endif
#if __has_include("late_%(tag)s.h")
#define LATE 10
#else
#define LATE 0
#endif
extern "C" int v(void) { static std::atomic<int> n{VAL + LATE}; return n.load(); }
"""


def _tree(tmp_path: Path, tag: str) -> tuple[Path, Path]:
    inc = tmp_path / f"inc-{tag}"
    (inc / "sub").mkdir(parents=True)
    (inc / "cfg.h").write_text('#include "sub/val.h"\n#if __has_include(<absent_%s.h>)\n#endif\n' % tag)
    (inc / "sub" / "val.h").write_text("#define VAL 1\n")
    src = tmp_path / f"src-{tag}.cpp"
    src.write_text(SOURCE % {"tag": tag})
    return inc, src


def _start(mode: str, src: Path, inc: Path, env: dict) -> subprocess.Popen:
    full = dict(os.environ, PYTHONPATH=str(REPO), **env)
    return subprocess.Popen([sys.executable, "-c", BUILD, mode, str(src), str(inc)], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def _record(manifest: str) -> dict:
    m = json.loads(Path(manifest).read_text())
    inputs = m["inputs"]
    return {"headers": m["headers"], "sigs": sorted(inputs["sigs"]), "search": inputs["search"],
            # (a directory's signature is left out where it changed within the clock slack of the
            # build: the two builds ran at different times)
            "shadows": {d: names for d, (_sig, names) in inputs["shadows"].items()}}


def test_tracked_while_the_compiler_runs_is_what_tracking_after_it_records(cache_root, cxx, tmp_path):
    inc, src = _tree(tmp_path, "same")
    early, early_err = _finish(_start("early", src, inc, {}))
    assert EARLY in early_err and OTHER not in early_err, early_err
    late, late_err = _finish(_start("late", src, inc, {"STUBCACHE_DIR": str(tmp_path / "other-root")}))
    assert EARLY not in late_err
    assert early["v"] == late["v"] == 1
    a, b = _record(early["manifest"]), _record(late["manifest"])
    assert a == b
    assert str(inc / "sub" / "val.h") in a["headers"]  # (the quoted include beside cfg.h)
    assert str(inc) in a["shadows"]  # the absent __has_include names are shadow candidates there


def _change_once_tracked(proc: subprocess.Popen, change) -> str:
    # Read the child's log until its early tracking is done; make the change while its compiler
    # still sleeps (STUBCACHE_TEST_CXX_SLEEP: before it reads anything); collect the rest.
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if EARLY in line:
            change()
            break
    else:
        raise AssertionError("no early tracking:\n" + "".join(lines))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, "".join(lines) + err
    return out, "".join(lines) + err


def test_a_header_changed_after_it_was_tracked_early_is_a_change_during_the_build(cache_root, cxx, tmp_path):
    inc, src = _tree(tmp_path, "edit")
    val = inc / "sub" / "val.h"
    proc = _start("early", src, inc, {"STUBCACHE_TEST_CXX_SLEEP": "2.0"})
    out, err = _change_once_tracked(proc, lambda: val.write_text("#define VAL 2\n"))
    result = json.loads(out.strip().splitlines()[-1])
    assert "changed during the build" in err, err
    assert result["v"] == 2
    # The entry holds what its library was built from (without the recheck: VAL 1's hash).
    headers = json.loads(Path(result["manifest"]).read_text())["headers"]
    assert headers[str(val)] == hashlib.sha256(b"#define VAL 2\n").hexdigest()


def test_a_has_include_name_appearing_after_early_tracking_is_a_change_during_the_build(cache_root, cxx, tmp_path):
    inc, src = _tree(tmp_path, "appear")
    late = inc / "late_appear.h"
    proc = _start("early", src, inc, {"STUBCACHE_TEST_CXX_SLEEP": "2.0"})
    out, err = _change_once_tracked(proc, lambda: late.write_text("/* now here */\n"))
    result = json.loads(out.strip().splitlines()[-1])
    assert "changed during the build" in err, err
    assert result["v"] == 11  # the compiler saw it ...
    # ... and the entry says so (without the recheck: recorded as absent, the compile saw it)
    headers = json.loads(Path(result["manifest"]).read_text())["headers"]
    assert str(late) in headers


def test_a_directory_at_a_candidate_replaced_by_a_header_after_the_compile_read_is_a_change(cache_root, tmp_path,
                                                                                          monkeypatch):
    # -I first -I second: first/val.h is a directory (searched past, not chosen), second/val.h is
    # read. After the compiler has read it (the wrapper then marks and sleeps), the directory
    # becomes a header: tracking after the compile saw a candidate new during the build; the
    # early tracking must too (it looked while first/val.h was still a directory).
    import shutil
    import textwrap

    first, second = tmp_path / "first", tmp_path / "second"
    (first / "val.h").mkdir(parents=True)
    second.mkdir()
    (second / "val.h").write_text("#define VAL 1\n")
    mark = tmp_path / "compiled"
    wrapper = tmp_path / "cxx-after.sh"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" -E "*) exec "{shutil.which('c++')}" "$@";; *main.cpp*) ;; *) exec "{shutil.which('c++')}" "$@";; esac
        "{shutil.which('c++')}" "$@"; rc=$?
        if [ ! -e "{mark}" ]; then : > "{mark}"; sleep 2; fi
        exit $rc
        """))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    code = ("import logging, sys\nfrom stubcache import StubCache, StubSpec\n"
            "logging.basicConfig(format='%(message)s')\nlogging.getLogger('stubcache').setLevel(logging.DEBUG)\n"
            "spec = StubSpec('dir_then_file', '#include \"val.h\"\\nextern \"C\" int v(void) { return VAL; }',"
            f" is_python_module=False, no_implicit_headers=True, extra_include_paths=[{str(first)!r}, {str(second)!r}])\n"
            "print(StubCache().load(spec).v())\n")
    full = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    import time

    def replace() -> None:  # once tracked early (first/val.h a directory) and read by the compiler
        t0 = time.monotonic()
        while not mark.exists() and time.monotonic() - t0 < 120:
            time.sleep(0.01)
        (first / "val.h").rmdir()
        (first / "val.h").write_text("#define VAL 2\n")

    out, err = _change_once_tracked(proc, replace)
    assert proc.returncode == 0, err
    assert "changed during the build" in err, err
    assert out.split() == ["2"]
    # A fresh process loads what a compile now gives (with the hole: VAL 1's library, published)
    again = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
    assert again.stdout.split() == ["2"], again.stderr


PASSED_OVER = r"""
import logging, sys
from stubcache import StubCache, StubSpec
from stubcache.build import buildinputs
if sys.argv[1] == "late":
    def _refuse(*a, **k):
        raise RuntimeError("early tracking off")
    buildinputs.pretrack = _refuse
logging.basicConfig(format="%(message)s")
logging.getLogger("stubcache").setLevel(logging.DEBUG)
spec = StubSpec("passed_over_busy", '#include "val.h"\nextern "C" int v(void) { return VAL; }', is_python_module=False,
                no_implicit_headers=True, extra_include_paths=sys.argv[2:4])
print(StubCache().load(spec).v())
"""


@pytest.mark.parametrize("mode", ["early", "late"])
@pytest.mark.parametrize("kind", ["directory", "link to a directory"])
def test_a_passed_over_directory_written_to_during_the_build_is_no_change(cache_root, cxx, tmp_path, kind, mode):
    """``first/val.h`` is a directory, or a link to one (a busy ``/tmp``), which the compiler passes
    over for ``second/val.h``; a file written in it while the compiler runs changes nothing the
    build read: published at once, and the next process hits (before: not published, every time)."""
    import time

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (second / "val.h").write_text("#define VAL 1\n")
    busy = first / "val.h" if kind == "directory" else tmp_path / "busy"
    busy.mkdir()
    if kind != "directory":
        (first / "val.h").symlink_to(busy)
    mark = tmp_path / "compile-started"
    env = dict(os.environ, PYTHONPATH=str(REPO), STUBCACHE_TEST_CXX_SLEEP="1.0", STUBCACHE_TEST_CXX_MARK=str(mark))
    args = [sys.executable, "-c", PASSED_OVER, mode, str(first), str(second)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not mark.exists() and proc.poll() is None and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    for n in range(3):  # while the compiler sleeps: before and after the early tracking, as it happens
        (busy / f"log{n}").write_text("busy\n")
        time.sleep(0.2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "changed during the build" not in err, err
    assert out.split() == ["1"] and (mode == "late") == (EARLY not in err)
    n = cxx.compiles()
    again = subprocess.run(args, env=dict(env, STUBCACHE_TEST_CXX_SLEEP=""), capture_output=True, text=True,
                           timeout=300)
    assert again.stdout.split() == ["1"], again.stderr
    assert cxx.compiles() == n, "the entry was not published"


def test_what_extra_ldflags_say_to_the_preprocessor_is_in_the_prediction(cache_root, cxx, tmp_path):
    """The direct command compiles and links in one, so ``-D`` in ``extra_ldflags`` chooses what
    the compile includes: the prediction reads the same headers (before: tracked again)."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "feature.h").write_text("#define VAL 5\n")
    (inc / "after.h").write_text("#define AFTER 0\n")
    code = ("import logging\nfrom stubcache import StubCache, StubSpec\n"
            "logging.basicConfig(format='%(message)s')\nlogging.getLogger('stubcache').setLevel(logging.DEBUG)\n"
            "spec = StubSpec('ldflag_define', '#ifdef WITH_FEATURE\\n#include \"feature.h\"\\n#else\\n#define VAL 1\\n"
            "#endif\\n#include \"after.h\"\\nextern \"C\" int v(void) { return VAL + AFTER; }', is_python_module=False, no_implicit_headers=True,"
            f" extra_include_paths=[{str(inc)!r}], extra_ldflags=['-DWITH_FEATURE'])\n"
            "print(StubCache().load(spec).v())\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), STUBCACHE_TEST_CXX_SLEEP="0.5")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["5"]
    assert EARLY in proc.stderr and OTHER not in proc.stderr, proc.stderr
