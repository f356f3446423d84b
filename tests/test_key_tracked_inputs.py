"""Key soundness (docs/design.md, invariant 10) for inputs the compiler and linker find for themselves:
headers found by ``__has_include`` or by shadowing, archives and shared libraries on the library
path, files named by flags, and the identity of the tools (linker, compiler proper, wrapper
scripts). Each test runs the full protocol of tests/test_key_soundness.py (build -> change -> a
fresh process loads the new behaviour -> revert -> the old entry hits again without a compile)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from stubcache import StubCache, StubSpec

from .test_key_soundness import child, cycle, value_src


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


def _shadowed_value(tmp_path, name: str):
    """A stub whose ``val.h`` comes from ``inc2``; ``inc``, searched first, is where a shadow
    would appear."""
    inc, inc2 = tmp_path / "inc", tmp_path / "inc2"
    inc.mkdir()
    inc2.mkdir()
    (inc2 / "val.h").write_text("#define VAL 1\n")
    spec = {"name": name, "cpp_sources": value_src('#include "val.h"'), "extra_include_paths": [str(inc), str(inc2)]}
    return inc, spec


def test_a_directory_where_a_header_would_shadow_is_replaced_by_one(cache_root, cxx, tmp_path):
    """The compiler skips a directory at a candidate's path; a header put in its place is found
    first."""
    inc, spec = _shadowed_value(tmp_path, "shadow_dir")
    cand = inc / "val.h"
    cand.mkdir()

    def plant():
        cand.rmdir()
        cand.write_text("#define VAL 2\n")

    def back():
        cand.unlink()
        cand.mkdir()

    cycle(cxx, spec, plant, back)


def test_a_dangling_link_where_a_header_would_shadow_starts_to_resolve(cache_root, cxx, tmp_path):
    """The link does not change when its target appears, nor does the directory that holds it:
    the target's own path is watched."""
    inc, spec = _shadowed_value(tmp_path, "shadow_dangling")
    away = tmp_path / "away"
    (inc / "val.h").symlink_to(away / "val.h")

    def plant():
        away.mkdir()
        (away / "val.h").write_text("#define VAL 2\n")

    cycle(cxx, spec, plant, lambda: shutil.rmtree(away))


def test_a_dangling_link_on_the_way_to_a_shadow_starts_to_resolve(cache_root, cxx, tmp_path):
    """``#include "sub/val.h"`` with ``inc/sub`` a link to a directory that does not exist yet."""
    inc, inc2 = tmp_path / "inc", tmp_path / "inc2"
    (inc2 / "sub").mkdir(parents=True)
    inc.mkdir()
    (inc2 / "sub" / "val.h").write_text("#define VAL 1\n")
    away = tmp_path / "away"
    (inc / "sub").symlink_to(away)
    spec = {"name": "shadow_dangling_dir", "cpp_sources": value_src('#include "sub/val.h"'),
            "extra_include_paths": [str(inc), str(inc2)]}

    def plant():
        away.mkdir()
        (away / "val.h").write_text("#define VAL 2\n")

    cycle(cxx, spec, plant, lambda: shutil.rmtree(away))


def test_a_dangling_link_pointed_elsewhere_is_watched_where_it_points_now(cache_root, cxx, tmp_path):
    """Re-pointing the link changes only the directory that holds it; a lookup that took the
    link for the same one would not watch the new target."""
    inc, spec = _shadowed_value(tmp_path, "shadow_repointed")
    link = inc / "val.h"
    link.symlink_to(tmp_path / "first" / "val.h")
    assert child(spec)[0] == 1
    link.unlink()
    other = tmp_path / "second"
    link.symlink_to(other / "val.h")
    assert child(spec)[0] == 1
    n = cxx.compiles()
    other.mkdir()
    (other / "val.h").write_text("#define VAL 2\n")
    assert child(spec)[0] == 2, "a fresh process loaded the old library after the re-pointed link resolved"
    assert cxx.compiles() == n + 1


def _script_setter(path, body):
    """``use(n)`` returns a step that replaces the executable script ``path`` with ``body(n)``."""
    def use(n: int):
        def go():
            path.unlink(missing_ok=True)
            path.write_text(body(n))
            path.chmod(0o755)
        return go
    return use


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


