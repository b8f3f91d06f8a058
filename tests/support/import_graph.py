"""The import graph of Tandem's packages, read with `ast` from their source files, and the rules it must keep.

Rules (docs/architecture.md, "The map"):
- between packages: engine and proto import none of the others; kv_transfer imports proto, and engine only
  in its pool glue (kv_transfer/engine_pool.py); prefill_worker and decode_worker import engine and
  kv_transfer (never each other); cluster imports all of those; nothing in the product imports deploy/ or
  tests/ (they are not in any allowed set);
- inside engine/, between its rooms (ALLOWED_ENGINE_ROOMS), one way only: the API (engine/__init__.py,
  llm.py, builder.py) -> core/ -> runner/ -> model/ -> attention/ -> kv/, with sampling/ and text/ beside
  them, results/ (outputs.py) for core/, parallel/ (tensor parallelism's layout, group and step message) for
  model/, runner/ and core/, and the shared types (config.py, sampling_params.py, sequence.py,
  host_lists.py, step_io.py) under all of them, importing only each other;
- inside cluster/, between its rooms: api and local know only the Backend contract (cluster/backend.py),
  api and coordinator also the stream merger (cluster/merged_streams.py); coordinator drives workers;
  drivers may use every room; bench, workers and clients stand alone; selftest uses bench (its checkpoints
  and limits) and plan uses bench (its workloads and metrics), nothing else, and only the entry points
  import them; the entry points (cli.py, serve.py with serve_flags.py, serve_config.py, serve_warmup.py) import
  anything in cluster/, and no room imports them;
- no Ray in engine, kv_transfer or the plain workers, and no gRPC in engine (Ray only places the workers).

Every import counts: at module level, inside functions and under TYPE_CHECKING.
"""
from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

PRODUCT_PACKAGES = ("engine", "proto", "kv_transfer", "prefill_worker", "decode_worker", "cluster")
REPO_PACKAGES = (*PRODUCT_PACKAGES, "deploy", "tests")

ALLOWED_PACKAGES: dict[str, frozenset[str]] = {
    "engine": frozenset(),
    "proto": frozenset(),
    "kv_transfer": frozenset({"proto"}),
    "prefill_worker": frozenset({"engine", "kv_transfer"}),
    "decode_worker": frozenset({"engine", "kv_transfer"}),
    "cluster": frozenset({"engine", "kv_transfer", "prefill_worker", "decode_worker", "proto"}),
}
ALLOWED_FOR_MODULE: dict[str, frozenset[str]] = {"kv_transfer.engine_pool": frozenset({"engine"})}

# engine/'s top-level modules by room; its subpackages are rooms by their own names (engine.core.scheduler: engine.core)
ENGINE_TOP_LEVEL_ROOMS = {
    "engine": "engine.api", "engine.llm": "engine.api", "engine.builder": "engine.api", "engine.convert": "engine.api",
    "engine.outputs": "engine.results",
    "engine.config": "engine.types", "engine.sampling_params": "engine.types", "engine.sequence": "engine.types",
    "engine.structured_params": "engine.types",
    "engine.host_lists": "engine.types", "engine.step_io": "engine.types",
}
ALLOWED_ENGINE_ROOMS: dict[str, frozenset[str]] = {
    "engine.types": frozenset(),
    "engine.parallel": frozenset({"engine.types"}),
    "engine.kv": frozenset({"engine.types"}),
    "engine.text": frozenset({"engine.types"}),
    "engine.sampling": frozenset({"engine.types"}),
    "engine.structured": frozenset({"engine.text", "engine.types"}),
    "engine.attention": frozenset({"engine.kv", "engine.types"}),
    "engine.model": frozenset({"engine.attention", "engine.kv", "engine.parallel", "engine.types"}),
    "engine.runner": frozenset({"engine.model", "engine.attention", "engine.kv", "engine.parallel", "engine.sampling",
                                "engine.types"}),
    "engine.results": frozenset({"engine.sampling", "engine.text", "engine.types"}),
    "engine.core": frozenset({"engine.runner", "engine.model", "engine.attention", "engine.kv", "engine.parallel",
                              "engine.sampling", "engine.structured", "engine.text", "engine.results", "engine.types"}),
}
ALLOWED_ENGINE_ROOMS["engine.api"] = frozenset(ALLOWED_ENGINE_ROOMS)

CLUSTER_ENTRY_POINTS = frozenset({"cluster", "cluster.cli", "cluster.serve", "cluster.serve_flags",
                                  "cluster.serve_config", "cluster.serve_warmup"})
