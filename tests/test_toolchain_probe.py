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


TOOL = r"""#!/bin/sh
if [ -e "{log}.named" ]; then when=after; else when=before; fi
echo "$0 $* $when" >> "{log}"
case "$1" in
  --version) echo "{name} 9.9 ({where})" ;;
  --help) echo "  --dependency-file=FILE" ;;
esac
"""


def _driver(tmp_path, as_name: str, log) -> str:
    # (it names the assembler half a second late, and marks when it has: the tools log whether
    # they ran before that)
    fake = tmp_path / "fakecc"
    fake.write_text(r"""#!/bin/sh
case "$1" in
  --version) echo "fakecc 1.0" ;;
  -print-prog-name=as) sleep 0.5; : > "%s.named"; echo "%s" ;;
  -print-prog-name=ld) echo ld ;;
  *) : ;;
esac
""" % (log, as_name))
    fake.chmod(0o755)
    return str(fake)


def _tools(d, log, where: str) -> None:
    d.mkdir()
    for name in ("as", "ld"):
        (d / name).write_text(TOOL.format(log=log, name=name, where=where))
        (d / name).chmod(0o755)


def test_the_assembler_and_linker_on_path_are_probed_once_beside_the_driver(tmp_path, monkeypatch):
    """The driver names ``as`` and ``ld`` found on PATH: their probes, started with the driver's
    (before it named them), are the ones read; none is run twice."""
    log = tmp_path / "runs.log"
    _tools(tmp_path / "bin", log, "path")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    before = _children()
    value = toolchain._probe_compiler([_driver(tmp_path, "as", log)])
    real = value["real"]
    assert real["as"]["path"] == str(tmp_path / "bin" / "as") and real["as"]["version"] == "as 9.9 (path)"
    assert real["ld"]["version"] == "ld 9.9 (path)" and real["ld_depfile"] is True
    assert sorted(log.read_text().splitlines()) == sorted(
        f"{tmp_path / 'bin' / n} {a} before" for n, a in (("as", "--version"), ("ld", "--version"), ("ld", "--help")))
    assert _children() <= before


def test_an_assembler_the_driver_names_elsewhere_is_the_one_probed(tmp_path, monkeypatch):
    """The driver names its own ``as`` (a ``-B`` directory, a cross toolchain): what PATH's
    would have answered is not taken, and its probe is ended."""
    log = tmp_path / "runs.log"
    _tools(tmp_path / "bin", log, "path")
    _tools(tmp_path / "own", log, "own")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    before = _children()
    value = toolchain._probe_compiler([_driver(tmp_path, str(tmp_path / "own" / "as"), log)])
    assert value["real"]["as"] == {"path": str(tmp_path / "own" / "as"), "sha256": value["real"]["as"]["sha256"],
                                   "version": "as 9.9 (own)"}
    assert value["real"]["ld"]["version"] == "ld 9.9 (path)"
    assert f"{tmp_path / 'own' / 'as'} --version after" in log.read_text().splitlines()
    assert _children() <= before
