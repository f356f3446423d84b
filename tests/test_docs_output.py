"""Every output block the docs mark with ``<!-- output: NAME -->`` is what the program prints
now (issue 20 item 10): each scenario in tests/docs_output.py runs in a scratch root with real
builds and real processes, and its transcript must match the block up to what has to vary
(times, ages, sizes within a factor of two, paths, keys, pids, versions).

After an intended output change, regenerate the blocks that no longer match from real output
(blocks that still match are left alone) and review the diff:

    STUBCACHE_WRITE_DOCS=1 python -m pytest -q tests/test_docs_output.py
"""

from __future__ import annotations

import difflib
import os

import pytest

from . import redis_server
from .docs_output import (
    SCENARIOS,
    marked_blocks,
    normalize,
    rewrite,
    run_scenario,
    sizes_agree,
)

BLOCKS = marked_blocks()


def test_every_marked_block_names_a_scenario_and_every_scenario_is_shown():
    names = [name for _, name, _, _ in BLOCKS]
    assert sorted(set(names)) == sorted(names), "a scenario is shown twice"
    assert set(names) == set(SCENARIOS), (set(names) ^ set(SCENARIOS))


@pytest.mark.parametrize("path,name,indent,shown", BLOCKS, ids=[f"{p.name}:{n}" for p, n, _, _ in BLOCKS])
def test_doc_block_is_what_the_program_prints(path, name, indent, shown):
    if name.startswith("remote-") and not redis_server.available() and not os.environ.get("STUBCACHE_TEST_REQUIRE_REDIS"):
        pytest.skip("needs redis-server and the redis client")
    got = run_scenario(name)
    want_text, want_sizes = normalize(shown)
    got_text, got_sizes = normalize(got)
    matches = want_text == got_text and sizes_agree(want_sizes, got_sizes)
    if os.environ.get("STUBCACHE_WRITE_DOCS") == "1" and not matches:  # a block that matches stays as it is
        rewrite(path, name, got)
        pytest.skip(f"{path.name}: block {name} rewritten")
    diff = "\n".join(difflib.unified_diff(want_text.split("\n"), got_text.split("\n"), "doc", "now", lineterm=""))
    assert want_text == got_text, (f"{path.name} block {name!r} no longer matches the program's output; "
                                   f"regenerate with STUBCACHE_WRITE_DOCS=1 (see this file's docstring):\n{diff}")
    assert sizes_agree(want_sizes, got_sizes), (name, want_sizes, got_sizes)
