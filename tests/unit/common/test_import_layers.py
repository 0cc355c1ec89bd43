"""Import layering of our packages, read from the source (AST), function-level imports
included: a lazy ``import`` inside a function is still a dependency.

* no import cycles among our modules;
* ``common/`` imports no other package of ours;
* nothing in ``worker/engine`` imports the rest of ``worker/``, ``gateway/`` or ``broker/``;
* inside ``worker/engine``: the core (``core/`` with its step loop, the runner, the model,
  attention, configuration, sampling) imports no feature; features never import the
  wiring (``build``) or the engine, which build them; the model runner knows no
  feature and not ``parallel/`` (features reach it through ``runner.hooks``); no import
  runs back up into ``core/`` from below it (the shared records are the leaves
  ``records`` / ``step_plan``); the models never import the loader;
* in ``gateway/``: the generation relay (``gateway.relay``) knows no API (its formatters
  plug in), and the API packages (``generate_api``, ``openai_api``, ``chat``,
  ``parsers``, ``structured_outputs``) import no route module (``gateway.resources``) nor the app;
  ``generate_api`` (the core every API maps onto) imports nothing of ``openai_api``: the
  dependency runs one way, openai_api -> generate_api.

Edges: ``import a.b.c`` is an edge to the module ``a.b.c`` (or its deepest existing
package); ``from a.b import c`` to ``a.b.c`` when that is a module, else to ``a.b``;
relative imports are resolved.  Importing a submodule runs its parent packages'
``__init__`` too, but that is not counted as an edge (every module would then depend on
its package).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("common", "worker", "broker", "gateway", "benchmarks")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported module of ours: first line}."""
    mods = _modules(root)

    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = graph[mod] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found is not None and found != mod:
                    edges.setdefault(found, node.lineno)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


@functools.lru_cache(maxsize=1)
def _our_graph() -> dict[str, dict[str, int]]:
    return import_graph()


def _describe(graph, cycle):
    members = set(cycle)
    return [f"{a} -> {b} (line {graph[a][b]})" for a in cycle for b in sorted(graph[a]) if b in members]


def _hits(graph, sources, forbidden):
    """``source -> target (line)`` for every import of a ``forbidden`` target by a ``sources`` module."""
    return [f"{m} -> {t} (line {line})" for m in sorted(graph) if sources(m)
            for t, line in sorted(graph[m].items()) if forbidden(m, t)]


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


E = "worker.engine"
# The engine's core: it runs batches and knows no feature.  core/ is the step loop (its
# EngineCore receives the features it runs with, built by ``build``), with the leaves it
# shares with the features (the component interface, the records, the step's plan);
# runner/, sample/ and loading/ are core whole.  parallel.state / sharding are the
# collectives the model's layers call (parallel.follower, which drives the followers'
# runners, is a feature).
CORE = (f"{E}.config", f"{E}.step_plan", f"{E}.records", f"{E}.wire_output", f"{E}.component", f"{E}.core",
        f"{E}.runner", f"{E}.sample", f"{E}.loading",
        f"{E}.attention", f"{E}.models", f"{E}.kernels", f"{E}.parallel.state", f"{E}.parallel.sharding")
FEATURES = (f"{E}.lora", f"{E}.spec_decode", f"{E}.multimodal", f"{E}.disagg", f"{E}.rl", f"{E}.components",
            f"{E}.structured_output",
            f"{E}.parallel.follower")
# The wiring (``build``: which features an engine runs with) and the engine it builds.
TOP = (f"{E}.build", f"{E}.engine")


def test_no_import_cycles():
    graph = _our_graph()
    cycles = import_cycles(graph)
    assert not cycles, [_describe(graph, c) for c in cycles]


def test_common_imports_no_other_package_of_ours():
    hits = _hits(_our_graph(), lambda m: _under(m, "common"), lambda m, t: not _under(t, "common"))
    assert not hits, hits


