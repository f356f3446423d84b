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
