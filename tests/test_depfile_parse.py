"""stubcache.key.tracking's dependency-file parser on names only an unusual file system holds."""

from __future__ import annotations

from stubcache.key.tracking import UNEXPRESSED, parse_depfile


def test_a_linker_name_that_make_escapes_leave_ambiguous_is_unexpressed(tmp_path):
    """ld's layout (``--dependency-file``) with a name holding two backslashes and a blank: ld
    writes it raw, lld would have escaped ``a\\ b`` so; which file was read is unknown, so the
    build cannot track it (before, the parser failed with a TypeError)."""
    name = "a\\\\ b"
    dep = tmp_path / "link.d"
    dep.write_text(f"out.so: \\\n  /usr/lib/x.o \\\n  {name}\n\n/usr/lib/x.o:\n\n{name}:\n")
    assert parse_depfile(str(dep)) == ["/usr/lib/x.o", UNEXPRESSED]


def test_real_paths_resolve_as_realpath_does(tmp_path):
    """tracking.RealPaths (each directory resolved once per build) against os.path.realpath, on
    a tree of links: to directories, to files, dangling, chained, relative with ``..``, and paths
    through them with ``..`` steps, missing names and a loop."""
    import itertools
    import os

    from stubcache.key.tracking import RealPaths

    t = tmp_path
    (t / "a" / "b").mkdir(parents=True)
    (t / "a" / "b" / "f.h").write_text("x")
    (t / "c").mkdir()
    os.symlink(t / "a" / "b", t / "c" / "to_b")            # a link to a directory
    os.symlink("../a/b/f.h", t / "c" / "rel_f.h")          # relative, with ..
    os.symlink(t / "c" / "rel_f.h", t / "c" / "chain.h")   # a chain
    os.symlink(t / "nowhere", t / "c" / "dangling.h")
    os.symlink(t / "c" / "loop", t / "c" / "loop")
    os.symlink("to_b", t / "c" / "to_to_b")
    dirs = [str(t / "a"), str(t / "a" / "b"), str(t / "c"), str(t / "c" / "to_b"), str(t / "c" / "to_to_b"),
            str(t / "c" / "to_b" / ".."), str(t / "c" / "missing"), str(t / "c" / "loop")]
    names = ["f.h", "b", "rel_f.h", "chain.h", "dangling.h", "loop", "to_b", "absent.h", ".."]
    real = RealPaths()
    for _ in range(2):  # the second round from the directory memo
        for d, n in itertools.product(dirs, names):
            path = os.path.join(d, n)
            assert real(path) == os.path.realpath(path), path


def test_a_name_ending_in_a_backslash_at_a_line_end_is_unexpressed(tmp_path):
    """gcc, clang and GNU as break a line as ``" \\<newline>"``; a backslash ending a line with no
    blank before it ends a name (gcc writes ``x\\`` unescaped). Read as a break, it would name
    ``x``, a file that may exist (a stale hit through a decoy): the list is unexpressed."""
    dep = tmp_path / "main.d"
    dep.write_text("main.o: main.cpp /inc/x\\\n")
    assert parse_depfile(str(dep)) == [UNEXPRESSED]
    dep.write_text("main.o: main.cpp /inc/x\\\n /inc/y.h\n")
    assert parse_depfile(str(dep)) == [UNEXPRESSED]
    dep.write_text("main.o: main.cpp \\\n /inc/x.h /inc/a\\ b.h\n")
    assert parse_depfile(str(dep)) == ["main.cpp", "/inc/x.h", "/inc/a b.h"]
