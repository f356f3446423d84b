"""Stale hits found in review of issue 9, one test per hole, each with the full protocol of
tests/test_key_soundness.py (build -> change -> a fresh process loads the new behaviour ->
revert -> the old entry hits again without a compile)."""

from __future__ import annotations

import os
import subprocess

from .test_key_soundness import cycle, value_src


def test_a_file_appearing_under_a_has_include_name_misses(cache_root, cxx, tmp_path):
    """``__has_include`` of a header that does not exist reads no file, so no dependency output
    names it; the file appearing later flips the test."""
    inc = tmp_path / "inc"
    inc.mkdir()
    feat = inc / "feat.h"
    src = ('#if __has_include("feat.h")\n#include "feat.h"\n#else\n#define VAL 1\n#endif\n' + value_src())
    spec = {"name": "hasinc", "cpp_sources": src, "extra_include_paths": [str(inc)]}
    cycle(cxx, spec, lambda: feat.write_text("#define VAL 2\n"), feat.unlink)


def test_has_include_in_a_tracked_header_is_covered_too(cache_root, cxx, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "cfg.h").write_text('#if __has_include(<feat_b.h>)\n#include <feat_b.h>\n#else\n#define VAL 1\n#endif\n')
    feat = inc / "feat_b.h"
    spec = {"name": "hasinc_hdr", "cpp_sources": value_src('#include "cfg.h"'), "extra_include_paths": [str(inc)]}
    cycle(cxx, spec, lambda: feat.write_text("#define VAL 2\n"), feat.unlink)


def test_a_has_include_that_found_a_file_misses_when_it_goes(cache_root, cxx, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    opt = inc / "opt.h"
    opt.write_text("/* present */\n")
    src = '#if __has_include("opt.h")\n#define VAL 1\n#else\n#define VAL 2\n#endif\n' + value_src()
    spec = {"name": "hasinc_gone", "cpp_sources": src, "extra_include_paths": [str(inc)]}
    cycle(cxx, spec, opt.unlink, lambda: opt.write_text("/* present */\n"))


def _gcc_include() -> str:
    return subprocess.run([os.environ.get("CXX", "c++"), "-print-file-name=include"], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_symlink_from_a_user_dir_into_a_pinned_dir_is_tracked(cache_root, cxx, tmp_path):
    """The file resolves under the compiler's own (pinned) directory, but the link is the
    user's: pointing it elsewhere changes what the compiler reads."""
    inc = tmp_path / "inc"
    inc.mkdir()
    link = inc / "myval.h"
    pinned_target = os.path.join(_gcc_include(), "stddef.h")
    assert os.path.isfile(pinned_target)
    link.symlink_to(pinned_target)
    own = tmp_path / "own.h"
    own.write_text("#define VAL 2\n")
    src = '#include "myval.h"\n#ifndef VAL\n#define VAL 1\n#endif\n' + value_src()
    spec = {"name": "symlink_pin", "cpp_sources": src, "extra_include_paths": [str(inc)]}

    def point(target):
        def go():
            link.unlink()
            link.symlink_to(target)
        return go

    cycle(cxx, spec, point(own), point(pinned_target))


def test_new_header_shadowing_a_pinned_header_misses(cache_root, cxx, tmp_path):
    """``<stddef.h>`` comes from the compiler's own (pinned) directory; the same name appearing
    in a user ``-I`` directory, searched first, is what a fresh build would read."""
    inc = tmp_path / "inc"
    inc.mkdir()
    shadow = inc / "stddef.h"
    src = "#include <stddef.h>\n#ifndef VAL\n#define VAL 1\n#endif\n" + value_src()
    spec = {"name": "pin_shadow", "cpp_sources": src, "extra_include_paths": [str(inc)]}
    cycle(cxx, spec, lambda: shadow.write_text("#define VAL 2\n#include_next <stddef.h>\n"), shadow.unlink)


def test_new_header_beside_the_including_header_misses(cache_root, cxx, tmp_path):
    """A quoted ``#include`` looks in the including file's directory before the ``-I`` list."""
    inc, inc2 = tmp_path / "inc", tmp_path / "inc2"
    (inc / "sub").mkdir(parents=True)
    inc2.mkdir()
    (inc / "sub" / "a.h").write_text('#include "b.h"\n')
    (inc2 / "b.h").write_text("#define VAL 1\n")
    beside = inc / "sub" / "b.h"
    spec = {"name": "beside", "cpp_sources": value_src('#include "sub/a.h"'),
            "extra_include_paths": [str(inc), str(inc2)]}
    cycle(cxx, spec, lambda: beside.write_text("#define VAL 2\n"), beside.unlink)


def _archive(tmp_path, out, n: int, shared: bool = False) -> None:
    src = tmp_path / f"dep{n}.c"
    src.write_text(f"int dep_value(void) {{ return {n}; }}\n")
    out.unlink(missing_ok=True)
    if shared:
        subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
        return
    obj = tmp_path / f"dep{n}.o"
    subprocess.run(["cc", "-fPIC", "-c", str(src), "-o", str(obj)], check=True)
    subprocess.run(["ar", "rcs", str(out), str(obj)], check=True)


DEP_SRC = 'extern "C" int dep_value(void);\nextern "C" int value(void) { return dep_value(); }\n'


def test_new_archive_in_an_earlier_library_dir_misses(cache_root, cxx, tmp_path):
    """``-lNAME`` takes the first match along the ``-L`` list: a new archive in a directory
    searched before the one used is what a fresh link would take."""
    l1, l2 = tmp_path / "l1", tmp_path / "l2"
    l1.mkdir()
    l2.mkdir()
    _archive(tmp_path, l2 / "libdep.a", 1)
    spec = {"name": "lib_shadow", "cpp_sources": DEP_SRC, "extra_ldflags": [f"-L{l1}", "-L", str(l2), "-ldep"]}
    cycle(cxx, spec, lambda: _archive(tmp_path, l1 / "libdep.a", 2), (l1 / "libdep.a").unlink)


def test_new_shared_library_beside_the_archive_misses(cache_root, cxx, tmp_path):
    """In one directory the linker prefers ``libNAME.so`` to ``libNAME.a``."""
    lib = tmp_path / "lib"
    lib.mkdir()
    _archive(tmp_path, lib / "libdep.a", 1)
    spec = {"name": "lib_so", "cpp_sources": DEP_SRC, "extra_ldflags": [f"-L{lib}", f"-Wl,-rpath,{lib}", "-ldep"]}
    cycle(cxx, spec, lambda: _archive(tmp_path, lib / "libdep.so", 2, shared=True), (lib / "libdep.so").unlink)