@pytest.fixture
def coarse_fs(tmp_path):
    """A file system that stamps whole seconds (ext4 with 128-byte inodes, like ext3), mounted
    on a loop device; skipped where that is not allowed."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount a loop file system")
    img, mnt = tmp_path / "coarse.img", tmp_path / "coarse"
    mnt.mkdir()
    with open(img, "wb") as fh:
        fh.truncate(16 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(img)], capture_output=True)
    if made.returncode != 0 or subprocess.run(["mount", "-o", "loop", str(img), str(mnt)],
                                              capture_output=True).returncode != 0:
        pytest.skip("cannot mount a loop file system here")
    try:
        probe = mnt / "probe"
        probe.write_text("x")
        if os.stat(probe).st_mtime_ns % 1_000_000_000:
            pytest.skip("the loop file system stamps finer than seconds")
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_same_second_edit_on_a_coarse_timestamp_file_system_misses(cache_root, coarse_fs):
    """Two same-size writes within one second leave the same size, inode, mtime and ctime on a
    whole-second file system: a recorded signature must not vouch for the second one."""
    inc = coarse_fs / "inc"
    inc.mkdir()
    header = inc / "val.h"
    header.write_text("#define VAL 0\n")
    spec = {"name": "coarse", "cpp_sources": value_src('#include "val.h"'), "extra_include_paths": [str(inc)]}
    child(spec)  # probes the toolchain, so the builds below take well under a second
    for _ in range(5):
        while not 0.05 < time.time() % 1 < 0.1:  # not a synchronisation: start early in a second
            time.sleep(0.002)
        second = int(time.time())
        with open(header, "r+") as fh:
            fh.write("#define VAL 1\n")
        v1, _, _ = child(spec)
        with open(header, "r+") as fh:  # in place: same inode, same size
            fh.write("#define VAL 2\n")
        if int(time.time()) != second:
            continue  # too slow to land both writes in one second; try again
        assert v1 == 1
        v2, _, _ = child(spec)
        assert v2 == 2, "a fresh process loaded the library built from the first write"
        return
    pytest.skip("could not land two writes and a build within one second")


def test_linker_chosen_by_the_spec_flags_is_identified(cache_root, cxx, tmp_path):
    """``-B DIR -fuse-ld=gold`` makes the driver run ``DIR/ld.gold``, not the linker the
    fingerprint probed: changing that program must miss. (Here the linker script links in an
    archive of its own, which the link's dependency output names and so is tracked; only the
    program changes.)"""
    if shutil.which("ld.gold") is None:
        pytest.skip("needs ld.gold")
    tools = tmp_path / "tools"
    tools.mkdir()
    for n in (1, 2):
        _archive(tmp_path, tools / f"libv{n}.a", n)
    gold = tools / "ld.gold"

    use = _script_setter(gold, lambda n: f'#!/bin/sh\nexec {shutil.which("ld.gold")} "$@" {tools}/libv{n}.a\n')

    use(1)()
    spec = {"name": "own_linker", "cpp_sources": DEP_SRC, "extra_ldflags": [f"-B{tools}/", "-fuse-ld=gold"]}
    cycle(cxx, spec, use(2), use(1))


def test_files_named_by_flags_are_tracked(cache_root, cxx, tmp_path):
    """A response file (``@FILE``) and a specs file hold flags: gcc reads them but lists
    neither in its dependency output."""
    rsp, nested = tmp_path / "flags.rsp", tmp_path / "nested.rsp"
    nested.write_text("-DVAL=1\n")
    rsp.write_text(f"-O1 @{nested}\n")
    spec = {"name": "rspfile", "cpp_sources": value_src(), "extra_cflags": [f"@{rsp}"]}
    cycle(cxx, spec, lambda: nested.write_text("-DVAL=2\n"), lambda: nested.write_text("-DVAL=1\n"))


def test_specs_file_is_tracked(cache_root, cxx, tmp_path):
    if not cxx.is_gcc:
        pytest.skip("specs files are gcc's")
    specs = tmp_path / "my.specs"
    specs.write_text("*cc1plus:\n+ -DVAL=1\n")
    spec = {"name": "specsfile", "cpp_sources": value_src(), "extra_cflags": [f"-specs={specs}"]}
    cycle(cxx, spec, lambda: specs.write_text("*cc1plus:\n+ -DVAL=2\n"),
          lambda: specs.write_text("*cc1plus:\n+ -DVAL=1\n"))


def test_compiler_path_linker_is_identified_even_after_a_probe_without_it(cache_root, cxx, tmp_path):
    """``COMPILER_PATH`` makes the driver run the ``ld`` found there. A compiler probe memoised
    by a process without it must not stand for a process with it."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for n in (1, 2):
        _archive(tmp_path, tools / f"libv{n}.a", n)
    ld = tools / "ld"

    use = _script_setter(ld, lambda n: f'#!/bin/sh\nexec {shutil.which("ld")} "$@" {tools}/libv{n}.a\n')

    use(1)()
    child({"name": "no_compiler_path", "cpp_sources": value_src("#define VAL 7")})  # memoises the probe
    spec = {"name": "compiler_path", "cpp_sources": DEP_SRC}
    cycle(cxx, spec, use(2), use(1), env={"COMPILER_PATH": str(tools)})


