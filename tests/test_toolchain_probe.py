"""The compiler probe (stubcache.key.toolchain._probe_compiler) facing a driver that prints
garbage or hangs in one probe: it answers without raising, and leaves no probe running."""

from __future__ import annotations

import os
import time

from stubcache.key import toolchain

FAKE = r"""#!/bin/sh
case "$1" in
  --version) echo "fakecc 1.0"; sleep "${FAKE_SLEEP:-0}" ;;
  -print-prog-name=as) printf '/usr/bin/a\000s\n' ;;
  -print-prog-name=ld) printf 'ld\n' ;;
  -###) printf ' "/no/such\000/cc1plus" -quiet\n' >&2 ;;
  *) : ;;
esac
"""


def _children() -> set[int]:
    found: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as fh:
                found.update(int(p) for p in fh.read().split())
        except OSError:
            pass
    return found


def test_a_driver_printing_nul_bytes_names_no_tool_and_leaves_no_probe(tmp_path):
    fake = tmp_path / "fakecc"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    before = _children()
    value = toolchain._probe_compiler([str(fake)])
    assert value["version"] == "fakecc 1.0"
    assert value["real"].get("cc1") is None and value["real"]["as"] is None
    assert _children() <= before


def test_every_probe_is_reaped_when_reading_the_answers_fails(tmp_path, monkeypatch):
    """A failure while the answers are read (here: the assembler's path cannot be resolved)
    does not leave the slow --version probe running behind it."""
    fake = tmp_path / "fakecc"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    monkeypatch.setenv("FAKE_SLEEP", "20")

    def boom(path):
        raise RuntimeError("resolving failed")

    monkeypatch.setattr(toolchain, "_resolve_tool", boom)
    before = _children()
    t0 = time.monotonic()
    try:
        toolchain._probe_compiler([str(fake)])
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failure was swallowed")
    assert time.monotonic() - t0 < 15  # killed, not waited out
    assert _children() <= before
