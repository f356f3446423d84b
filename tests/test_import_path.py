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