def test_shadow_created_during_the_build_is_never_published_stale(cache_root, tmp_path, monkeypatch):
    """The compiler found ``val.h`` in the second directory; a ``val.h`` saved in the first one
    as it finishes exists when the build records its shadow candidates, so it is no candidate:
    published as it was, the entry would hit although a fresh build reads the new file."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (second / "val.h").write_text("#define VAL 1\n")
    shadow, mark = first / "val.h", tmp_path / "created"
    wrapper = tmp_path / "cxx-shadow.sh"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        "{shutil.which('c++')}" "$@"; rc=$?
        case " $* " in *" -E "*) ;; *main.cpp*)
          if [ ! -e "{mark}" ]; then : > "{mark}"; echo '#define VAL 2' > "{shadow}"; fi;;
        esac
        exit $rc
        """))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    spec = {"name": "midshadow", "cpp_sources": value_src('#include "val.h"'),
            "extra_include_paths": [str(first), str(second)]}
    v1, _, _ = child(spec)
    assert mark.exists() and shadow.exists()
    assert v1 == 2, "the build that raced the new file must not be what loads"
    v2, _, _ = child(spec)
    assert v2 == 2, "a fresh process loaded the library built before the shadowing file appeared"


def test_compiler_proper_chosen_by_dash_b_is_identified(cache_root, cxx, tmp_path):
    """``-B DIR`` makes gcc run ``DIR/cc1plus`` if there is one."""
    real = subprocess.run([cxx.real, "-print-prog-name=cc1plus"], capture_output=True, text=True).stdout.strip()
    if not cxx.is_gcc or not os.path.isabs(real):
        pytest.skip("needs gcc")
    tools = tmp_path / "tools"
    tools.mkdir()
    cc1 = tools / "cc1plus"

    use = _script_setter(cc1, lambda n: f'#!/bin/sh\nexec {real} "$@" -DVAL={n}\n')

    use(1)()
    spec = {"name": "own_cc1", "cpp_sources": value_src(), "extra_cflags": [f"-B{tools}/"]}
    cycle(cxx, spec, use(2), use(1))


def test_has_include_in_a_pinned_header_is_covered(cache_root, tmp_path, monkeypatch):
    """A header of the compiler's own (pinned) directory probes with ``__has_include`` for a
    file outside it, as libstdc++ does for ``<tbb/tbb.h>``. Here the compiler is a wrapper that
    names a directory of the test as its own include directory, so that its headers are pinned."""
    own = tmp_path / "own" / "include"
    own.mkdir(parents=True)
    (own / "probe_own.h").write_text('#if __has_include(<feat_p.h>)\n#include <feat_p.h>\n#else\n#define VAL 1\n#endif\n')
    wrapper = tmp_path / "cxx-own.sh"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "-print-file-name=include" ]; then echo "{own}"; exit 0; fi
        case " $* " in *" -E "*) ;; *main.cpp*) echo compile >> "{tmp_path / 'log'}";; esac
        exec "{shutil.which('c++')}" "$@"
        """))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    inc = tmp_path / "inc"
    inc.mkdir()
    feat = inc / "feat_p.h"
    spec = {"name": "pinned_probe", "cpp_sources": value_src("#include <probe_own.h>"),
            "extra_include_paths": [str(inc)], "extra_cflags": ["-isystem", str(own)]}

    class Count:
        def compiles(self) -> int:
            log = tmp_path / "log"
            return len(log.read_text().splitlines()) if log.exists() else 0

    e = child(spec)
    assert not any("probe_own" in p for p in StubCache().lookup(StubSpec(**spec)).manifest.headers), \
        "the wrapper's include directory must count as pinned for this test to mean anything"
    del e
    cycle(Count(), spec, lambda: feat.write_text("#define VAL 2\n"), feat.unlink)


def _needs_gnu_as(cxx) -> None:
    real = subprocess.run([cxx.real, "-print-prog-name=cc1plus"], capture_output=True, text=True).stdout.strip()
    if not cxx.is_gcc or not os.path.isabs(real):
        pytest.skip("needs gcc with GNU as")


def _incbin_src(name: str) -> str:
    """A stub whose ``value()`` is the first int of the file GNU as finds for ``.incbin "name"``."""
    return (f'asm(".section .rodata\\n.globl blob\\nblob: .incbin \\"{name}\\"\\n.text");\n'
            'extern "C" const int blob;\nextern "C" int value(void) { return blob; }\n')


def _int_file(path, n: int):
    return lambda: path.write_bytes(n.to_bytes(4, "little"))


def test_file_read_by_the_assembler_is_tracked(cache_root, cxx, tmp_path):
    """``.incbin`` in inline assembly: GNU as reads the file, the preprocessor never sees it."""
    _needs_gnu_as(cxx)
    data = tmp_path / "data.bin"
    _int_file(data, 1)()
    spec = {"name": "incbin", "cpp_sources": _incbin_src(str(data))}
    cycle(cxx, spec, _int_file(data, 2), _int_file(data, 1))


@pytest.mark.parametrize("flags", [["-MMD"], ["-MMD", "-MF", "mine.d"], ["-MD", "-MF", "mine.d"]],
                         ids=["MMD", "MMD-MF", "MD-MF"])
def test_the_callers_dependency_flags_do_not_narrow_what_is_tracked(cache_root, cxx, tmp_path, flags):
    """A caller's own dependency flags (torch's build takes them): ``-MMD`` leaves headers of
    system directories (``-isystem``, ``CPLUS_INCLUDE_PATH``) out of the list and ``-MF`` names
    another file. The build's own flags come after them, where the last one wins."""
    d = tmp_path / "sys"
    d.mkdir()
    h = d / "depflag_val.h"
    h.write_text("#define VAL 1\n")
    spec = {"name": "depflags", "cpp_sources": value_src("#include <depflag_val.h>"),
            "extra_cflags": [*flags, "-isystem", str(d)]}
    cycle(cxx, spec, lambda: h.write_text("#define VAL 2\n"), lambda: h.write_text("#define VAL 1\n"))


