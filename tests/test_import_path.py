"""Ways a different torch becomes what ``importlib.util.find_spec("torch")`` finds while a hit
record (and the fingerprint memo) would still answer, each closed by the import path's rows
(stubcache.key.toolchain.import_path_checks; found by an independent review of the shadow rows).

Each test builds once (leaving the memo and the record), checks the record answers, then changes
the file system so that another torch would be found, and runs the same request again: it must
not be answered by the compact path. Each child also prints where find_spec("torch") points, so
a failure shows the stale hit plainly; the planted torch is never imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


from .conftest import REPO

SRC = 'extern "C" int value(void) { return %d; }'

# The request (StubCache.load of one spec), then where torch would come from (find_spec only:
# the planted torch is never imported).
CHILD = r"""
import sys, importlib.util
%s
import stubcache
lib = stubcache.StubCache().load(stubcache.StubSpec("ipstub", %r))
spec = importlib.util.find_spec("torch")
print(lib.value(), "stubcache.cache.core" not in sys.modules, spec.origin if spec else None)
"""

FAKE_TORCH = "raise SystemExit('the planted torch was imported')\n"
FAKE_VERSION = "__version__ = '0.0.1+planted'\n"


def plant_torch(where):
    where.mkdir(exist_ok=True)
    (where / "__init__.py").write_text(FAKE_TORCH)
    (where / "version.py").write_text(FAKE_VERSION)


def run_child(args, cwd, prelude="", pythonpath=""):
    """Run the child (``args``: how python is told the code) in ``cwd``; (value, compact, torch origin)."""
    path = os.pathsep.join(p for p in (pythonpath, str(REPO)) if p)
    code = CHILD % (prelude, SRC % 1)
    env = dict(os.environ, PYTHONPATH=path)
    if args == "-c":
        cmd = [sys.executable, "-c", code]
    else:  # a script file: args is its path
        args.write_text(code)
        cmd = [sys.executable, str(args)]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    if out.returncode != 0:
        return None, False, out.stderr[-500:]
    value, compact, origin = out.stdout.split()
    return int(value), compact == "True", origin


def assert_not_stale(result, planted):
    value, compact, origin = result
    # The planted torch is what find_spec finds now ...
    assert origin is not None and str(planted) in origin, result
    # ... so the record (made for the installed torch) must not answer.
    assert not compact, f"stale hit: the record answered while find_spec('torch') -> {origin}"


def test_python_c_in_another_directory_holding_torch(cache_root, cxx, tmp_path):
    """sys.path[0] is '' for `python -c` (and Jupyter/IPython kernels): the record's digest holds
    '' as given, its shadow row the *recording* process's cwd. Run the same request from a
    directory that holds a torch package (a PyTorch source checkout, say): find_spec finds it,
    but the row checked is the old directory."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    plant_torch(b / "torch")
    first = run_child("-c", a)
    assert first[:2] == (1, False), first
    assert run_child("-c", a)[:2] == (1, True)
    assert_not_stale(run_child("-c", b), b / "torch")


