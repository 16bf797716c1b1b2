"""The package's shape, checked with `ast` (no imports run): no import cycle between otel_train's
modules, no reach into another module's private names, no oversized function, class or module, no
dispatch on `kind` strings, instruments made from the catalogue only by `MetricSpec.create`, and no
integration (otel_train/integrations/) beyond the public API: names in `otel_train.__all__`, the
adapter API (the names in `otel_train.adapters.__all__`: steps begun and ended by hooks, phases a
framework timed, the batch for the data check; issue #45), the settings (`otel_train.config`,
`otel_train.config_loading`), the metric catalogue `otel_train.semconv` and the other integrations
only, a `Session` never touched (issue #23). The demo (examples/demo/, outside the package) is a
user, held to the same public API.

What still breaks a rule is named in KNOWN_VIOLATIONS, one entry per offender, so the test fails on
any new violation, and on an entry that no longer occurs (delete it then).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "otel_train"
EXAMPLES_DIR = PACKAGE_DIR.parent / "examples"  # users of the package, not part of it
MAX_FUNCTION_LINES = 60
# Guards against a god class and an unreadable file, not targets: sizes follow the ideas (issue #46).
MAX_CLASS_LINES = 320
MAX_MODULE_LINES = 800
MAX_TOP_LEVEL_MODULES = 30  # issue #31: the file list shows the architecture; parts with a story are packages

# Private names that a module may read from another on purpose, as (reader, owner, name).
RUNTIME_PRIVATE_READS: frozenset[tuple[str, str, str]] = frozenset(
    {
        # The runtime's hot path reads the active session as a plain module attribute (why:
        # docs/design/core.md#runtime).
        ("otel_train", "otel_train.core.runtime", "_current"),
        ("otel_train.core.scopes", "otel_train.core.runtime", "_current"),
    }
)

# Packages with walls: from outside, only the names the package itself exports (its __init__) are
# imported, and the modules WALL_DOORS names, never its other modules; the package docstring says
# what the package is.
WALLED_PACKAGES: frozenset[str] = frozenset(
    {"hardware", "crossrank", "diagnostics", "core", "numerics", "exporters"}
)
# A walled package's modules that are doors of their own. The core's records (what producers append,
# what flush listeners receive) and its copy of tensors to the host sit below the listeners and
# producers that the core's front door builds (health, goodput, hardware, crossrank, numerics): through
# `otel_train.core` they would close an import cycle.
WALL_DOORS: dict[str, frozenset[str]] = {"core": frozenset({"buffer", "resolve"})}

# Offenders in modules this step did not restructure. Each entry is what `violations()` reports;
# delete it once fixed (test_known_violations_still_occur says when).
KNOWN_VIOLATIONS: frozenset[str] = frozenset()

# What breaks a rule for good, with the reason; like KNOWN_VIOLATIONS, an entry that no longer
# occurs fails test_known_violations_still_occur.
ALLOWED: dict[str, str] = {
    "walls: otel_train imports otel_train.core.runtime (import from otel_train.core)": "the hot path "
    "(ot.record and the other module functions) reads `runtime._current` as a module attribute: "
    "docs/design/core.md#runtime",
    "kind-dispatch: otel_train.bridges.host compares kind with 'setup'": "a pipe frame's tag: data read "
    "off the bridge process's pipe (bridges/framing), not a type inside this process",
    "kind-dispatch: otel_train.bridges.process compares kind with 'BridgeImportError'": "the class name of "
    "an error the bridge process sent back over its pipe",
    "kind-dispatch: otel_train.bridges.process compares kind with 'BridgeSetupError'": "the same",
}
EXEMPT = KNOWN_VIOLATIONS | ALLOWED.keys()


# --- the checker (also run on synthetic packages below) ----------------------------------------------
@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool


@dataclass
class Report:
    cycles: list[str] = field(default_factory=list)
    private: list[str] = field(default_factory=list)
    sizes: list[str] = field(default_factory=list)
    public: list[str] = field(default_factory=list)  # integrations beyond the public API
    walls: list[str] = field(default_factory=list)  # a walled package's module imported from outside
    kinds: list[str] = field(default_factory=list)  # `kind` compared with a string
    factory: list[str] = field(default_factory=list)  # an instrument made other than by MetricSpec.create

    def all(self) -> set[str]:
        return {
            *self.cycles,
            *self.private,
            *self.sizes,
            *self.public,
            *self.walls,
            *self.kinds,
            *self.factory,
        }


def load_package(package_dir: Path) -> dict[str, Module]:
    """Every module of the package rooted at `package_dir`, by dotted name."""
    root = package_dir.name
    modules: dict[str, Module] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [root, *path.relative_to(package_dir).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    return modules


def _absolute(module: Module, level: int, target: str | None) -> str:
    """The dotted name a (possibly relative) `from ... import` names."""
    if level == 0:
        return target or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _existing(modules: dict[str, Module], dotted: str) -> str | None:
    """The longest prefix of `dotted` that is one of the package's modules."""
    parts = dotted.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