def test_engine_imports_nothing_of_the_worker_process_the_broker_or_the_gateway():
    hits = _hits(_our_graph(), lambda m: _under(m, E),
                 lambda m, t: _under(t, "worker", "broker", "gateway", "benchmarks") and not _under(t, E))
    assert not hits, hits


def test_engine_core_imports_no_feature():
    """core/ (the step loop included) and what it stands on import no feature: the
    features are built by ``build`` and handed to ``EngineCore``."""
    hits = _hits(_our_graph(), lambda m: _under(m, *CORE), lambda m, t: _under(t, *FEATURES, *TOP))
    assert not hits, hits


def test_features_do_not_import_the_engine():
    hits = _hits(_our_graph(), lambda m: _under(m, *FEATURES), lambda m, t: _under(t, *TOP))
    assert not hits, hits


def test_model_runner_knows_no_feature_nor_parallel():
    hits = _hits(_our_graph(), lambda m: m == f"{E}.runner.model_runner",
                 lambda m, t: _under(t, f"{E}.parallel", *FEATURES, *TOP))
    assert not hits, hits


def test_runner_hooks_and_config_are_leaves():
    """The interfaces features and the runner share, and the configuration everything
    reads, import nothing of the engine."""
    hits = _hits(_our_graph(), lambda m: m in (f"{E}.runner.hooks", f"{E}.config", f"{E}.step_plan", f"{E}.records"),
                 lambda m, t: _under(t, E))
    assert not hits, hits


def test_no_import_runs_back_up_into_the_core():
    """Nothing below the core's loop (features, the runner, the records) imports core/:
    the records they share with it are the leaves ``records`` and ``step_plan``, and what
    a component may do to the engine comes through its ``EngineContext``."""
    graph = _our_graph()
    below = [m for m in graph if _under(m, E) and m.count(".") > 2 and not _under(m, f"{E}.core")]
    found = sorted((m[len(E) + 1:], t[len(E) + 1:]) for m in below for t in graph[m] if _under(t, f"{E}.core"))
    assert not found, f"imports back up into core/: {found}"


def test_models_do_not_import_the_loading_package():
    """The models read their configuration (models/config.py) and nothing of the loader:
    loading/ builds models, never the other way round."""
    hits = _hits(_our_graph(), lambda m: _under(m, f"{E}.models"), lambda m, t: _under(t, f"{E}.loading"))
    assert not hits, hits


G = "gateway"
GATEWAY_APIS = (f"{G}.generate_api", f"{G}.openai_api", f"{G}.chat", f"{G}.parsers", f"{G}.structured_outputs")
GATEWAY_ROUTES = (f"{G}.resources", f"{G}.app", f"{G}.main")


def test_gateway_relay_knows_no_api():
    hits = _hits(_our_graph(), lambda m: m == f"{G}.relay", lambda m, t: _under(t, *GATEWAY_APIS, *GATEWAY_ROUTES))
    assert not hits, hits


def test_gateway_apis_import_no_route():
    hits = _hits(_our_graph(), lambda m: _under(m, *GATEWAY_APIS), lambda m, t: _under(t, *GATEWAY_ROUTES))
    assert not hits, hits


def test_generate_api_imports_no_openai_api():
    """The OpenAI facades build on the generate API's shapes, mapping and formatting;
    nothing runs back (output_mode "derender"'s chat parsing is handed in by the route)."""
    hits = _hits(_our_graph(), lambda m: _under(m, f"{G}.generate_api"),
                 lambda m, t: _under(t, f"{G}.openai_api"))
    assert not hits, hits


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The checks above read lazy imports too: a cycle hidden in functions is found."""
    pkg = tmp_path / "worker"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from worker.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n")
    graph = import_graph(tmp_path)
    assert import_cycles(graph) == [["worker.a", "worker.b"]]


if __name__ == "__main__":  # python tests/unit/common/test_import_layers.py: print the cycles, if any
    _graph = import_graph()
    for _cycle in import_cycles(_graph):
        print("cycle:", *_describe(_graph, _cycle), sep="\n    ")
    print(f"{len(_graph)} modules, {sum(map(len, _graph.values()))} imports of ours")
