"""Which dynamic loader the build's load check asks (stubcache.build.loadcheck): the one this
process was started with, found from the executable's ELF interpreter or, for a process started
through the loader itself, from its own mappings; both name the same file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stubcache.build import loadcheck

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's loader: Linux")


def test_the_executables_interpreter_is_the_loader_mapped_here():
    found = loadcheck._interpreter("/proc/self/exe")
    mapped = loadcheck._mapped_loader()
    if mapped is None:
        pytest.skip("no glibc loader mapped in this process (musl?)")
    assert found is not None and os.path.realpath(found) == os.path.realpath(mapped)
    assert os.path.realpath(loadcheck.dynamic_loader() or "") == os.path.realpath(mapped)


def test_a_file_that_is_not_an_elf_executable_names_no_interpreter(tmp_path):
    for content in (b"", b"#!/bin/sh\n", b"\x7fELF" + b"\0" * 100, os.urandom(4096)):
        (tmp_path / "x").write_bytes(content)
        assert loadcheck._interpreter(str(tmp_path / "x")) is None
    assert loadcheck._interpreter(str(tmp_path / "missing")) is None
    assert loadcheck._interpreter(str(tmp_path)) is None  # a directory


def test_a_process_started_through_the_loader_finds_it_in_its_mappings():
    mapped = loadcheck._mapped_loader()
    if mapped is None:
        pytest.skip("no glibc loader mapped in this process (musl?)")
    code = ("from stubcache.build import loadcheck; "
            "print(loadcheck._interpreter('/proc/self/exe')); print(loadcheck.dynamic_loader())")
    out = subprocess.run([mapped, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    own, loader = out.stdout.split()
    assert own == "None"  # the loader has no interpreter of its own
    assert os.path.realpath(loader) == os.path.realpath(mapped)


def test_musls_loader_under_glibcs_name_is_not_asked(tmp_path):
    """A compatibility package may install musl's loader under glibc's name (a link): the load
    check asks only glibc's loader, so it looks at what the name links to as well."""
    musl = tmp_path / "ld-musl-x86_64.so.1"
    musl.write_bytes(b"\x7fELF")
    link = tmp_path / "ld-linux-x86-64.so.2"
    link.symlink_to(musl)
    assert not loadcheck._glibc_loader(str(link)) and not loadcheck._glibc_loader(str(musl))
    glibc = tmp_path / "ld-2.31.so"  # glibc before 2.34 names its loader file this way
    glibc.write_bytes(b"\x7fELF")
    (tmp_path / "old").mkdir()
    old = tmp_path / "old" / "ld-linux-x86-64.so.2"
    old.symlink_to(glibc)
    assert loadcheck._glibc_loader(str(glibc)) and loadcheck._glibc_loader(str(old))


def test_a_check_interrupted_while_its_loader_runs_leaves_no_child(tmp_path):
    # Ctrl-C while the build waits for the loader's answer: the loader is killed and reaped, as
    # subprocess.run did before the check ran beside the input tracking.
    # A static program (a dynamic one, a shell included, only lists its libraries under the
    # check's LD_TRACE_LOADED_OBJECTS) standing in for a loader that takes its time.
    src = tmp_path / "slow.c"
    src.write_text("#include <unistd.h>\nint main(void) { sleep(30); return 0; }\n")
    sleeper = tmp_path / "slow-loader"
    made = subprocess.run(["cc", "-static", "-o", str(sleeper), str(src)], capture_output=True)
    if made.returncode != 0:
        pytest.skip("no static C library to build the stand-in loader")
    code = f"""
import os, signal
from stubcache.build import loadcheck
loadcheck._loader[:] = [{str(sleeper)!r}]  # this process's loader, as dynamic_loader() found it
pending = loadcheck.start_check({str(sleeper)!r})
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)  # Ctrl-C's exception, in the waiting thread, in 0.5 s
signal.setitimer(signal.ITIMER_REAL, 0.5)
try:
    loadcheck.finish_check(pending, "x")
except KeyboardInterrupt:
    pass
try:
    os.kill(pending.proc.pid, 0)
    print("left running")
except ProcessLookupError:
    print("gone")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "gone", out.stderr