@dataclass(frozen=True)
class ImportedName:
    bound_as: str  # the local name
    module: str | None  # the package module it is bound to (None: a name from inside a module)
    owner: str  # the module the name was imported from
    name: str  # the imported name (for `from owner import name`)


def imports_of(module: Module, modules: dict[str, Module], root: str | None = None) -> Iterator[ImportedName]:
    """Every import of package `root` (by default the module's own package) in `module`, at any
    depth (module level, functions, TYPE_CHECKING)."""
    root = root or module.name.split(".")[0]

    def in_package(dotted: str) -> bool:
        return dotted == root or dotted.startswith(root + ".")

    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _existing(modules, alias.name)
                if target is None or not in_package(alias.name):
                    continue
                if alias.asname:
                    yield ImportedName(alias.asname, target, target, "")
                else:  # `import a.b.c` binds `a`; attribute chains are resolved from there
                    yield ImportedName(alias.name.split(".")[0], root, target, "")
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.level, node.module)
            if not in_package(base) or _existing(modules, base) is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                bound = alias.asname or alias.name
                if sub in modules:
                    yield ImportedName(bound, sub, sub, "")
                else:
                    yield ImportedName(bound, None, _existing(modules, base) or base, alias.name)


def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        for imp in imports_of(module, modules):
            if imp.owner != module.name:
                graph[module.name].add(imp.owner)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(module: Module, modules: dict[str, Module]) -> Iterator[tuple[str, str]]:
    """(owner module, private name) for `from owner import _x` and `owner_alias._x` in `module`."""
    bound: dict[str, str] = {}
    for imp in imports_of(module, modules):
        if imp.module is not None:
            bound[imp.bound_as] = imp.module
        elif _is_private(imp.name) and imp.owner != module.name:
            yield imp.owner, imp.name
        if (
            imp.module is not None
            and any(_is_private(p) for p in imp.module.split("."))
            and imp.module.rpartition(".")[0] != module.name.rpartition(".")[0]
        ):  # a private module, imported from outside its own package
            yield imp.module.rpartition(".")[0], imp.module.rpartition(".")[2]
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        owner = _module_expression(node.value, bound, modules)
        if owner is not None and owner != module.name:
            yield owner, node.attr