def test_a_namespace_torch_directory_becoming_a_package(cache_root, cxx, tmp_path):
    """The engine's directory holds a ``torch/`` directory without ``__init__.py`` (a namespace
    portion: the installed regular package wins). Adding ``torch/__init__.py`` makes it the
    torch found, and changes only ``torch/``'s mtime, not the script directory's."""
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "torch").mkdir()
    (eng / "torch" / "notes.txt").write_text("scripts about torch\n")
    script = eng / "engine.py"
    first = run_child(script, tmp_path)
    assert first[:2] == (1, False), first
    assert run_child(script, tmp_path)[:2] == (1, True)
    (eng / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (eng / "torch" / "version.py").write_text(FAKE_VERSION)
    assert_not_stale(run_child(script, tmp_path), eng / "torch")


ADDSITEDIR = """
import os, site
site.addsitedir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins"))
"""

HOOK = '''
import importlib.machinery, os, sys
_PLANTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "planted")

class _Redirect:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch":
            return importlib.machinery.PathFinder.find_spec(name, [_PLANTED])
        return None

sys.meta_path.insert(0, _Redirect)
'''


def test_a_pth_file_in_a_directory_the_engine_adds_with_addsitedir(cache_root, cxx, tmp_path):
    """An engine (or a .pth, or sitecustomize) calls ``site.addsitedir(plugins)``: .pth files in
    ``plugins`` are processed at every start. With none there when the record was made, plugins
    was a plain directory (a shadow row). A .pth that appears later with an ``import`` line can
    install an import hook that redirects torch, without changing sys.path (the digest) or
    planting any of the shadow names (the directory comes after torch's on sys.path)."""
    eng = tmp_path / "engine"
    plugins = eng / "plugins"
    plugins.mkdir(parents=True)
    script = eng / "engine.py"
    first = run_child(script, tmp_path, prelude=ADDSITEDIR)
    assert first[:2] == (1, False), first
    assert run_child(script, tmp_path, prelude=ADDSITEDIR)[:2] == (1, True)
    (plugins / "planted").mkdir()
    plant_torch(plugins / "planted" / "torch")
    (plugins / "redirect_hook.py").write_text(HOOK)
    (plugins / "zz-redirect.pth").write_text("import redirect_hook\n")
    assert_not_stale(run_child(script, tmp_path, prelude=ADDSITEDIR), plugins / "planted" / "torch")


def test_a_symlinked_import_path_entry_repointed(cache_root, cxx, tmp_path):
    """A PYTHONPATH entry that is a link to a directory, re-pointed to one that holds a torch."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    plant_torch(b / "torch")
    link = tmp_path / "link"
    link.symlink_to(a)
    eng = tmp_path / "engine"
    eng.mkdir()
    script = eng / "engine.py"
    first = run_child(script, tmp_path, pythonpath=str(link))
    assert first[:2] == (1, False), first
    assert run_child(script, tmp_path, pythonpath=str(link))[:2] == (1, True)
    tmp = tmp_path / "link.new"
    tmp.symlink_to(b)
    os.replace(tmp, link)
    assert_not_stale(run_child(script, tmp_path, pythonpath=str(link)), link / "torch")


ADDSITEDIR_PYTHONPATH = """
import os, site
for _d in os.environ["PYTHONPATH"].split(os.pathsep):
    site.addsitedir(_d)  # the known recipe for .pth files in PYTHONPATH directories (already on sys.path: not appended)
"""


def test_a_pth_file_in_a_pythonpath_directory_processed_with_addsitedir(cache_root, cxx, tmp_path):
    """The regression form: the directory is *before* torch's on sys.path (PYTHONPATH), and the
    engine (or a sitecustomize, the usual recipe) runs site.addsitedir on it, so .pth files there
    are processed at start. Recorded with no .pth there, it is a plain shadow row; a .pth with an
    import line appearing later redirects torch (with mtime validators this missed; the first
    shadow rows let it hit)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    eng = tmp_path / "engine"
    eng.mkdir()
    script = eng / "engine.py"
    pp = str(plugins)
    first = run_child(script, tmp_path, prelude=ADDSITEDIR_PYTHONPATH, pythonpath=pp)
    assert first[:2] == (1, False), first
    assert run_child(script, tmp_path, prelude=ADDSITEDIR_PYTHONPATH, pythonpath=pp)[:2] == (1, True)
    (plugins / "planted").mkdir()
    plant_torch(plugins / "planted" / "torch")
    (plugins / "redirect_hook.py").write_text(HOOK)
    (plugins / "zz-redirect.pth").write_text("import redirect_hook\n")
    assert_not_stale(run_child(script, tmp_path, prelude=ADDSITEDIR_PYTHONPATH, pythonpath=pp),
                     plugins / "planted" / "torch")


APPEND_OWN_DIR = """
import os
import subprocess
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # a common idiom in engine scripts
"""


def test_script_directory_also_appended_after_torch(cache_root, cxx, tmp_path):
    """sys.path = [eng, ..., site-packages, eng]: the directory's row keeps what both occurrences
    watch (torch's names from the first), not only the start-up names of the second."""
    eng = tmp_path / "engine"
    eng.mkdir()
    script = eng / "engine.py"
    first = run_child(script, tmp_path, prelude=APPEND_OWN_DIR)
    assert first[:2] == (1, False), first
    assert run_child(script, tmp_path, prelude=APPEND_OWN_DIR)[:2] == (1, True)
    plant_torch(eng / "torch")
    assert_not_stale(run_child(script, tmp_path, prelude=APPEND_OWN_DIR), eng / "torch")


APPEND_DOT = """
sys.path.append('.')  # '' (python -c, notebooks) and '.' are both recorded as '.'
"""


def test_python_c_with_dot_appended(cache_root, cxx, tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    first = run_child("-c", a, prelude=APPEND_DOT)
    assert first[:2] == (1, False), first
    assert run_child("-c", a, prelude=APPEND_DOT)[:2] == (1, True)
    plant_torch(a / "torch")
    assert_not_stale(run_child("-c", a, prelude=APPEND_DOT), a / "torch")


ADDSITEDIR = """
import os, site
site.addsitedir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins"))
"""


def test_an_existing_pth_rewritten_in_place(cache_root, cxx, tmp_path):
    """A directory site processes holds a .pth already; the .pth is rewritten in place with an
    import line (no directory mtime change): the .pth's own signature notices."""
    eng = tmp_path / "engine"
    plugins = eng / "plugins"
    plugins.mkdir(parents=True)
    pth = plugins / "a.pth"
    pth.write_text("# nothing yet\n")
    script = eng / "engine.py"
    first = run_child(script, tmp_path, prelude=ADDSITEDIR)
    assert first[:2] == (1, False), first
    assert run_child(script, tmp_path, prelude=ADDSITEDIR)[:2] == (1, True)
    elsewhere = tmp_path / "elsewhere"  # on no import path row at all
    elsewhere.mkdir()
    plant_torch(elsewhere / "torch")
    before = os.stat(plugins).st_mtime_ns
    hook = ("import sys, importlib.machinery; sys.meta_path.insert(0, type('R', (), {'find_spec': staticmethod("
            "lambda n, p=None, t=None: __import__('importlib.machinery').machinery.PathFinder.find_spec(n, [%r]) "
            "if n == 'torch' else None)}))\n"
            % str(elsewhere))
    with open(pth, "r+") as fh:  # in place: same inode, the directory untouched
        fh.truncate(0)
        fh.write(hook)
    assert os.stat(plugins).st_mtime_ns == before
    assert_not_stale(run_child(script, tmp_path, prelude=ADDSITEDIR), elsewhere / "torch")


WRITE_LOG = """
import os, time
_d = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(_d, "run-%d.log" % time.time_ns()), "w").close()  # a new log per run
"""



@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_checkpoint_named_pth_in_the_engine_directory_keeps_the_compact_path(cache_root, cxx, tmp_path, checkpoint):
    """The opposite direction: `model.pth` is PyTorch's usual checkpoint name. With one in the
    script directory an engine that writes a new log there still takes the compact path (the
    .pth that was there is allowed, and checked by its own signature)."""
    eng = tmp_path / "engine"
    eng.mkdir()
    if checkpoint:
        (eng / "model.pth").write_bytes(b"PK\x03\x04" + b"\0" * 60)  # torch.save's zip format
    script = eng / "engine.py"
    first = run_child(script, tmp_path, prelude=WRITE_LOG)
    assert first[:2] == (1, False), first
    results = [run_child(script, tmp_path, prelude=WRITE_LOG)[:2] for _ in range(2)]
    assert results == [(1, True), (1, True)], results


def test_python_c_recorded_where_torch_is_found_in_cwd_answers_elsewhere(cache_root, cxx, tmp_path):
    """The reverse of test_python_c_in_another_directory_holding_torch: recorded in a directory
    whose own torch/ is the one found ('' -> '.' is torch's entry, so every later entry is
    watched for start-up names only); run from a directory without one, the installed torch is
    found, yet the record (keyed for the cwd's torch) answers."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    plant_torch(b / "torch")  # never imported: the child only asks find_spec
    first = run_child("-c", b)
    assert first[:2] == (1, False) and str(b / "torch") in first[2], first
    assert run_child("-c", b)[:2] == (1, True)
    value, compact, origin = run_child("-c", a)
    assert str(b) not in origin  # the installed torch is found from a
    assert not compact, f"stale hit: record made for {b / 'torch'} answered while find_spec('torch') -> {origin}"


CHDIR_CHILD = r"""
import os, sys
import torch  # a stand-in: from the launch directory if one is there, else from PYTHONPATH
os.chdir(sys.argv[1])  # a fresh per-run output directory (hydra, a notebook's %cd)
import stubcache
lib = stubcache.StubCache().load(stubcache.StubSpec("chdirstub", 'extern "C" int value(void) { return 7; }'))
print(lib.value(), "stubcache.cache.core" not in sys.modules, torch.__version__)
"""


def _stand_in_torch(where, version):
    where.mkdir(parents=True)
    (where / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (where / "version.py").write_text(f"__version__ = {version!r}\n")


def test_torch_imported_then_a_chdir_is_the_torch_the_record_holds_for(cache_root, cxx, tmp_path):
    """A program imports torch from '' (its launch directory) and then changes directory: the
    '.' row is checked in the new directory, so the record must also hold for the torch this
    process has imported (its directory is in the record)."""
    site, launch = tmp_path / "site", tmp_path / "launch"
    launch.mkdir()
    _stand_in_torch(site / "torch", "1.0.0")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))

    def run(i):
        out = tmp_path / f"out{i}"
        out.mkdir()
        proc = subprocess.run([sys.executable, "-c", CHDIR_CHILD, str(out)], cwd=launch, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        value, compact, version = proc.stdout.split()
        return int(value), compact == "True", version

    assert run(1) == (7, False, "1.0.0")
    assert run(2) == (7, True, "1.0.0")
    _stand_in_torch(launch / "torch", "9.9.9+other")
    assert run(3) == (7, False, "9.9.9+other")


ZIP_CHILD = r"""
import sys, importlib.util, stubcache
lib = stubcache.StubCache().load(stubcache.StubSpec("zipstub", 'extern "C" int value(void) { return 5; }'))
spec = importlib.util.find_spec("torch")
print(lib.value(), "stubcache.cache.core" not in sys.modules, spec.origin if spec else None)
"""


def test_an_entry_inside_a_zip_archive_is_watched_through_the_archive(cache_root, cxx, tmp_path):
    """A sys.path entry inside a zip archive (deps.zip/lib: zipimport searches that folder)
    cannot be stat'ed before or after the archive changes; the archive's own signature is
    what notices a torch added to it."""
    import zipfile

    archive = tmp_path / "deps.zip"

    def write_archive(with_torch):
        new = tmp_path / "deps.zip.new"
        with zipfile.ZipFile(new, "w") as zf:
            zf.writestr("lib/helper.py", "x = 1\n")
            if with_torch:
                zf.writestr("lib/torch/__init__.py", FAKE_TORCH)
                zf.writestr("lib/torch/version.py", FAKE_VERSION)
        os.replace(new, archive)

    write_archive(False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(archive / "lib"), str(REPO)]))

    def run():
        proc = subprocess.run([sys.executable, "-c", ZIP_CHILD], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        value, compact, origin = proc.stdout.split()
        return int(value), compact == "True", origin

    assert run()[:2] == (5, False)
    assert run()[:2] == (5, True)
    write_archive(True)
    value, compact, origin = run()
    assert "deps.zip" in origin and not compact, (value, compact, origin)


def test_an_import_path_entry_that_is_not_a_str_is_skipped(cache_root, cxx, tmp_path):
    """An int or a pathlib.Path on sys.path (and bytes, where the import system itself takes
    them: 3.11 and later): skipped by the import system, and so by the key (they used to make
    StubCache().load raise TypeError)."""
    code = ("import sys, pathlib, stubcache\nsys.path += [3, pathlib.Path('/tmp')]\n"
            "sys.path += [b'/tmp'] if sys.version_info >= (3, 11) else []\n"
            "lib = stubcache.StubCache().load(stubcache.StubSpec('oddpath', 'extern \"C\" int value(void) { return 4; }'))\n"
            "print(lib.value())")
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert proc.returncode == 0 and proc.stdout.split() == ["4"], proc.stderr