ALLOWED_CLUSTER_ROOMS: dict[str, frozenset[str]] = {
    "cluster.backend": frozenset(),
    "cluster.merged_streams": frozenset(),
    "cluster.clients": frozenset(),
    "cluster.api": frozenset({"cluster.backend", "cluster.merged_streams"}),
    "cluster.local": frozenset({"cluster.backend"}),
    "cluster.workers": frozenset(),
    "cluster.coordinator": frozenset({"cluster.backend", "cluster.merged_streams", "cluster.workers"}),
    "cluster.bench": frozenset(),
    "cluster.selftest": frozenset({"cluster.bench"}),
    "cluster.plan": frozenset({"cluster.bench"}),
    "cluster.drivers": frozenset({"cluster.backend", "cluster.api", "cluster.coordinator", "cluster.local",
                                  "cluster.workers"}),
}

FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "engine": frozenset({"ray", "grpc"}),
    "kv_transfer": frozenset({"ray"}),
    "prefill_worker": frozenset({"ray"}),
    "decode_worker": frozenset({"ray"}),
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a dotted module name."""

    importer: str     # the importing module, e.g. "cluster.api.grpc_server"
    imported: str     # e.g. "cluster.backend"
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


def installed_sources(packages=PRODUCT_PACKAGES) -> dict[str, Path]:
    """Module name -> source file for every module of `packages`, found where Python imports them from."""
    sources: dict[str, Path] = {}
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"package {package!r} is not importable")
        sources.update(package_sources(Path(list(spec.submodule_search_locations)[0]), package))
    return sources


def package_sources(package_dir: Path, package: str) -> dict[str, Path]:
    """Module name -> source file for the .py files under `package_dir` (the package named `package`)."""
    sources = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path
    return sources


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import in `path`. `from pkg import name` counts as pkg.name when that is a known module."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, path, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.module, node.level)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append(Import(module, candidate if candidate in known else base, path, node.lineno))
    return found


def _absolute(module: str, is_package: bool, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def violations(sources: dict[str, Path]) -> list[Import]:
    """The imports among `sources` that point against the rules, in file order."""
    known = set(sources)
    found = [imp for module, path in sources.items() for imp in imports_of(module, path, known)]
    return [imp for imp in found if not allowed(imp.importer, imp.imported)]


def allowed(importer: str, imported: str) -> bool:
    """Whether module `importer` may import module `imported` under the rules above."""
    source, target = importer.split(".")[0], imported.split(".")[0]
    if source not in PRODUCT_PACKAGES:
        return True  # deploy/ scripts and tests/ may use anything
    if target not in REPO_PACKAGES:
        return target not in FORBIDDEN_THIRD_PARTY.get(source, frozenset())
    if source == target == "engine":
        return _engine_room_allowed(importer, imported)
    if source == target:
        return source != "cluster" or _cluster_room_allowed(importer, imported)
    return target in ALLOWED_PACKAGES[source] or target in ALLOWED_FOR_MODULE.get(importer, frozenset())


def engine_room(module: str) -> str:
    """engine.core.scheduler -> engine.core; engine.llm -> engine.api; engine.config -> engine.types; a top-level
    module missing from ENGINE_TOP_LEVEL_ROOMS is a room of its own, which has no rules."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and module not in ENGINE_TOP_LEVEL_ROOMS):
        return ".".join(parts[:2])
    return ENGINE_TOP_LEVEL_ROOMS.get(module, module)


def _engine_room_allowed(importer: str, imported: str) -> bool:
    source, target = engine_room(importer), engine_room(imported)
    return source == target or target in ALLOWED_ENGINE_ROOMS.get(source, frozenset())


def cluster_room(module: str) -> str:
    """cluster.api.grpc_server -> cluster.api; cluster.backend -> cluster.backend; cluster -> cluster."""
    return ".".join(module.split(".")[:2])


def _cluster_room_allowed(importer: str, imported: str) -> bool:
    source, target = cluster_room(importer), cluster_room(imported)
    if source == target or source in CLUSTER_ENTRY_POINTS:
        return True
    return target in ALLOWED_CLUSTER_ROOMS.get(source, frozenset())


def import_cycles(sources: dict[str, Path]) -> list[list[str]]:
    """The circles among `sources`: each group of modules that reach one another through their imports (every
    import counts, TYPE_CHECKING ones too), sorted; empty when the graph has no circle. An import of a package
    counts as one of its `__init__`, not of its submodules."""
    known = set(sources)
    graph = {module: sorted({imp.imported for imp in imports_of(module, path, known)} & known - {module})
             for module, path in sources.items()}
    return sorted(sorted(group) for group in _strongly_connected(graph) if len(group) > 1)


def _strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups
