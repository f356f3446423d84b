"""``verify --rebuild`` compiles specs read from manifests, and compiler flags can run code
(``-wrapper``, ``-fplugin``, ``-B``, ``-specs``): it rebuilds only entries the loader would load
as this user, and reports the others as skipped. Run as root against an entry a member planted."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from stubcache.admin.shared import init_root

from .conftest import run_py
from .test_hostile_root import GROUP, LOAD, cli, plant_as, run_as, src, users  # noqa: F401  (fixture)

EVIL = "ef" * 16


@pytest.fixture
def planted(users):  # noqa: F811
    """A shared root made by root with alice's entry, and beside it an entry mallory planted: her
    copy of alice's manifest whose spec runs ``touch MARK`` through ``-wrapper`` when compiled."""
    base = Path(tempfile.mkdtemp(prefix="sc-audit-"))
    base.chmod(0o755)
    root = base / "cache"
    init_root(str(root), GROUP)
    proc = run_as(users["alice"], LOAD, {"STUBCACHE_DIR": str(root), "SRC": src(3)})
    assert proc.returncode == 0, proc.stderr
    marks = base / "marks"
    marks.mkdir()
    marks.chmod(0o777)
    mark = marks / "ran"
    # the attacker matches the administrator's toolchain (a rebuild skips other toolchains)
    fp = run_py(f"""
        import json, stubcache
        print(json.dumps(stubcache.StubCache({str(root)!r}, seeds=[])._fingerprint(stubcache.StubSpec("x", "")), sort_keys=True))
        """).stdout.strip()
    plant_as(users["mallory"], root, f"""
        import json, shutil
        from stubcache import StubSpec
        entries = os.path.join(V1, "entries")
        [alice] = [k for k in os.listdir(entries) if k != {EVIL!r}]
        m = json.load(open(os.path.join(entries, alice, "manifest.json")))
        spec = StubSpec("evil", 'extern "C" int value(void) {{ return 9; }}\\n',
                        extra_cflags=["-wrapper", "/bin/sh,-c,touch {mark}; exit 1"])
        m["preimage"]["spec"] = spec.canonical()
        m["preimage"]["fingerprint"] = json.loads({fp!r})
        m.update(key={EVIL!r}, base_key={EVIL!r}, name="evil")
        e = os.path.join(entries, {EVIL!r})
        os.mkdir(e)
        shutil.copy(os.path.join(entries, alice, m["library"]), os.path.join(e, m["library"]))
        with open(os.path.join(e, "manifest.json"), "w") as f:
            json.dump(m, f)
        """)
    yield root, mark, fp
    shutil.rmtree(base, ignore_errors=True)


def _results(root, env=None) -> dict:
    proc = cli(root, "verify", "--rebuild", "--format", "json", env=env)
    assert "Traceback" not in proc.stderr and proc.returncode in (0, 1), proc.stderr
    return {r["key"]: r for r in json.loads(proc.stdout)["results"]}


def test_root_rebuilds_no_entry_of_a_shared_root_it_does_not_trust(planted):
    root, mark, _ = planted
    res = _results(root, env={"STUBCACHE_TRUSTED_ROOTS": ""})
    assert not mark.exists(), "root ran a command a member put in a manifest's compiler flags"
    assert res[EVIL]["status"] == "skipped" and "trust" in res[EVIL]["detail"]
    assert {r["status"] for r in res.values()} == {"skipped"}  # alice's too: root does not load it


def test_an_explicitly_trusted_root_still_refuses_entries_of_untrusted_owners(planted, users):  # noqa: F811
    root, mark, fp = planted
    [alice] = [k for k in os.listdir(root / "v1" / "entries") if k != EVIL]
    m = root / "v1" / "entries" / alice / "manifest.json"  # as if alice had root's toolchain
    m.write_text(json.dumps(dict(json.loads(m.read_text()), preimage=dict(
        json.loads(m.read_text())["preimage"], fingerprint=json.loads(fp)))))
    # the planted entry now belongs to the outsider (not in the group): the loader refuses it
    e = root / "v1" / "entries" / EVIL
    for p in [e, *e.iterdir()]:
        os.chown(p, users["outsider"].pw_uid, -1)
    res = _results(root, env={"STUBCACHE_TRUSTED_ROOTS": str(root)})
    assert not mark.exists()
    assert res[EVIL]["status"] == "skipped" and "uid" in res[EVIL]["detail"], res[EVIL]
    assert res[alice]["status"] == "same", res[alice]  # listed: members' entries are rebuilt
