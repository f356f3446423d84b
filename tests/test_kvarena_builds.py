"""One stub compile per host: 4 processes x 3 arenas each, through a compile-counting CXX."""

from __future__ import annotations

import json

from tests.conftest import spawn_py

_CHILD = """
import json, os, sys, time
go = os.environ["KVA_GO"]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
import kvarena
arenas = [kvarena.KvArena(1 << 20) for _ in range(3)]
out = []
for a in arenas:
    a.commit(4096)
    p = a._res.slot.alloc(100)
    out.append({"slot": a.slot, "base": a.base, "ptr": p, "cursor": a.cursor, "path": a.stub_path})
t = arenas[0].stub_timing
print(json.dumps({"pid": os.getpid(), "arenas": out, "built": t.built, "seconds": t.seconds}))
for a in arenas:
    a.close()
"""


def _run_round(tmp_path, name: str, n: int = 4) -> list[dict]:
    go = tmp_path / f"go-{name}"
    procs = [spawn_py(_CHILD, env={"KVA_GO": str(go)}) for _ in range(n)]
    for p in procs:  # every child at the gate before it opens: they start the arenas together
        assert p.stdout.readline().strip() == "ready", p.communicate()
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _check(results: list[dict]) -> None:
    paths = {a["path"] for r in results for a in r["arenas"]}
    assert len(paths) == 1  # every arena of every process uses the one cached library
    for r in results:
        slots = [a["slot"] for a in r["arenas"]]
        assert len(set(slots)) == 3
        for a in r["arenas"]:
            assert a["ptr"] == a["base"] and a["cursor"] == 100  # independent state per arena


def test_four_processes_three_arenas_one_compile(cxx, cache_root, tmp_path):
    cold = _run_round(tmp_path, "cold")
    _check(cold)
    assert cxx.compiles() == 1, cxx.log.read_text()
    assert any(r["built"] for r in cold)  # built here or awaited: the CXX log is the count

    cxx.reset()
    warm = _run_round(tmp_path, "warm")
    _check(warm)
    assert cxx.compiles() == 0
    assert not any(r["built"] for r in warm)