def test_the_callers_assembler_dependency_file_does_not_replace_the_builds(cache_root, cxx, tmp_path):
    """``-Wa,--MD,FILE`` from the caller: GNU as writes one list, the last one named."""
    _needs_gnu_as(cxx)
    data = tmp_path / "data.bin"
    _int_file(data, 1)()
    spec = {"name": "incbin_md", "cpp_sources": _incbin_src(str(data)), "extra_cflags": ["-Wa,--MD,mine.d"]}
    cycle(cxx, spec, _int_file(data, 2), _int_file(data, 1))


def test_a_script_named_by_cxx_is_identified_by_its_content(cache_root, tmp_path, monkeypatch):
    """``CXX`` names a script that adds a flag and runs the compiler: the compiler behind it is
    the same before and after the script is edited, the library is not."""
    script = tmp_path / "cxx-flags.sh"

    def use(n: int):
        def go():
            script.write_text(f'#!/bin/sh\nexec "{shutil.which("c++")}" -DVAL={n} "$@"\n'
                              f'# {"padding " * n}\n')  # another size too: the probe memo is by stat
            script.chmod(0o755)
        return go

    use(1)()
    monkeypatch.setenv("CXX", str(script))
    spec = {"name": "cxx_script", "cpp_sources": value_src()}
    v1, k1, _ = child(spec)
    use(2)()
    v2, k2, _ = child(spec)
    assert v1 == 1 and v2 == 2 and k2 != k1
    use(1)()
    assert child(spec)[:2] == (1, k1)


def test_links_that_loop_or_grow_are_followed_as_far_as_the_kernel_would(tmp_path):
    """A loop (``a -> b -> a``) and a link into itself (``c -> c/x``: each step resolves one
    level deeper) end: each link is filed once, as what it points to; nothing under them exists."""
    from stubcache.hit import WAS, WAS_LINK, appeared
    from stubcache.key.inputs import changed_inputs
    from stubcache.key.tracking import MAX_LINKS, file_candidates

    d = tmp_path / "d"
    d.mkdir()
    (d / "a").symlink_to("b")
    (d / "b").symlink_to("a")
    (d / "c").symlink_to("c/x")
    rows = file_candidates([str(d / "a" / "h.h"), str(d / "c" / "h.h")])
    names = rows[str(d)][1]
    assert sorted(names) == sorted(["a" + WAS + WAS_LINK + "b", "b" + WAS + WAS_LINK + "a",
                                    "c" + WAS + WAS_LINK + "c/x"])
    assert MAX_LINKS == 40 and not appeared(str(d), names)
    (d / "b").unlink()
    (d / "b").mkdir()  # `a` resolves now: b/h.h can appear
    assert appeared(str(d), names)
    inputs = {"shadows": rows}
    assert changed_inputs({}, inputs) == [f"{d / 'b'}: was a link to a the compiler passed over, is not now"]


def test_a_link_to_a_directory_is_filed_with_the_directory_it_names(tmp_path):
    """``inc/val.h -> real`` where ``real`` is a directory: the compiler passes over both; a
    header put in the place of either is read."""
    from stubcache.hit import WAS, WAS_DIR, WAS_LINK, appeared
    from stubcache.key.tracking import file_candidates

    inc = tmp_path / "inc"
    real = tmp_path / "real"
    inc.mkdir()
    real.mkdir()
    (inc / "val.h").symlink_to(real)
    rows = file_candidates([str(inc / "val.h")])
    assert rows[str(inc)][1] == ["val.h" + WAS + WAS_LINK + str(real)]
    assert rows[str(tmp_path)][1] == ["real" + WAS + WAS_DIR]
    assert not appeared(str(tmp_path), rows[str(tmp_path)][1])
    real.rmdir()
    assert not appeared(str(tmp_path), rows[str(tmp_path)][1])  # gone: nothing to read
    real.write_text("#define VAL 2\n")
    assert appeared(str(tmp_path), rows[str(tmp_path)][1])


def test_an_include_name_is_read_up_to_a_nul_as_gcc_reads_it():
    """gcc cuts a header name at a NUL byte (``__has_include("val.h\\0lfoo")`` tests ``val.h``);
    a name kept whole would also read as a record of what the compiler passed over."""
    from stubcache.key.tracking import has_include_names, quoted_include_names

    assert has_include_names(['#if __has_include("val.h\0lfoo")\n#endif\n', "__has_include(<\0d>)"]) == ["val.h"]
    assert quoted_include_names('#include "cfg.h\0d"\n#include "\0x"\n') == ["cfg.h"]