def _module_expression(node: ast.expr, bound: dict[str, str], modules: dict[str, Module]) -> str | None:
    """The package module `node` evaluates to (a bound name or an attribute chain on one), if any."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _module_expression(node.value, bound, modules)
        if parent is not None and f"{parent}.{node.attr}" in modules:
            return f"{parent}.{node.attr}"
    return None


def oversized(module: Module) -> Iterator[str]:
    def walk(node: ast.AST, prefix: str) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                is_class = isinstance(child, ast.ClassDef)
                limit = MAX_CLASS_LINES if is_class else MAX_FUNCTION_LINES
                if lines > limit:
                    yield f"size: {'class' if is_class else 'function'} {module.name}:{qualname}"
                yield from walk(child, f"{qualname}.")
            else:
                yield from walk(child, prefix)

    yield from walk(module.tree, "")
    if len(module.path.read_text().splitlines()) > MAX_MODULE_LINES:
        yield f"size: module {module.name}"


# --- typed dispatch: no `kind == "..."` (issue #31) ------------------------------------------------
def _is_kind(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "kind") or (
        isinstance(node, ast.Attribute) and node.attr == "kind"
    )


def _strings(node: ast.expr) -> list[str]:
    """The string constants `node` is or holds (a tuple, list or set of them, for `in`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def kind_dispatch(module: Module) -> Iterator[str]:
    """`kind` (a name or an attribute) compared with string constants, by `==`, `!=`, `in` or a
    `match` case: messages and records carry their type, dispatch goes by class or enum."""
    for node in ast.walk(module.tree):
        compared: list[str] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for left, right in itertools.pairwise(operands):
                if _is_kind(left):
                    compared += _strings(right)
                if _is_kind(right):
                    compared += _strings(left)
        elif isinstance(node, ast.Match) and _is_kind(node.subject):
            for case in node.cases:
                for pattern in ast.walk(case.pattern):
                    if isinstance(pattern, ast.MatchValue):
                        compared += _strings(pattern.value)
        for text in compared:
            yield f"kind-dispatch: {module.name} compares kind with {text!r}"


# --- one instrument factory: MetricSpec.create (issue #31) ------------------------------------------
METER_FACTORIES = frozenset(
    {
        "create_counter",
        "create_up_down_counter",
        "create_histogram",
        "create_gauge",
        "create_observable_counter",
        "create_observable_up_down_counter",
        "create_observable_gauge",
    }
)
# Modules that call the SDK's Meter factories: the factory itself, and user gauges, which are named
# by ot.record() and have no spec.
FACTORY_MODULES = frozenset({"semconv", "core.instruments"})  # below the package root


def instrument_factories(module: Module) -> Iterator[str]:
    if module.name.partition(".")[2] in FACTORY_MODULES:
        return
    for node in ast.walk(module.tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr in METER_FACTORIES:
            target = _dotted(node.func.value) or "..."
            yield f"factory: {module.name} calls {target}.{node.func.attr}"


# --- integrations use the public API only (issue #23) ---------------------------------------------
# What an adapter may use: the names in the package's `__all__` and in its adapter module's
# `__all__` (ADAPTER_MODULE), its settings modules (config, config_loading), the catalogue, the
# other integrations. A `Session` (from `current_session()`/
# `init()`, or typed `Session`) is opaque: any method call or attribute read/write on it is a
# violation (adapters for other frameworks must be writable from the outside with the same API).
SESSION_FACTORIES = frozenset({"current_session", "init"})
ADAPTER_MODULE = "adapters"  # below the package root


def _public_names(modules: dict[str, Module], root: str) -> frozenset[str]:
    """The `__all__` of module `root` (empty when the module or its `__all__` is missing)."""
    if root not in modules:
        return frozenset()
    for node in ast.walk(modules[root].tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        parent = _dotted(node.value)
        return f"{parent}.{node.attr}" if parent is not None else None
    return None


def non_public_uses(module: Module, modules: dict[str, Module], root: str | None = None) -> Iterator[str]:
    """What an integration module (or, with `root` naming the package, a user's module outside it)
    uses beyond the public API of package `root`, as report lines."""
    root = root or module.name.split(".")[0]
    public = _public_names(modules, root)
    adapters = f"{root}.{ADAPTER_MODULE}"
    adapter_names = _public_names(modules, adapters)
    # settings (and loading them) and metric names are public
    allowed_modules = {root, f"{root}.config", f"{root}.config_loading", f"{root}.semconv", adapters}
    here = module.name
    package_aliases: set[str] = set()
    adapter_aliases: set[str] = set()
    factories: set[str] = set()  # local names (dotted) that call into a Session factory
    for imp in imports_of(module, modules, root):
        if imp.module is not None and (
            imp.module in allowed_modules or imp.module.startswith(f"{root}.integrations")
        ):
            if imp.module == root:
                package_aliases.add(imp.bound_as)
            if imp.module == adapters:
                adapter_aliases.add(imp.bound_as)
            continue
        if imp.module is None and imp.owner == root and f"{root}.{imp.name}" in allowed_modules:
            continue
        if imp.module is None and imp.owner == root and imp.name in public:
            if imp.name in SESSION_FACTORIES:
                factories.add(imp.bound_as)
            continue
        if imp.module is None and imp.owner == adapters and imp.name in adapter_names:
            continue
        if imp.module is None and (
            imp.owner in allowed_modules - {root, adapters} or imp.owner.startswith(f"{root}.integrations")
        ):
            continue
        yield f"public-api: {here} imports {imp.owner}{'.' + imp.name if imp.name else ''}"
    factories |= {f"{alias}.{name}" for alias in package_aliases for name in SESSION_FACTORIES}

    def is_session_call(node: ast.expr) -> bool:
        return isinstance(node, ast.Call) and _dotted(node.func) in factories

    sessions: set[str] = set()  # names (dotted: `self._s`) holding a Session
    for node in ast.walk(module.tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign) and is_session_call(node.value):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.arg)) and node.annotation is not None:
            if "Session" in ast.unparse(node.annotation) or (
                isinstance(node, ast.AnnAssign) and node.value is not None and is_session_call(node.value)
            ):
                targets = [node.target] if isinstance(node, ast.AnnAssign) else [ast.Name(node.arg)]
        elif isinstance(node, ast.NamedExpr) and is_session_call(node.value):
            targets = [node.target]
        elif (
            isinstance(node, ast.withitem)
            and node.optional_vars is not None
            and is_session_call(node.context_expr)
        ):
            targets = [node.optional_vars]
        sessions |= {d for d in map(_dotted, targets) if d is not None}
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Attribute):
            continue
        value = _dotted(node.value)
        if value in package_aliases and node.attr not in public:
            yield f"public-api: {here} uses {root}.{node.attr} (not in {root}.__all__)"
        elif value in adapter_aliases and node.attr not in adapter_names:
            yield f"public-api: {here} uses {adapters}.{node.attr} (not in {adapters}.__all__)"
        elif value in sessions or is_session_call(node.value):
            yield f"public-api: {here} uses Session.{node.attr}"


