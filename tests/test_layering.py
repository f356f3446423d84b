"""The layering of docs/design.md, enforced: which modules may import which, read from the
source with ``ast`` (imports inside functions included), and what ``import stubcache`` and a hit
load in a fresh process."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import stubcache

from .conftest import REPO, run_py

# The admin side: commands and the scans and plans behind them. A process that only loads stubs
# never needs them (docs/design.md, "Layers").
ADMIN = ("stubcache.__main__", "stubcache.cli", "stubcache.audit", "stubcache.doctor", "stubcache.explain",
         "stubcache.entryfilter", "stubcache.manifestscan", "stubcache.prune", "stubcache.scan", "stubcache.stats",
         "stubcache.prometheus", "stubcache.verify", "stubcache.shared", "stubcache.sizecap", "stubcache.specref",
         "stubcache.run", "stubcache.remote.admin")
# The one way from the load path into the admin side: after a publish, with STUBCACHE_MAX_SIZE
# set, the cache starts the size cap (which plans with prune's code).
LOAD_TO_ADMIN = {("stubcache.cache", "stubcache.sizecap")}


def is_admin(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in ADMIN)


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ``known`` that ``name`` imports, anywhere in its source (not under
    ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in out if m in known and m != name}


def graph(package: str) -> dict[str, set[str]]:
    mods = modules(package)
    known = set(mods) | set(modules("kvarena" if package == "stubcache" else "stubcache"))
    return {name: imports(name, path, known) for name, path in mods.items()}


def test_the_load_path_never_imports_the_admin_side():
    g = graph("stubcache")
    assert any(is_admin(m) for m in g) and "stubcache.cache" in g  # the lists above still name real modules
    for a in ADMIN:
        assert any(m == a or m.startswith(a + ".") for m in g), f"{a} is gone: update ADMIN and docs/design.md"
    bad = sorted((m, dep) for m, deps in g.items() if not is_admin(m)
                 for dep in deps if is_admin(dep) and (m, dep) not in LOAD_TO_ADMIN)
    assert bad == [], "load-path modules importing admin modules (see docs/design.md):\n" + "\n".join(
        f"  {m} -> {dep}" for m, dep in bad)


def test_stubcache_never_imports_kvarena_and_kvarena_uses_only_the_public_api():
    assert not any(d.startswith("kvarena") for deps in graph("stubcache").values() for d in deps)
    for name, path in modules("kvarena").items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("stubcache.") for a in node.names), name
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("stubcache"):
                assert node.module == "stubcache", f"{name} imports {node.module}"
                assert {a.name for a in node.names} <= set(stubcache.__all__), name


PROBE = """
import json, sys
import stubcache
before = sorted(sys.modules)
cache = stubcache.StubCache()
entry = cache.get_or_build(stubcache.StubSpec("layer", 'extern "C" int f(void) { return 1; }'))
cache.load_entry(entry)
print(json.dumps([before, sorted(sys.modules), entry.key]))
"""


def test_import_stubcache_and_a_hit_load_neither_torch_nor_the_admin_side(cache_root, cxx):
    run_py('import stubcache; stubcache.StubCache().load(stubcache.StubSpec("layer", '
           '\'extern "C" int f(void) { return 1; }\'))')  # build it: the probe below hits
    after_import, after_hit, key = json.loads(run_py(PROBE).stdout)
    assert cxx.compiles() == 1 and key in {p.name for p in (cache_root / "v1" / "entries").iterdir()}  # a hit
    for loaded in (after_import, after_hit):
        assert not [m for m in loaded if m == "torch" or m.startswith("torch.")]
        assert not [m for m in loaded if is_admin(m)]
        assert not [m for m in loaded if m.startswith("stubcache.remote")]


def test_docs_design_names_real_tests_and_every_cited_invariant():
    import re

    design = (REPO / "docs" / "design.md").read_text()
    numbered = {int(n) for n in re.findall(r"^(\d+)\. \*\*", design.split("## Invariants", 1)[1], re.M)}
    assert numbered == set(range(1, len(numbered) + 1)) and len(numbered) >= 11
    sources = [p for d in ("stubcache", "kvarena", "tests") for p in (REPO / d).rglob("*.py")]
    cited = {(p.name, int(n)) for p in sources for n in re.findall(r"invariant (\d+)", p.read_text(), re.I)}
    assert {n for _, n in cited} <= numbered, sorted(cited)
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    names = set(re.findall(r"`(test_\w+?)(?:\.py)?`", design))
    missing = [n for n in sorted(names) if not (REPO / "tests" / f"{n}.py").exists()
               and not re.search(rf"def {n}\(", tests)]
    assert missing == [], f"docs/design.md names tests that do not exist: {missing}"