@pytest.mark.parametrize("flags,kept", [
    (["-O2", "-MMD", "-MP", "-MF", "a.d", "-MT", "t", "-MQ", "q", "-Wall"], ["-O2", "-Wall"]),
    (["-MFa.d", "-MTt", "-MQq", "-MD", "-DX"], ["-DX"]),
    (["-Wp,-MD,a.d"], []),
    (["-Wp,-DA,-MMD,a.d,-DB", "-Wp,-MF,x,-MP,-MTy"], ["-Wp,-DA,-DB"]),
    (["-Wa,--MD,a.d,-I,inc", "-Wa,--noexecstack"], ["-Wa,-I,inc", "-Wa,--noexecstack"]),
    (["-Xpreprocessor", "-MD", "-Xpreprocessor", "a.d", "-Xpreprocessor", "-DX"], ["-Xpreprocessor", "-DX"]),
    (["-Xassembler", "--MD", "-O1", "-Xassembler", "a.d", "-Xassembler", "-I"], ["-O1", "-Xassembler", "-I"]),
    (["-M", "-MM", "-MG", "-Mx"], ["-M", "-MM", "-MG", "-Mx"]),  # the compiler says what those do
])
def test_a_callers_dependency_output_options_are_found_in_every_spelling(flags, kept):
    from stubcache.build.buildinputs import without_dependency_output

    assert without_dependency_output(flags) == kept


@pytest.mark.parametrize("how", ["L", "LIBRARY_PATH"])
def test_a_library_a_linker_script_names_is_shadowed_along_the_library_path(cache_root, cxx, tmp_path, how):
    """``libwrap.a`` is a linker script, ``INPUT(-ldep)``: the linker looks ``-ldep`` up along
    the same path as a flag's, so a ``libdep.a`` appearing in an earlier directory is what a
    fresh link would take (found by review: scripts' names had no shadow rows)."""
    l1, l2 = tmp_path / "l1", tmp_path / "l2"
    l1.mkdir()
    l2.mkdir()
    _archive(tmp_path, l2 / "libdep.a", 1)
    (l2 / "libwrap.a").write_text("/* a script */ INPUT(-ldep)\n")
    env = None
    if how == "L":
        spec = {"name": "lib_script", "cpp_sources": DEP_SRC, "extra_ldflags": [f"-L{l1}", f"-L{l2}", "-lwrap"]}
    else:
        spec = {"name": "lib_script_env", "cpp_sources": DEP_SRC, "extra_ldflags": ["-lwrap"]}
        env = {"LIBRARY_PATH": f"{l1}:{l2}"}
    cycle(cxx, spec, lambda: _archive(tmp_path, l1 / "libdep.a", 2), (l1 / "libdep.a").unlink, env=env)


@pytest.mark.parametrize("name", ["libdep.a", "sub/libdep.a"])
def test_a_file_a_linker_script_names_is_shadowed_in_the_scripts_own_directory(cache_root, cxx, tmp_path, name):
    """``INPUT(libdep.a)`` in ``l2/libwrap.a``, linked from ``l1`` (``-L l1 -L l2``): ld 2.40
    looks in the script's own directory first, so a ``libdep.a`` appearing beside the script is
    what a fresh link takes, though ``l2`` comes after ``l1`` (found by review; ``sub/libdep.a``
    names are searched for as well)."""
    l1, l2 = tmp_path / "l1", tmp_path / "l2"
    (l1 / name).parent.mkdir(parents=True, exist_ok=True)
    (l2 / name).parent.mkdir(parents=True, exist_ok=True)
    _archive(tmp_path, l1 / name, 1)
    (l2 / "libwrap.a").write_text(f"INPUT({name})\n")
    spec = {"name": "lib_script_dir", "cpp_sources": DEP_SRC, "extra_ldflags": [f"-L{l1}", f"-L{l2}", "-lwrap"]}
    cycle(cxx, spec, lambda: _archive(tmp_path, l2 / name, 2), (l2 / name).unlink)


@pytest.mark.parametrize("change", ["edit", "shadow"])
def test_a_file_a_linker_script_includes_is_tracked(cache_root, cxx, tmp_path, change):
    """``l1/libwrap.a`` = ``INCLUDE more.ld``, found in ``l2`` (``-L l1 -L l2``): ld's
    dependency file names it ``more.ld``, as written, so it was neither tracked (an edit of
    ``l2/more.ld`` was a stale hit) nor shadowed (one appearing in ``l1`` is what ld takes
    first); found by review. Each case fails before the fix."""
    l1, l2 = tmp_path / "l1", tmp_path / "l2"
    l1.mkdir()
    l2.mkdir()
    _archive(tmp_path, l2 / "libdepone.a", 1)
    _archive(tmp_path, l2 / "libdeptwo.a", 2)
    (l1 / "libwrap.a").write_text("INCLUDE more.ld\n")
    (l2 / "more.ld").write_text("INPUT(-ldepone)\n")
    spec = {"name": f"lib_include_{change}", "cpp_sources": DEP_SRC, "extra_ldflags": [f"-L{l1}", f"-L{l2}", "-lwrap"]}
    if change == "edit":
        cycle(cxx, spec, lambda: (l2 / "more.ld").write_text("INPUT(-ldeptwo)    \n"),
              lambda: (l2 / "more.ld").write_text("INPUT(-ldepone)\n"))
    else:
        cycle(cxx, spec, lambda: (l1 / "more.ld").write_text("INPUT(-ldeptwo)\n"), (l1 / "more.ld").unlink)