def through_walls(
    module: Module,
    modules: dict[str, Module],
    walled: frozenset[str],
    doors: dict[str, frozenset[str]] = WALL_DOORS,
) -> Iterator[str]:
    """Imports of a walled package's modules (other than its doors) from outside that package, as
    report lines."""
    root = module.name.split(".")[0]
    for name in sorted(walled):
        package = f"{root}.{name}"
        if module.name == package or module.name.startswith(package + "."):
            continue
        open_modules = {f"{package}.{door}" for door in doors.get(name, frozenset())}
        for imp in imports_of(module, modules):
            # `import a.b.c` binds `a`, but its owner is a.b.c
            if imp.owner.startswith(package + ".") and imp.owner not in open_modules:
                yield f"walls: {module.name} imports {imp.owner} (import from {package})"


def violations(
    package_dir: Path,
    runtime_reads: frozenset[tuple[str, str, str]] = frozenset(),
    walled: frozenset[str] = WALLED_PACKAGES,
    doors: dict[str, frozenset[str]] = WALL_DOORS,
) -> Report:
    modules = load_package(package_dir)
    report = Report()
    graph = import_graph(modules)
    for component in find_cycles(graph):
        members = set(component)
        for a in component:
            for b in sorted(graph[a] & members):
                report.cycles.append(f"cycle: {a} -> {b}")
    for module in modules.values():
        for owner, name in private_reaches(module, modules):
            if (module.name, owner, name) not in runtime_reads:
                report.private.append(f"private: {module.name} reads {owner}.{name}")
        report.sizes.extend(oversized(module))
        if module.name.startswith(f"{package_dir.name}.integrations."):
            report.public.extend(non_public_uses(module, modules))
        report.walls.extend(through_walls(module, modules, walled, doors))
        report.kinds.extend(kind_dispatch(module))
        report.factory.extend(instrument_factories(module))
    for part in (
        report.cycles,
        report.private,
        report.sizes,
        report.public,
        report.walls,
        report.kinds,
        report.factory,
    ):
        part[:] = sorted(set(part))
    return report


# --- the package ---------------------------------------------------------------------------------------
def test_no_new_violations() -> None:
    found = violations(PACKAGE_DIR, RUNTIME_PRIVATE_READS).all()
    new = sorted(found - EXEMPT)
    assert not new, "new architecture violations (fix them; see this module's docstring):\n" + "\n".join(new)


def test_known_violations_still_occur() -> None:
    gone = sorted(EXEMPT - violations(PACKAGE_DIR, RUNTIME_PRIVATE_READS).all())
    assert not gone, "fixed: delete these from KNOWN_VIOLATIONS or ALLOWED:\n" + "\n".join(gone)


def test_the_top_level_is_small_enough_to_read() -> None:
    """At most MAX_TOP_LEVEL_MODULES modules beside the packages (hardware, crossrank, diagnostics,
    core, numerics, bridges, integrations): a newcomer reads the architecture off `ls`."""
    top = sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {top}"


def test_no_submodule_shadows_a_public_name() -> None:
    """Importing `otel_train.watch` (a package) would replace the function `ot.watch` with the
    module: no submodule or subpackage may share a name with the public API."""
    import otel_train

    submodules = {p.stem for p in PACKAGE_DIR.glob("*.py")} | {
        p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists()
    }
    assert not submodules & set(otel_train.__all__), sorted(submodules & set(otel_train.__all__))


def test_the_checker_sees_the_package() -> None:
    """Guards against a checker that finds nothing because it walked nothing."""
    modules = load_package(PACKAGE_DIR)
    assert {"otel_train", "otel_train.core.session", "otel_train.hardware", "otel_train.bridges.base"} <= set(
        modules
    )
    graph = import_graph(modules)
    assert {"otel_train.core", "otel_train.core.runtime"} <= graph["otel_train"]
    assert "otel_train.core.session" in graph["otel_train.core"]
    assert {"otel_train.hardware.discovery", "otel_train.hardware.gpu_sampler"} <= graph[
        "otel_train.hardware.monitor"
    ]
    assert "otel_train.core.session" not in graph["otel_train.numerics.model_watch"]


