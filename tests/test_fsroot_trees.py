"""fsroot's walks and removals: iterative (a tree deeper than Python's recursion limit), bounded
in depth and count (what they leave is said), never following a link, on every Python we support
(``shutil.rmtree(dir_fd=)`` is 3.11+, so the removal is our own)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from stubcache.edge import fsroot


def plant_deep(parent: Path, name: str, depth: int, *, link_to: Path | None = None) -> None:
    """``parent/name/d/d/...`` ``depth`` levels deep, a file on each level (through descriptors:
    the whole path is longer than PATH_MAX)."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    os.mkdir(name, dir_fd=fd)
    for i in range(depth):
        nfd = os.open(name if i == 0 else "d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
        if i < depth - 1:
            os.mkdir("d", dir_fd=fd)
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("x")
    if link_to is not None:
        os.symlink(link_to, "link", dir_fd=fd)
    os.close(fd)


@pytest.fixture
def outside(tmp_path):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "victim.txt").write_text("keep")
    yield out
    assert (out / "victim.txt").read_text() == "keep"


@pytest.fixture
def area(tmp_path):
    a = tmp_path / "area"
    a.mkdir()
    yield a
    subprocess.run(["rm", "-rf", str(a)], check=True)  # GNU rm handles any depth


def test_a_tree_within_the_bounds_goes_whole_and_links_are_not_followed(area, outside):
    plant_deep(area, "t", 100, link_to=outside)
    (area / "t" / "d" / "ro").mkdir()
    (area / "t" / "d" / "ro").chmod(0o500)  # a read-only directory of ours: given u+w, then removed
    os.mkfifo(area / "t" / "fifo")
    os.symlink(outside / "victim.txt", area / "t" / "d" / "filelink")
    with fsroot.Dir(str(area)) as fd:
        assert fsroot.tree_size_at(fd, "t") == 100
        r = fsroot.remove_tree_at(fd, "t")
    assert r.gone and r.refused == "" and r.removed == 100 + 100 + 4  # files, directories; link, ro, fifo, filelink
    assert os.listdir(area) == []


def test_a_tree_3000_levels_deep_is_removed_to_the_bound_and_the_rest_reported(area, outside):
    plant_deep(area, "deep", 3000, link_to=outside)
    with fsroot.Dir(str(area)) as fd:
        assert fsroot.tree_size_at(fd, "deep") == fsroot.MAX_DEPTH  # one byte per level looked at
        r = fsroot.remove_tree_at(fd, "deep")
        assert not r.gone and "deeper than 128 levels" in r.refused
        assert not fsroot.rmtree_at(fd, "deep")  # the bool form says the same
    assert os.listdir(area) == ["deep"]
    # Everything down to the bound went except the chain of directories that leads on.
    fd = os.open(area / "deep", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(fsroot.MAX_DEPTH):
            assert os.listdir(fd) == ["d"]
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        assert sorted(os.listdir(fd)) == ["d", "f"]  # the level past the bound, untouched
    finally:
        os.close(fd)


def test_the_count_bound_stops_a_wide_tree_and_says_so(area):
    t = area / "wide"
    t.mkdir()
    for i in range(50):
        (t / f"f{i}").write_text("x")
    with fsroot.Dir(str(area)) as fd:
        assert fsroot.tree_size_at(fd, "wide", limit=10) == 10
        r = fsroot.remove_tree_at(fd, "wide", max_entries=10)
        assert not r.gone and "stopped after 10 names" in r.refused and r.removed == 10
        assert len(os.listdir(t)) == 40
        assert fsroot.remove_tree_at(fd, "wide").gone


def test_files_links_and_missing_names(area, outside):
    os.symlink(outside, area / "dirlink")
    (area / "file").write_text("x")
    with fsroot.Dir(str(area)) as fd:
        assert fsroot.remove_tree_at(fd, "dirlink").gone
        assert fsroot.remove_tree_at(fd, "file").gone
        assert fsroot.remove_tree_at(fd, "missing").gone
        with pytest.raises(ValueError):
            fsroot.remove_tree_at(fd, "../x")
    assert os.listdir(area) == []
    assert fsroot.rmtree(str(area / "nothing"))