def test_included_scripts_are_found_along_the_search_dirs_and_followed(tmp_path):
    from stubcache.key.tracking import UNEXPRESSED, script_names

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "libtop.so").write_text("INCLUDE \"mid.ld\" INCLUDE gone.ld\n")
    (b / "mid.ld").write_text("INPUT(-lfrommid) INCLUDE mid.ld\n")  # a loop ends
    got = script_names([str(a / "libtop.so")], [str(a), str(b), "relative"])
    assert got.included == [str(b / "mid.ld"), UNEXPRESSED]
    assert got.watch == [str(a / "mid.ld"), str(a / "gone.ld"), str(b / "gone.ld")]
    assert got.pairs == [(str(b / "mid.ld"), "frommid")]


def test_the_names_a_linker_script_hands_the_linker(tmp_path):
    from stubcache.key.tracking import script_names

    script = tmp_path / "libx.so"
    script.write_text("/* GROUP(-lnot) */\nOUTPUT_FORMAT(elf64-x86-64)\n"
                      "GROUP ( /lib/libc.so.6 libc_nonshared.a AS_NEEDED ( -lfoo /lib/ld.so ) )\nINPUT(-lbar,libz.so.1)\n"
                      "/* two\nlines INPUT(-lnot2) */ XINPUT(-lnot3) x = 1;INPUT\t(\n-lsemi)\n"
                      # found by review: a list glued to a brace, a # comment hiding a /*, a quoted name
                      "SECTIONS { }INPUT(-lglued)\n# a note /* not a comment here\nINPUT(\"libq.a\" #h.a)\n/* */\n"
                      "INPUT(sub/libs.a =/sysroot/libr.a)\n")
    elf = tmp_path / "libe.so"
    elf.write_bytes(b"\x7fELF INPUT(-lno)")
    header = tmp_path / "h.h"
    header.write_text("INPUT(-lno)")
    fifo = tmp_path / "libf.so"
    os.mkfifo(fifo)
    assert [n for _, n in script_names([str(script), str(elf), str(header), str(fifo), str(tmp_path / "libgone.a")]).pairs] == [
        ":libc_nonshared.a", "foo", "bar", ":libz.so.1", "semi", "glued", ":libq.a", ":#h.a", ":sub/libs.a"]


PLUGIN_SRC = r"""
/* A minimal ld plugin: once all symbols are read, it adds one object file to the link. */
struct tv { int tag; union { int val; const char *str; void *ptr; } u; };
typedef int (*add_input_file_fn)(const char *);
typedef int (*all_symbols_read_fn)(void);
typedef int (*register_fn)(all_symbols_read_fn);
static add_input_file_fn add_input_file;
static int all_read(void) { return add_input_file(OBJ) ? 1 : 0; }
int onload(struct tv *t) {
  register_fn reg = 0;
  for (; t->tag != 0; t++) {
    if (t->tag == 6) reg = (register_fn)t->u.ptr;  /* LDPT_REGISTER_ALL_SYMBOLS_READ_HOOK */
    if (t->tag == 10) add_input_file = (add_input_file_fn)t->u.ptr;  /* LDPT_ADD_INPUT_FILE */
  }
  if (reg && add_input_file) reg(all_read);
  return 0;
}
"""


