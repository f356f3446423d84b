"""Property: whatever a root contains — random file kinds, names with control characters,
symlinks out of the root, FIFOs, hostile JSON values — ``ls``, ``stats``, ``verify``,
``prune --dry-run``, ``prune --yes`` and a load never raise, never hang (each runs under an
alarm), never print a control character, and never touch anything outside the root."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import string
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stubcache import StubCache, StubSpec
from stubcache.cli import main
from stubcache.storage.store import SUBDIRS

from .test_hostile_root import make_outside, snapshot

SPEC = StubSpec("prop", 'extern "C" int value(void) { return 21; }\n')
EXAMPLES = int(os.environ.get("STUBCACHE_PROPERTY_EXAMPLES", "25"))
STEP_SECONDS = 30


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> tuple[Path, str]:
    """A root holding one real, published entry (built once), to be copied per example."""
    root = tmp_path_factory.mktemp("template") / "cache"
    entry = StubCache(str(root)).get_or_build(SPEC)
    return root, entry.key


class Hung(Exception):
    pass


@contextlib.contextmanager
def bounded(what: str):
    def fire(signum, frame):
        raise Hung(f"{what} ran for over {STEP_SECONDS}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(STEP_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10 ** 30), max_value=10 ** 30)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8)

RAW = [b"", b"{", b"[" * 5000, b"1e400", b'{"time": NaN, "pid": -1}', b'{"pid": 99999999999999999999}',
       b"\xff\xfe", b'{"ev":"hit","key":{"a":1},"s":Infinity}\n{"ev":"archive","processes":1e300}\n']
names = st.one_of(
    st.text(alphabet=string.hexdigits.lower(), min_size=16, max_size=40),
    st.text(alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1,
            max_size=12).filter(lambda n: n not in (".", "..")),
    st.sampled_from(["\x1b[2J", "a\nb", "-1-1", "ab" * 16 + "-999999-x", "ab" * 16 + "-1-4194305"]))
kinds = st.sampled_from(["file", "json", "raw", "dir", "link_file", "link_dir", "link_root", "fifo"])
MANIFEST_FIELDS = ["key", "base_key", "name", "library", "sha256", "size", "created", "build_seconds",
                   "preimage", "headers", "build_method"]


@st.composite
def plantings(draw):
    out = []
    for _ in range(draw(st.integers(1, 8))):
        where = draw(st.sampled_from(["entry", "entry_file", "entry_new", "area", "subdir", "manifest_field"]))
        out.append((where, draw(st.sampled_from(SUBDIRS)), draw(names), draw(kinds), draw(json_values),
                    draw(st.sampled_from(RAW)), draw(st.sampled_from(MANIFEST_FIELDS))))
    return out


def _remove(p: Path) -> None:
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def _make(p: Path, kind: str, value, raw: bytes, outside: Path) -> None:
    if not os.path.realpath(p.parent).startswith(os.path.realpath(outside.parent / "cache") + os.sep):
        return  # an earlier planting made a parent a link out of the root: planting must not follow it
    _remove(p)
    if kind == "file":
        p.write_bytes(os.urandom(64))
    elif kind == "json":
        p.write_text(json.dumps(value))
    elif kind == "raw":
        p.write_bytes(raw)
    elif kind == "dir":
        p.mkdir()
        (p / "inner").write_text("x")
        os.symlink(outside / "victim.txt", p / "link")
    elif kind == "link_file":
        os.symlink(outside / "victim.txt", p)
    elif kind == "link_dir":
        os.symlink(outside / "victim_dir", p)
    elif kind == "link_root":
        os.symlink("/", p)
    elif kind == "fifo":
        os.mkfifo(p)


def plant(root: Path, key: str, outside: Path, items) -> None:
    v1 = root / "v1"
    entry = v1 / "entries" / key
    for where, sub, name, kind, value, raw, fld in items:
        try:
            if where == "entry":
                _make(entry, kind, value, raw, outside)
            elif (where == "entry_file" and entry.is_dir() and not entry.is_symlink()
                  and os.path.realpath(entry).startswith(os.path.realpath(root) + os.sep)):
                entry.chmod(0o755)
                target = next((p for p in entry.iterdir() if p.name.endswith(".so")), entry / name)
                _make(entry / "manifest.json" if kind in ("json", "raw") else target, kind, value, raw, outside)
            elif where == "entry_new":
                _make(v1 / "entries" / name, kind, value, raw, outside)
            elif where == "area" and (v1 / sub).is_dir() and not (v1 / sub).is_symlink():
                # a hex-looking name stands for the entry's own file in that area
                own = {"pins": key, "locks": f"{key}.lock", "leases": f"{key}.json", "failures": f"{key}.json"}
                hexy = all(c in string.hexdigits for c in name)
                _make(v1 / sub / (own.get(sub, name) if hexy else name), kind, value, raw, outside)
            elif where == "subdir":
                _make(v1 / sub, kind, value, raw, outside)
            elif (where == "manifest_field" and (entry / "manifest.json").is_file()
                  and os.path.realpath(entry / "manifest.json").startswith(os.path.realpath(root) + os.sep)):
                try:
                    m = json.loads((entry / "manifest.json").read_text())
                except ValueError:
                    continue
                if not isinstance(m, dict):
                    continue
                m[fld] = value
                entry.chmod(0o755)
                (entry / "manifest.json").chmod(0o644)
                (entry / "manifest.json").write_text(json.dumps(m))
        except (OSError, ValueError):
            pass  # e.g. a name the filesystem refuses: plant the rest


def run(root: Path, *args: str, ok=(0, 1)) -> str:
    out, err = io.StringIO(), io.StringIO()
    with bounded(" ".join(args)), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--cache-dir", str(root), *args])
    text = out.getvalue()
    assert rc in ok, (args, rc, text, err.getvalue())
    bad = [c for c in text if ord(c) < 32 and c != "\n" or c == "\x7f"]
    assert not bad, (args, bad, text)
    return text


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(items=plantings())
def test_random_root_contents_never_raise_hang_or_escape(template, tmp_path_factory, items, monkeypatch):
    monkeypatch.setenv("STUBCACHE_LOCK_TIMEOUT", "2")
    monkeypatch.delenv("STUBCACHE_REQUIRE_HIT", raising=False)
    tpl, key = template
    base = tmp_path_factory.mktemp("prop")
    root = base / "cache"
    shutil.copytree(tpl, root, symlinks=True)
    outside = make_outside(base)
    before = snapshot(outside)
    plant(root, key, outside, items)
    try:
        for args in (["ls"], ["ls", "--format", "csv"], ["stats"], ["verify"], ["prune", "--dry-run"],
                     ["prune", "--yes"]):
            run(root, *args)
        run(root, "prune", "--toolchain-mismatch", "--dry-run")
        run(root, "explain", key, "-v", ok=(0, 2))  # 2: no such entry any more
        with bounded("a load"):
            assert StubCache(str(root)).load(SPEC).value() == 21
        assert snapshot(outside) == before
    finally:
        # The load may have published, starting the size cap's helper thread (0.5 s later): let
        # it finish before the root goes, or the next example's scratch directory races with it.
        for thread in threading.enumerate():
            if thread.name == "stubcache-sizecap":
                thread.join(30)
        shutil.rmtree(base, ignore_errors=True)