def test_the_demo_uses_only_the_public_api() -> None:
    """The demo is a user (in examples/, outside the package): the integrations' rule holds for it,
    and the checker sees its otel_train imports, so a pass means something."""
    package = load_package(PACKAGE_DIR)
    demo = {name: m for name, m in load_package(EXAMPLES_DIR).items() if name.startswith("examples.demo")}
    assert {"examples.demo.train", "examples.demo.model", "examples.demo.data"} <= set(demo)
    seen = {(imp.owner, imp.name) for m in demo.values() for imp in imports_of(m, package, "otel_train")}
    assert {("otel_train.config", "ConfigError"), ("otel_train", "")} <= seen, seen
    found = sorted(line for m in demo.values() for line in non_public_uses(m, package, "otel_train"))
    assert not found, "the demo uses otel_train beyond its public API:\n" + "\n".join(found)


# --- the checker on planted violations --------------------------------------------------------------
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_detects_import_cycles_at_any_depth(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "a.py": "from pkg import b\n",
            "b.py": "def f() -> None:\n    from pkg.c import g\n",  # a function-level import
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\ndef g(): ...\n",
            "d.py": "import pkg.a\n",  # imports into the cycle, not part of it
        },
    )
    report = violations(root)
    assert report.cycles == ["cycle: pkg.a -> pkg.b", "cycle: pkg.b -> pkg.c", "cycle: pkg.c -> pkg.a"]
    assert not report.private and not report.sizes


def test_no_cycle_through_the_implicit_parent_package(tmp_path: Path) -> None:
    root = _package(tmp_path, {"__init__.py": "from pkg.a import f\n", "a.py": "def f(): ...\n"})
    assert violations(root).all() == set()


def test_detects_private_reaches_across_modules(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "owner.py": "_state = 1\n_other = 2\npublic = 3\n_self = 4\nx = _self\n",
            "sub/__init__.py": "",
            "sub/deep.py": "_hidden = 1\n",
            "imports_private.py": "from pkg.owner import _state, public\n",
            "reads_attribute.py": "from pkg import owner as o\ndef f():\n    return o._other + o.public\n",
            "reads_chain.py": "import pkg.sub.deep\nvalue = pkg.sub.deep._hidden\n",
            "relative.py": "from .owner import _state\n",
            "dunder.py": "from pkg import owner\nname = owner.__name__\n",
            "unrelated.py": "class C:\n    _x = 1\nvalue = C()._x\n",  # not a module: out of scope
        },
    )
    assert violations(root).private == [
        "private: pkg.imports_private reads pkg.owner._state",
        "private: pkg.reads_attribute reads pkg.owner._other",
        "private: pkg.reads_chain reads pkg.sub.deep._hidden",
        "private: pkg.relative reads pkg.owner._state",
    ]
    allowed = frozenset({("pkg.relative", "pkg.owner", "_state")})
    assert "private: pkg.relative reads pkg.owner._state" not in violations(root, allowed).private


def test_detects_oversized_functions_and_classes(tmp_path: Path) -> None:
    body = "    x = 1\n"
    long_function = "def long():\n" + body * MAX_FUNCTION_LINES  # 61 lines with the def
    ok_function = "def ok():\n" + body * (MAX_FUNCTION_LINES - 1)
    method = "    def method(self):\n" + ("    " + body) * MAX_FUNCTION_LINES
    long_class = "class Big:\n" + "    y = 1\n" * MAX_CLASS_LINES
    ok_class = "class Fits:\n" + "    y = 1\n" * (MAX_CLASS_LINES - 1)
    root = _package(
        tmp_path,
        {
            "m.py": long_function + ok_function + long_class,
            "n.py": "class Small:\n" + method,
            "o.py": ok_class,
        },
    )
    assert violations(root).sizes == [
        "size: class pkg.m:Big",
        "size: function pkg.m:long",
        "size: function pkg.n:Small.method",
    ]


def test_detects_oversized_modules(tmp_path: Path) -> None:
    line = "x = 1\n"
    root = _package(tmp_path, {"long.py": line * (MAX_MODULE_LINES + 1), "ok.py": line * MAX_MODULE_LINES})
    assert violations(root).sizes == ["size: module pkg.long"]