def test_a_linker_plugin_appearing_in_a_program_directory_misses(cache_root, cxx, tmp_path):
    """gcc hands ld ``-plugin DIR/liblto_plugin.so`` for the first of its program directories
    (``COMPILER_PATH``, ``-B``, its own) that has one: a plugin appearing in ``COMPILER_PATH``
    is loaded by a fresh link, and here adds an object defining ``weak_value`` (found by review)."""
    if not cxx.is_gcc:
        pytest.skip("gcc's driver")
    own = subprocess.run([cxx.real, "-print-file-name=liblto_plugin.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(own):
        pytest.skip("this gcc has no linker plugin")
    work, progs = tmp_path / "o", tmp_path / "progs"
    work.mkdir()
    progs.mkdir()
    (work / "two.c").write_text("int weak_value(void) { return 2; }\n")
    subprocess.run(["cc", "-fPIC", "-c", str(work / "two.c"), "-o", str(work / "two.o")], check=True)
    (work / "plugin.c").write_text(PLUGIN_SRC)
    built = work / "liblto_plugin.so"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DOBJ="{work / "two.o"}"', str(work / "plugin.c"), "-o", str(built)],
                   check=True)
    src = ('extern "C" int weak_value(void) __attribute__((weak));\n'
           'extern "C" int value(void) { return weak_value ? weak_value() : 1; }\n')
    spec = {"name": "lto_plugin", "cpp_sources": src}
    cycle(cxx, spec, lambda: shutil.copy(built, progs / "liblto_plugin.so"), (progs / "liblto_plugin.so").unlink,
          env={"COMPILER_PATH": str(progs)})


@pytest.mark.parametrize("where", ["-B", "LIBRARY_PATH"])
def test_a_start_file_appearing_earlier_on_the_drivers_own_list_misses(cache_root, cxx, tmp_path, where):
    """gcc finds its start files (``crti.o``…) along its ``libraries:`` list, ``-B`` and
    ``LIBRARY_PATH`` directories (with its multiarch suffixes) first: a ``crti.o`` appearing
    there is what a fresh link takes (here the real one plus a definition of ``weak_value``;
    found by review)."""
    if not cxx.is_gcc:
        pytest.skip("gcc's driver")
    real = subprocess.run([cxx.real, "-print-file-name=crti.o"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(real):
        pytest.skip("no crti.o")
    work = tmp_path / "o"
    work.mkdir()
    (work / "two.c").write_text("int weak_value(void) { return 2; }\n")
    subprocess.run(["cc", "-fPIC", "-c", str(work / "two.c"), "-o", str(work / "two.o")], check=True)
    shadowing = work / "crti.o"
    subprocess.run(["ld", "-r", real, str(work / "two.o"), "-o", str(shadowing)], check=True)
    src = ('extern "C" int weak_value(void) __attribute__((weak));\n'
           'extern "C" int value(void) { return weak_value ? weak_value() : 1; }\n')
    spec: dict = {"name": "startfile", "cpp_sources": src}
    env = None
    if where == "-B":
        target = tmp_path / "bdir"
        spec["extra_cflags"] = [f"-B{target}/"]
    else:
        found = subprocess.run([cxx.real, "-print-search-dirs"], capture_output=True, text=True,
                               env=dict(os.environ, LIBRARY_PATH=str(tmp_path / "lp"))).stdout
        libs = next(ln for ln in found.splitlines() if ln.startswith("libraries: "))
        first = libs[len("libraries: "):].lstrip("=").split(":")[0]
        if not first.startswith(str(tmp_path / "lp")):
            pytest.skip("this gcc does not search LIBRARY_PATH first")
        target = Path(first)  # LIBRARY_PATH/<multiarch>/<version>/, as gcc appends them
        env = {"LIBRARY_PATH": str(tmp_path / "lp")}
    target.mkdir(parents=True)
    cycle(cxx, spec, lambda: shutil.copy(shadowing, target / "crti.o"), (target / "crti.o").unlink, env=env)


def test_a_relative_specs_file_found_along_library_path_is_tracked(cache_root, cxx, tmp_path):
    """gcc looks a relative ``-specs=NAME`` up in its start-file directories, ``LIBRARY_PATH``
    among them: that file is an input, and one appearing earlier is what a fresh build reads
    (found by review)."""
    if not cxx.is_gcc:
        pytest.skip("specs files are gcc's")
    early, late = tmp_path / "early", tmp_path / "late"
    early.mkdir()
    late.mkdir()
    specs = late / "val.specs"
    specs.write_text("*cc1plus:\n+ -DVAL=1\n\n")
    env = {"LIBRARY_PATH": f"{early}:{late}"}
    spec = {"name": "specs_lp", "cpp_sources": value_src(), "extra_cflags": ["-specs=val.specs"]}
    cycle(cxx, spec, lambda: specs.write_text("*cc1plus:\n+ -DVAL=2 \n\n"),
          lambda: specs.write_text("*cc1plus:\n+ -DVAL=1\n\n"), env=env)
    shadow = early / "val.specs"
    cycle(cxx, spec, lambda: shadow.write_text("*cc1plus:\n+ -DVAL=2\n\n"), shadow.unlink, env=env)


def test_a_file_a_specs_file_includes_is_tracked(cache_root, cxx, tmp_path):
    """``%include <FILE>`` in a specs file reads FILE (found by review)."""
    if not cxx.is_gcc:
        pytest.skip("specs files are gcc's")
    inner = tmp_path / "inner.specs"
    inner.write_text("*cc1plus:\n+ -DVAL=1\n\n")
    outer = tmp_path / "outer.specs"
    outer.write_text(f"%include <{inner}>\n")
    spec = {"name": "specs_inc", "cpp_sources": value_src(), "extra_cflags": [f"-specs={outer}"]}
    cycle(cxx, spec, lambda: inner.write_text("*cc1plus:\n+ -DVAL=2 \n\n"),
          lambda: inner.write_text("*cc1plus:\n+ -DVAL=1\n\n"))


def test_specs_files_are_followed_as_gcc_finds_them(tmp_path):
    from stubcache.key.tracking import specs_files

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "top.specs").write_text(f"%include <mid.specs>\n%include_noerr <{tmp_path / 'none.specs'}>\n")
    (b / "mid.specs").write_text("%include <top.specs>\n")  # a loop ends
    read, watch = specs_files(["top.specs"], [str(a), str(b), "relative"])
    assert read == [str(b / "top.specs"), str(b / "mid.specs")]
    assert watch == [str(a / "top.specs"), str(a / "mid.specs"), str(tmp_path / "none.specs")]


def test_a_file_the_assembler_finds_along_its_include_dirs_is_shadowed(cache_root, cxx, tmp_path):
    """``.incbin "data.bin"`` with ``-Wa,-I,a,-I,b``: GNU as takes the first ``data.bin`` along
    its ``-I`` list, so one appearing in ``a`` is what a fresh build reads (found by review)."""
    _needs_gnu_as(cxx)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _int_file(b / "data.bin", 1)()
    spec = {"name": "incbin_dirs", "cpp_sources": _incbin_src("data.bin"), "extra_cflags": [f"-Wa,-I,{a},-I{b}"]}
    cycle(cxx, spec, _int_file(a / "data.bin", 2), (a / "data.bin").unlink)


def test_the_assemblers_include_dirs_and_what_they_shadow():
    from stubcache.key.tracking import assembler_include_dirs, prefix_list_candidates

    flags = ["-O2", "-Wa,-I,/a,--noexecstack,-I/b", "-Xassembler", "-I", "-Xassembler", "/c", "-I/not-as"]
    assert assembler_include_dirs(flags) == ["/a", "/b", "/c"]
    assert prefix_list_candidates(["/c/x/d.bin", "/b/e.bin", "/a/f.bin", "/z/g.bin"], ["/a", "/b", "/c"]) == [
        "/a/x/d.bin", "/b/x/d.bin", "/a/e.bin"]


@pytest.mark.torch
def test_a_system_header_a_separate_unit_reads_is_tracked(cache_root, tmp_path):
    """A separate-units build (torch's ``load``, one object per source) lists what each object
    read through torch's ``-MMD``, which leaves out every header found in a system directory
    (here ``-isystem``; ``/usr/include`` too): each unit is preprocessed again for the full list,
    so an edit there misses instead of loading the old library."""
    sysdir = tmp_path / "sys"
    sysdir.mkdir()
    header = sysdir / "unit_val.h"
    header.write_text("#define VAL 1\n")
    spec = {"name": "units_sys", "cpp_sources": [value_src("#include <unit_val.h>"), 'extern "C" int other(void) { return 3; }\n'],
            "separate_units": True, "no_implicit_headers": True, "extra_cflags": ["-isystem", str(sysdir)]}
    v1, k1, _ = child(spec)
    assert v1 == 1
    header.write_text("#define VAL 2\n")
    v2, k2, _ = child(spec)
    assert v2 == 2, "a fresh process loaded the old library after a unit's system header changed"
    assert k2 != k1
    header.write_text("#define VAL 1\n")
    assert child(spec)[:2] == (1, k1)


def test_each_cpp_unit_is_listed_again_and_a_unit_that_cannot_be_is_unexpressed(tmp_path, cxx, caplog):
    from stubcache.build.buildinputs import compiler_facts, unit_deps
    from stubcache.key.tracking import UNEXPRESSED

    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "a.h").write_text("int a_h;\n")
    build = tmp_path / "build"
    build.mkdir()
    (build / "build.ninja").write_text(f"cflags = -isystem {inc} -DX=1\npost_cflags = -fPIC\n")
    (build / "src0.cpp").write_text("#include <a.h>\n")
    (build / "src1.cu").write_text("#include <not_read.h>\n")  # a CUDA unit keeps its -MMD list
    (build / "src2.cpp").write_text("#if X == 1\n#include <a.h>\n#endif\n")
    spec = StubSpec("units", ["", ""], separate_units=True)
    sources = [str(build / n) for n in ("src0.cpp", "src1.cu", "src2.cpp")]
    deps = unit_deps(spec, str(build), sources, compiler_facts(), jobs=1)
    assert [d for d in deps if d.endswith("a.h")] == [str(inc / "a.h")] * 2 and UNEXPRESSED not in deps
    # A unit compiled as C (a -x among torch's flags) is preprocessed as C again (found by review).
    (inc / "c_only.h").write_text("int c_h;\n")
    (build / "build.ninja").write_text(f"cflags = -x c -isystem {inc}\npost_cflags = -fPIC\n")
    (build / "src2.cpp").write_text("#ifdef __cplusplus\n#include <cxx_only.h>\n#else\n#include <c_only.h>\n#endif\n")
    deps = unit_deps(spec, str(build), sources, compiler_facts())
    assert str(inc / "c_only.h") in deps and UNEXPRESSED not in deps
    (build / "src2.cpp").write_text("#include <missing.h>\n")
    with caplog.at_level(logging.WARNING, logger="stubcache"):
        assert unit_deps(spec, str(build), sources, compiler_facts())[-1] == UNEXPRESSED
    assert "src2.cpp" in caplog.text and "missing.h" in caplog.text and "not published" in caplog.text
