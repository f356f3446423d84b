"""The layering of docs/design.md, enforced: its layer table read from the doc, every import in
``stubcache/`` read from the source with ``ast`` (imports inside functions included), and what
``import stubcache`` and a hit load in a fresh process."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import stubcache

from .conftest import REPO, run_py

DESIGN = REPO / "docs" / "design.md"


def _layers_section() -> str:
    return DESIGN.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]


def layers() -> list[tuple[str, list[str]]]:
    """The layer table of docs/design.md, top layer first: ``(layer, module patterns)``; a
    pattern ending in ``/`` is a package and everything in it."""
    rows = []
    for line in _layers_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("layer", "---"):
            rows.append((cells[0], re.findall(r"`([\w/]+)`", cells[1])))
    return rows


def _name(pattern: str) -> str:
    name = "stubcache." + pattern.rstrip("/").replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def exceptions() -> set[tuple[str, str]]:
    """The allowed upward imports listed under the table (``- `a` → `b`: why``)."""
    pairs = re.findall(r"`([\w/]+)` → `([\w/]+)`", _layers_section())
    return {(_name(a), _name(b)) for a, b in pairs}


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    """The index of the layer holding ``module`` (0: the top one), or ``None``."""
    for i, (_, patterns) in enumerate(table):
        for p in patterns:
            name = _name(p)
            if module == name or (p.endswith("/") and module.startswith(name + ".")):
                return i
    return None


def is_admin(module: str) -> bool:
    table = layers()
    return layer_of(module, table) == [name for name, _ in table].index("admin")


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
            subs = {f"{mod}.{a.name}" for a in node.names} & known
            out.update(subs or {mod})  # `from . import x` imports the module x, not the package
    return {m for m in out if m in known and m != name}


def graph(package: str) -> dict[str, set[str]]:
    mods = modules(package)
    known = set(mods) | set(modules("kvarena" if package == "stubcache" else "stubcache"))
    return {name: imports(name, path, known) for name, path in mods.items()}


def test_each_layer_is_a_folder():
    """A file's path says its layer: every row but the public surface (the package's own
    ``__init__``) and ``__main__`` names folders only, and every folder of ``stubcache/`` is a row."""
    table = layers()
    for name, patterns in table:
        loose = [p for p in patterns if not p.endswith("/") and p not in ("__init__", "__main__")]
        assert loose == [], f"layer {name!r} of docs/design.md names modules outside a folder: {loose}"
    folders = {p.name + "/" for p in (REPO / "stubcache").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {p for _, patterns in table for p in patterns if p.endswith("/")}
    assert {p.stem for p in (REPO / "stubcache").glob("*.py")} == {"__init__", "__main__"}


def test_imports_follow_the_layers_of_docs_design():
    table, allowed = layers(), exceptions()
    assert [name for name, _ in table][:1] == ["admin"] and len(table) >= 8 and len(allowed) == 5
    g = graph("stubcache")
    unplaced = sorted(m for m in g if layer_of(m, table) is None)
    assert unplaced == [], f"modules in no layer of docs/design.md (add them to its table): {unplaced}"
    for _, patterns in table:
        for p in patterns:
            assert any(layer_of(m, [("", [p])]) == 0 for m in g), f"docs/design.md names `{p}`, which is gone"
    upward = sorted((m, dep) for m, deps in g.items() for dep in deps
                    if layer_of(dep, table) < layer_of(m, table) and (m, dep) not in allowed)
    assert upward == [], "imports against the layers of docs/design.md:\n" + "\n".join(
        f"  {m} ({table[layer_of(m, table)][0]}) -> {d} ({table[layer_of(d, table)][0]})" for m, d in upward)
    for m, dep in allowed:  # the listed exceptions are still real
        assert dep in g.get(m, ()), f"docs/design.md lists {m} -> {dep}, which is gone"


def test_the_load_path_never_imports_the_admin_side():
    g, allowed = graph("stubcache"), exceptions()
    into_admin = sorted((m, d) for m, deps in g.items() if not is_admin(m) for d in deps if is_admin(d))
    assert into_admin == [("stubcache.cache.core", "stubcache.admin.sizecap")] and into_admin[0] in allowed, into_admin


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


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, deps = work[-1]
            w = next((d for d in deps if d in g), None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    """No two modules depend on each other, directly or through others (imports inside functions
    count, as in the layer check)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker
    assert _cycles(graph("stubcache")) == []


def test_private_names_stay_in_their_module():
    """A name another module uses is public in its module: no ``from .x import _y`` between
    stubcache's modules, no module ``__getattr__`` forwarding names to another module (the
    package's own lazy table of public names aside), no ``lazy_module``-style proxies."""
    found = []
    for name, path in modules("stubcache").items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("stubcache")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{name}:{node.lineno} imports {private}")
            elif isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and node.col_offset == 0 \
                    and name != "stubcache":
                found.append(f"{name}:{node.lineno} has a module __getattr__")
    assert found == []