def test_detects_kind_string_dispatch(tmp_path: Path) -> None:
    bad = (
        "def f(message, kind, frame):\n"
        "    if message.kind == 'text':\n        pass\n"
        "    elif 'hparams' != kind:\n        pass\n"
        "    ok = kind in ('a', 'b')\n"
        "    match frame.kind:\n        case 'step' | 'mark':\n            pass\n"
    )
    ok = (
        "import enum\nclass Role(enum.Enum):\n    STEP = 'step'\n"
        "def f(record, kind, streak_kind, name):\n"
        "    a = record.kind is Role.STEP\n    b = kind == Role.STEP\n    c = streak_kind == 'x'\n"
        "    d = name == 'kind'\n"
        "    match record:\n        case Role.STEP:\n            pass\n"
    )
    assert violations(_package(tmp_path, {"bad.py": bad, "ok.py": ok})).kinds == [
        "kind-dispatch: pkg.bad compares kind with 'a'",
        "kind-dispatch: pkg.bad compares kind with 'b'",
        "kind-dispatch: pkg.bad compares kind with 'hparams'",
        "kind-dispatch: pkg.bad compares kind with 'mark'",
        "kind-dispatch: pkg.bad compares kind with 'step'",
        "kind-dispatch: pkg.bad compares kind with 'text'",
    ]


def test_detects_instruments_made_outside_the_factory(tmp_path: Path) -> None:
    files = {
        "semconv.py": "class MetricSpec:\n    def create(self, meter):\n        return meter.create_counter('x')\n",
        "core/instruments.py": "def user_gauge(meter, name):\n    return meter.create_gauge(name)\n",
        "ok.py": "from pkg import semconv\ndef f(meter, spec):\n    return spec.create(meter)\n",
        "bad.py": "def f(self, meter):\n    self.meter.create_histogram('h')\n    meter.create_observable_gauge('g')\n",
    }
    assert violations(_package(tmp_path, files)).factory == [
        "factory: pkg.bad calls meter.create_observable_gauge",
        "factory: pkg.bad calls self.meter.create_histogram",
    ]


_FAKE_ROOT = '__all__ = ["current_session", "init", "step"]\nfrom pkg import _runtime\n'
_FAKE_MODULES = {"session.py": "class Session: ...\n", "config.py": "class Config: ...\n", "_runtime.py": "",
                 "integrations/__init__.py": "", "integrations/other.py": "def f(): ...\n"}  # fmt: skip


def test_detects_integrations_beyond_the_public_api(tmp_path: Path) -> None:
    ok = (
        "import pkg as ot\nfrom pkg import step\nfrom pkg.config import Config\nfrom pkg.integrations.other import f\n"
        "def g():\n    s = ot.current_session()\n    if s is None or ot.current_session() is not s:\n"
        "        ot.step()\n    return s\n"
    )
    bad = (
        "import pkg as ot\nfrom pkg.session import Session\nfrom pkg import current_session as cs\n"
        "from pkg import _runtime\n"
        "def a(s: Session):\n    s.flush()\n"
        "def b():\n    x = ot.current_session()\n    x.buffer.add(1)\n    ot.current_session().end_step()\n"
        "class C:\n    def m(self):\n        self._s = ot.current_session()\n        self._s.step_start_ns = 0\n"
        "def c():\n    cs().identity\n    ot._runtime._current\n    with ot.init() as s:\n        s.run_dir\n"
    )
    outside = "import pkg as ot\ns = ot.current_session()\ns.buffer\n"  # not an integration: allowed
    files = {"__init__.py": _FAKE_ROOT, **_FAKE_MODULES, "integrations/ok.py": ok, "integrations/bad.py": bad,
             "core.py": outside}  # fmt: skip
    report = violations(_package(tmp_path, files))
    assert report.public == [
        "public-api: pkg.integrations.bad imports pkg._runtime",
        "public-api: pkg.integrations.bad imports pkg.session.Session",
        "public-api: pkg.integrations.bad uses Session.buffer",
        "public-api: pkg.integrations.bad uses Session.end_step",
        "public-api: pkg.integrations.bad uses Session.flush",
        "public-api: pkg.integrations.bad uses Session.identity",
        "public-api: pkg.integrations.bad uses Session.run_dir",
        "public-api: pkg.integrations.bad uses Session.step_start_ns",
        "public-api: pkg.integrations.bad uses pkg._runtime (not in pkg.__all__)",
    ]


def test_detects_a_user_outside_the_package_beyond_the_public_api(tmp_path: Path) -> None:
    """The rule the demo is held to, on a planted user package beside `pkg`."""
    modules = load_package(_package(tmp_path, {"__init__.py": _FAKE_ROOT, **_FAKE_MODULES}))
    user = tmp_path / "examples"
    user.mkdir()
    (user / "__init__.py").write_text("")
    (user / "ok.py").write_text(
        "import pkg as ot\nfrom pkg.config import Config\nfrom examples.bad import x\n"
        "with ot.init():\n    ot.step()\n"
    )
    (user / "bad.py").write_text(
        "import pkg\nfrom pkg import _runtime\nfrom pkg.session import Session\n"
        "x = pkg.current_session()\nx.flush()\n"
    )
    found = sorted(line for m in load_package(user).values() for line in non_public_uses(m, modules, "pkg"))
    assert found == [
        "public-api: examples.bad imports pkg._runtime",
        "public-api: examples.bad imports pkg.session.Session",
        "public-api: examples.bad uses Session.flush",
    ]


def test_integrations_may_use_the_adapter_modules_names_only(tmp_path: Path) -> None:
    """`pkg.adapters.__all__` is open to integrations as `pkg.__all__` is; its other names, and
    the internals it imports, are not."""
    adapters = (
        '__all__ = ["begin_step", "current_run"]\nfrom pkg import _runtime\n'
        "def begin_step(): ...\ndef current_run(): ...\ndef _helper(): ...\ndef hidden(): ...\n"
    )
    ok = (
        "from pkg import adapters\nfrom pkg.adapters import current_run\nimport pkg.adapters as ad\n"
        "def g():\n    adapters.begin_step()\n    ad.begin_step()\n    return current_run() == current_run()\n"
    )
    bad = (
        "import pkg as ot\nfrom pkg import adapters\nfrom pkg.adapters import hidden, _helper\n"
        "def g():\n    adapters.hidden()\n    adapters._runtime.current()\n    ot.adapters.begin_step()\n"
    )
    files = {"__init__.py": _FAKE_ROOT, **_FAKE_MODULES, "adapters.py": adapters, "integrations/ok.py": ok,
             "integrations/bad.py": bad}  # fmt: skip
    assert violations(_package(tmp_path, files)).public == [
        "public-api: pkg.integrations.bad imports pkg.adapters._helper",
        "public-api: pkg.integrations.bad imports pkg.adapters.hidden",
        "public-api: pkg.integrations.bad uses pkg.adapters (not in pkg.__all__)",
        "public-api: pkg.integrations.bad uses pkg.adapters._runtime (not in pkg.adapters.__all__)",
        "public-api: pkg.integrations.bad uses pkg.adapters.hidden (not in pkg.adapters.__all__)",
    ]


def test_detects_imports_through_a_packages_walls(tmp_path: Path) -> None:
    files = {
        "hardware/__init__.py": "from pkg.hardware.monitor import Monitor\n",
        "hardware/monitor.py": "from pkg.hardware import parts\nclass Monitor: ...\n",  # inside: fine
        "hardware/parts.py": "X = 1\n",
        "ok.py": "from pkg.hardware import Monitor\nimport pkg.hardware\n",
        "bad.py": "from pkg.hardware.parts import X\ndef f():\n    import pkg.hardware.monitor\n",
        "also_bad.py": "from pkg.hardware import parts\n",
    }
    report = violations(_package(tmp_path, files), walled=frozenset({"hardware"}))
    assert report.walls == [
        "walls: pkg.also_bad imports pkg.hardware.parts (import from pkg.hardware)",
        "walls: pkg.bad imports pkg.hardware.monitor (import from pkg.hardware)",
        "walls: pkg.bad imports pkg.hardware.parts (import from pkg.hardware)",
    ]
    # a module named as a door is open from outside; the package's other modules stay walled
    doors = {"hardware": frozenset({"parts"})}
    report = violations(_package(tmp_path, files), walled=frozenset({"hardware"}), doors=doors)
    assert report.walls == ["walls: pkg.bad imports pkg.hardware.monitor (import from pkg.hardware)"]


