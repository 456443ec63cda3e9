"""The package layout holds: no import cycles, no two modules of one name, the wire protocol
layer stays a lower layer of the gateway, no class is assembled from mixins of the project's own,
and nothing in the gateway probes an engine with `getattr` (its capabilities are declared).

Imports are read with `ast`, not by importing: every `import` / `from ... import` counts,
at module level, inside functions and under `TYPE_CHECKING` alike (a cycle through a type
hint is still a cycle of concepts). Each is resolved to the project module it names, a
package being its `__init__`. Run on its own: `pytest tests/project/test_package_layout.py`.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "encoder_worker", "kernels", "dashboards", "bench")
# directories whose import name is not their own (setup.py maps them): `kernels` is Hugging
# Face's distribution, which transformers imports
IMPORT_NAMES = {"kernels": "visiongate_kernels"}
# read for the layer rules only: what the shipped packages must never import
OUTSIDE = ("tests",)
# the wire protocol layer may lean on these leaf modules of the gateway, and nothing else
# the engine boundary's types are a leaf too: the service events carry its token log-probabilities
PROTOCOL_LEAVES = ("gateway.chat.events", "gateway.sessions.session", "gateway.engine.interface")

# modules named for their role inside one API's folder (gateway/api/<transport>/<api>/)
ROLE_MODULES = ("protocol", "serving", "router")
# who may import whom: a module of the left-hand prefix never imports one of the right-hand
# prefixes. Transports sit over the chat core, the core over the engines; the encoder workers,
# the shipped package and the benchmarks stand without what sits above them.
LAYER_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gateway.chat", ("gateway.api", "gateway.server", "gateway.cli")),
    ("gateway.engine", ("gateway.chat", "gateway.api", "gateway.server", "gateway.cli")),
    ("gateway.sessions", ("gateway.chat", "gateway.api", "gateway.server", "gateway.engine")),
    ("gateway.caching", ("gateway.chat", "gateway.api", "gateway.server", "gateway.engine")),
    ("gateway.policy", ("gateway.chat", "gateway.api", "gateway.server", "gateway.engine")),
    ("gateway.telemetry", ("gateway.chat", "gateway.api", "gateway.server", "gateway.engine")),
    ("gateway.protocol", ("gateway.api", "gateway.server", "gateway.engine", "gateway.policy")),
    ("gateway.encoders", ("gateway.api", "gateway.server")),
    ("gateway.api.realtime", ("gateway.api.openai",)),
    ("gateway.api.openai", ("gateway.api.realtime",)),
    ("gateway.api.http", ("gateway.api.openai", "gateway.api.realtime")),
    ("gateway", ("tests", "bench")),
    ("encoder_worker", ("gateway", "tests", "bench")),
    ("visiongate_kernels", ("gateway", "encoder_worker", "tests", "bench")),
    # the boards name the gateway's metrics, from the telemetry that defines them
    ("dashboards", ("gateway.api", "gateway.chat", "gateway.engine", "gateway.server", "tests")),
    ("bench", ("tests",)),
)

Graph = dict[str, dict[str, int]]  # module -> imported project module -> first line


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            parts = (IMPORT_NAMES.get(parts[0], parts[0]), *parts[1:])
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to: itself, or its longest dotted prefix that is one
    (`gateway.caching.make_vision_cache` -> `gateway.caching`); None outside the project."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _bindings(
    tree: ast.Module, package: list[str], modules: dict[str, Path]
) -> Iterator[tuple[str | None, int, str]]:
    """(project module, line, the name it binds) of every import in the tree; `package` is the
    file's package, which relative imports start from."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                yield _resolve(alias.name, modules), node.lineno, bound
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, `level - 1` packages up
                base = package[: len(package) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import submodule` imports the submodule; any other name is pkg's
                submodule = f"{source}.{alias.name}"
                yield (
                    submodule if submodule in modules else _resolve(source, modules),
                    node.lineno,
                    alias.asname or alias.name,
                )


def _imports(
    path: Path, package: list[str], modules: dict[str, Path]
) -> Iterator[tuple[str | None, int]]:
    """(project module, line) of every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for target, line, _ in _bindings(tree, package, modules):
        yield target, line


def import_graph(modules: dict[str, Path]) -> Graph:
    """Every module's imports of project modules, with the line of the first one."""
    graph: Graph = {}
    for module, path in modules.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        edges: dict[str, int] = {}
        for target, line in _imports(path, package, modules):
            if target is not None and target != module:
                edges.setdefault(target, line)
        graph[module] = dict(sorted(edges.items()))
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module, or of one
    module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, {}):
                    found.append(sorted(component))
    return found


def describe_cycles(graph: Graph, modules: dict[str, Path]) -> list[str]:
    """One paragraph per cycle: its modules and the imports that close it, file:line."""
    reports = []
    for component in strongly_connected(graph):
        members = set(component)
        lines = [f"import cycle among {len(component)} modules: {', '.join(component)}"]
        for module in component:
            for target, line in graph[module].items():
                if target in members:
                    path = modules[module].relative_to(ROOT)
                    lines.append(f"  {module} -> {target}  ({path}:{line})")
        reports.append("\n".join(lines))
    return reports


def shared_names(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Module names (file name without .py or a leading underscore) held by more than one
    module, `__init__` and `__main__` aside, and the role modules of the API folders: each API
    under `gateway/api/` has one `protocol` (its wire shapes), `serving` and `router`, named for
    their role, their folder naming the API."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in modules.values():
        if path.stem in ("__init__", "__main__"):
            continue
        relative = path.relative_to(ROOT)
        if path.stem in ROLE_MODULES and relative.parts[:2] == ("gateway", "api"):
            continue
        by_name[path.stem.lstrip("_")].append(str(relative))
    return {name: paths for name, paths in sorted(by_name.items()) if len(paths) > 1}


def test_the_walker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The walker itself: relative, absolute, submodule, function-level and TYPE_CHECKING
    imports are all edges, and a two-module cycle is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n"
    )
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\nB = 2\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import b\nfrom ..sub import d\nimport os\n")
    (pkg / "sub" / "d.py").write_text("import pkg.sub.c\n")
    modules = project_modules(tmp_path, ("pkg",))
    graph = import_graph(modules)
    assert graph["pkg"] == {"pkg.a": 1}
    assert graph["pkg.a"] == {"pkg.b": 3}
    assert graph["pkg.b"] == {"pkg.a": 2}
    assert graph["pkg.sub.c"] == {"pkg.b": 1, "pkg.sub.d": 2}
    assert sorted(strongly_connected(graph)) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_no_import_cycles() -> None:
    modules = project_modules()
    assert (
        "gateway.server.app" in modules and "encoder_worker" in modules
    )  # the walk found the code
    graph = import_graph(modules)
    assert "gateway.chat.service" in graph["gateway.server.app"]  # and read their imports
    cycles = describe_cycles(graph, modules)
    assert not cycles, "\n\n".join(cycles)


def test_no_two_modules_share_a_name() -> None:
    offenders = shared_names(project_modules())
    assert not offenders, "modules sharing a name:\n" + "\n".join(
        f"  {name}: {', '.join(paths)}" for name, paths in offenders.items()
    )


def test_protocol_imports_only_its_leaf_layers() -> None:
    """gateway.protocol is the wire vocabulary every layer uses: it (and what it imports,
    transitively) reaches nothing of the gateway but itself and the leaf modules."""
    modules = project_modules()
    graph = import_graph(modules)
    allowed = set(PROTOCOL_LEAVES)

    def inside(module: str) -> bool:
        return module == "gateway.protocol" or module.startswith("gateway.protocol.")

    # breadth-first from the protocol modules, remembering how each module was reached
    reached: dict[str, str] = {m: m for m in graph if inside(m)}
    queue = list(reached)
    problems = []
    while queue:
        module = queue.pop(0)
        for target, line in graph[module].items():
            if not (target == "gateway" or target.startswith("gateway.")) or target in reached:
                continue
            if not (inside(target) or target in allowed):
                path = modules[module].relative_to(ROOT)
                problems.append(
                    f"  {module} imports {target} ({path}:{line}); reached from {reached[module]}"
                )
                continue
            reached[target] = f"{reached[module]} -> {target}"
            queue.append(target)
    assert not problems, "gateway.protocol reaches beyond its leaf layers:\n" + "\n".join(problems)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: Graph, modules: dict[str, Path]) -> list[str]:
    """One line per import that breaks a rule of `LAYER_RULES`, file:line."""
    problems = []
    for module, edges in graph.items():
        for prefix, forbidden in LAYER_RULES:
            if not _under(module, prefix):
                continue
            for target, line in edges.items():
                for banned in forbidden:
                    if _under(target, banned) and not _under(target, prefix):
                        problems.append(f"  {module} imports {target} ({modules[module]}:{line})")
    return sorted(set(problems))


def test_the_layer_rules_see_a_breach(tmp_path: Path) -> None:
    """The checker itself: an engine module importing the chat core, and a bench module
    importing the tests, are both reported; the allowed direction is not."""
    for name in ("gateway/engine", "gateway/chat", "bench", "tests"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "gateway" / "__init__.py").write_text("")
    (tmp_path / "gateway/engine/core.py").write_text("from gateway.chat import service\n")
    (tmp_path / "gateway/chat/service.py").write_text("import gateway.engine.core\n")
    (tmp_path / "bench/run.py").write_text("def f():\n    from tests import helpers\n")
    (tmp_path / "tests/helpers.py").write_text("")
    modules = project_modules(tmp_path, ("gateway", "bench", "tests"))
    found = layer_violations(import_graph(modules), modules)
    assert len(found) == 2, found
    assert "gateway.engine.core imports gateway.chat.service" in found[1]
    assert "bench.run imports tests.helpers" in found[0]


def test_layers_import_only_downwards() -> None:
    modules = project_modules(packages=PACKAGES + OUTSIDE)
    graph = import_graph(modules)
    outside = {m for m in graph if any(_under(m, o) for o in OUTSIDE)}
    problems = layer_violations({m: e for m, e in graph.items() if m not in outside}, modules)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


# the one gateway module through which the gateway reaches the connection rules it shares with
# the encoder workers (same URL parsing, same cluster clients)
REDIS_CONNECTIONS = "gateway.caching.redis_connections"


def test_only_one_gateway_module_imports_the_workers_redis_rules() -> None:
    modules = project_modules()
    graph = import_graph(modules)
    assert "encoder_worker.redis_conn" in graph[REDIS_CONNECTIONS]
    importers = sorted(
        f"  {module} ({modules[module].relative_to(ROOT)}:{edges['encoder_worker.redis_conn']})"
        for module, edges in graph.items()
        if _under(module, "gateway")
        and module != REDIS_CONNECTIONS
        and "encoder_worker.redis_conn" in edges
    )
    assert not importers, (
        f"gateway modules importing encoder_worker.redis_conn (use {REDIS_CONNECTIONS}):\n"
        + "\n".join(importers)
    )


def test_the_layout_page_names_every_package() -> None:
    """docs/design/layout.md, a newcomer's map, names every package directory of the tree (and
    none that is gone), so that it cannot fall behind a move."""
    page = (ROOT / "docs" / "design" / "layout.md").read_text()
    named = set(re.findall(r"^\| `([a-z_/]+)/` \|", page, flags=re.MULTILINE))
    packages = {
        str(init.parent.relative_to(ROOT))
        for top in ("gateway", "encoder_worker", "kernels", "dashboards", "deploy", "bench")
        for init in (ROOT / top).rglob("__init__.py")
    }
    missing = sorted(packages - named)
    assert not missing, f"packages the layout page does not name: {missing}"
    gone = sorted(d for d in named - packages if not (ROOT / d).is_dir())
    assert not gone, f"the layout page names directories that do not exist: {gone}"


def _base_names(node: ast.expr) -> ast.expr:
    """`FairQueue[T]` -> `FairQueue`: the class a subscripted base names."""
    return node.value if isinstance(node, ast.Subscript) else node


def own_bases(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Every class (module.Class, line) with the bases it takes from its own top-level package:
    a class of the same module, a name imported from a module of the package, or an attribute
    of such a module (`rt.Event`). Bases from elsewhere (the standard library, msgspec, torch)
    do not count."""
    found: dict[str, list[str]] = {}
    for module, path in modules.items():
        top = module.split(".")[0]
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        # a name bound here -> the project module it comes from
        own_names = {
            name: target for target, _, name in _bindings(tree, package, modules) if target
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own_names.setdefault(node.name, module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for base in map(_base_names, node.bases):
                head = base
                while isinstance(head, ast.Attribute):
                    head = head.value
                named = isinstance(head, ast.Name) and own_names.get(head.id, "")
                if named and named.split(".")[0] == top:
                    bases.append(ast.unparse(base))
            found[f"{module}.{node.name}:{node.lineno}"] = bases
    return found


def mixed_classes(modules: dict[str, Path]) -> dict[str, list[str]]:
    """The classes with more than one base of their own package: module.Class -> bases."""
    return {
        name.split(":")[0]: bases for name, bases in own_bases(modules).items() if len(bases) > 1
    }


def test_the_mixin_rule_sees_a_class_of_two_own_bases(tmp_path: Path) -> None:
    """The checker itself: two bases of the package (same module, imported, or through a module
    alias) make a mixed class; one own base beside foreign ones does not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parts.py").write_text("class Admission:\n    pass\nclass WarmUps:\n    pass\n")
    (pkg / "whole.py").write_text(
        "from typing import Generic, TypeVar\n"
        "from pkg import parts\n"
        "from pkg.parts import Admission, WarmUps\n"
        "T = TypeVar('T')\n"
        "class Local:\n    pass\n"
        "class Scheduler(Admission, WarmUps):\n    pass\n"
        "class Connection(parts.Admission, Local):\n    pass\n"
        "class Fine(Admission, Exception, Generic[T]):\n    pass\n"
    )
    found = mixed_classes(project_modules(tmp_path, ("pkg",)))
    assert found == {
        "pkg.whole.Scheduler": ["Admission", "WarmUps"],
        "pkg.whole.Connection": ["parts.Admission", "Local"],
    }


def test_no_class_is_assembled_from_mixins_of_its_own_package() -> None:
    """A class whose state is spread over several own base classes (mixins that re-declare
    each other's attributes) is a whole split by length, not along a seam: hold the parts as
    objects with narrow interfaces instead (as the scheduler holds its admission, warm-ups and
    KV memory, and the Realtime connection its event handlers)."""
    found = mixed_classes(project_modules())
    assert not found, "classes with more than one base of their own package:\n" + "\n".join(
        f"  {name}({', '.join(bases)})" for name, bases in sorted(found.items())
    )


def _names_an_engine(node: ast.expr, class_name: str | None) -> bool:
    """`engine`, `self.engine`, `state.engine`, `self._engine`, or `self` inside an engine."""
    if isinstance(node, ast.Name) and node.id == "self":
        return class_name is not None and class_name.endswith("Engine")
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "engine" in name.lower()


def engine_probes(root: Path = ROOT) -> list[str]:
    """Every `getattr` / `hasattr` on an engine object in gateway/, file:line and the call."""
    found = []
    for path in sorted((root / "gateway").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        enclosing: dict[int, str] = {}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for inner in ast.walk(cls):
                enclosing[id(inner)] = cls.name  # the innermost class wins: walked later
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and _names_an_engine(node.args[0], enclosing.get(id(node)))
            ):
                found.append(f"  {path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_probe_rule_sees_a_probe(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "serving.py").write_text(
        "def f(engine, state, request):\n"
        "    getattr(engine, 'warm_up', None)\n"
        "    hasattr(state.engine, 'tokenizer')\n"
        "    getattr(request, 'n')\n"
        "class FakeEngine:\n"
        "    def g(self):\n"
        "        return getattr(self, 'image_input', 'embeds')\n"
        "class Other:\n"
        "    def h(self):\n"
        "        return getattr(self, 'x', None)\n"
    )
    found = engine_probes(tmp_path)
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in found] == ["2", "3", "7"]


def test_nothing_probes_an_engine_with_getattr() -> None:
    """What an engine takes and does is declared (`Engine.capabilities`, the protocol's
    methods): read it, never ask the object whether it happens to have an attribute."""
    found = engine_probes()
    assert not found, "getattr / hasattr on an engine in gateway/:\n" + "\n".join(found)