@pytest.mark.parametrize("planted", ["cycle", "private", "size", "public-api", "kind-dispatch", "factory"])
def test_a_planted_violation_fails_the_package_check(tmp_path: Path, planted: str) -> None:
    """The comparison test_no_new_violations makes, on a copy of a clean package plus one offender."""
    files = {
        "__init__.py": '__all__ = ["current_session"]\n',
        "a.py": "from pkg import b\n",
        "b.py": "X = 1\n",
    }
    if planted == "cycle":
        files["b.py"] = "import pkg.a\n"
    elif planted == "private":
        files["b.py"] = "_x = 1\n"
        files["a.py"] = "from pkg.b import _x\n"
    elif planted == "size":
        files["b.py"] = "def f():\n" + "    pass\n" * (MAX_FUNCTION_LINES + 5)
    elif planted == "kind-dispatch":
        files["b.py"] = "def f(m):\n    return m.kind == 'text'\n"
    elif planted == "factory":
        files["b.py"] = "def f(meter):\n    return meter.create_counter('train.steps')\n"
    clean = {
        "__init__.py": '__all__ = ["current_session"]\n',
        "a.py": "from pkg import b\n",
        "b.py": "X = 1\n",
        "integrations/__init__.py": "",
        "integrations/x.py": "import pkg\ns = pkg.current_session()\n",
    }
    if planted == "public-api":
        files = {**clean, "integrations/x.py": "import pkg\npkg.current_session().end_step()\n"}
    assert violations(_package(tmp_path / "clean", clean)).all() == set()
    new = violations(_package(tmp_path, files)).all() - EXEMPT
    assert len(new) >= 1 and all(v.startswith(planted) for v in new), new


# --- names owned by one module: bridge keys (semconv) and run-directory files (run_directory) --------
def _string_constants(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, text) of every string constant that is not a docstring (f-string parts included)."""
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def retyped_names(package_dir: Path, owned: dict[str, frozenset[str]], exempt: frozenset[str]) -> list[str]:
    """`owned` maps an owner module to the names only it may spell out; a string constant equal to
    one of them anywhere else is reported."""
    found = []
    for module in load_package(package_dir).values():
        if module.name in exempt:
            continue
        for owner, names in owned.items():
            if module.name == owner:
                continue
            for line, text in _string_constants(module.tree):
                if text in names:
                    found.append(f"retyped: {module.name}:{line} spells {text!r} (owned by {owner})")
    return sorted(found)


def _catalogue_keys() -> frozenset[str]:
    from otel_train import semconv as sc

    keys: set[str] = set()
    for spec in sc.CATALOGUE:
        if "{" in spec.key:
            continue
        keys.add(spec.key)
        if spec.kind in (sc.Kind.COUNTER, sc.Kind.OBSERVABLE_COUNTER):
            keys.add(sc.rate_key(spec))
        if spec.kind is sc.Kind.HISTOGRAM:
            keys.update(
                sc.stat_key(spec.key, s) for s in ("mean", "count", "total", "min", "max", "p50", "p95")
            )
    return frozenset(keys)


def _run_file_names() -> frozenset[str]:
    """Every file name `RunFiles` gives; per-rank names as their fixed start (`metrics.rank`)."""
    from otel_train.run_directory import RunFiles

    files = RunFiles(Path("/run"), 7)
    names: set[str] = set()
    for attr in dir(RunFiles):
        value = getattr(files, attr) if not attr.startswith("_") else None
        path = value(3) if callable(value) else value
        if not isinstance(path, Path):
            continue
        name = path.relative_to("/run").parts[0]
        if "rank7" in name:  # f"metrics.rank{rank}.jsonl": its constant part
            names.add(name.split("rank7")[0] + "rank")
        elif "." in name:  # directories (wandb/, mlflow/, ...) are words other code says too
            names.add(name)
    return frozenset(names)


def test_bridge_keys_and_run_files_are_spelled_once() -> None:
    keys, files = _catalogue_keys(), _run_file_names()
    assert {"train/loss", "throughput/tokens_per_s", "timers/step/mean"} <= keys
    assert {"progress.txt", "control.json", "metrics.rank", "stacks.rank"} <= files
    owned = {"otel_train.semconv": keys, "otel_train.run_directory": files}
    assert retyped_names(PACKAGE_DIR, owned, frozenset()) == []


def test_retyped_names_are_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "owner.py": 'KEY = "train/loss"\nFILE = "progress.txt"\n',
            "ok.py": '"""Docstrings may say train/loss and progress.txt."""\nfrom pkg.owner import KEY\n',
            "bad.py": 'x = {"train/loss": 1}\ndef f(rank):\n    return f"metrics.rank{rank}.jsonl"\n',
        },
    )
    owned = {"pkg.owner": frozenset({"train/loss", "progress.txt", "metrics.rank"})}
    assert retyped_names(root, owned, frozenset()) == [
        "retyped: pkg.bad:1 spells 'train/loss' (owned by pkg.owner)",
        "retyped: pkg.bad:3 spells 'metrics.rank' (owned by pkg.owner)",
    ]
