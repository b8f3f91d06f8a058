"""Imports point one way (engine <- kv_transfer <- workers <- cluster <- deploy), engine/'s and cluster/'s rooms
keep theirs, and no modules import one another in a circle: the real import graph has no arrow against the
rules of tests/support/import_graph.py and no circle, and the checker does catch each kind of wrong arrow, and a
circle, when one is planted."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.import_graph import (ALLOWED_CLUSTER_ROOMS, ALLOWED_ENGINE_ROOMS, CLUSTER_ENTRY_POINTS,
                                        PRODUCT_PACKAGES, cluster_room, engine_room, import_cycles,
                                        installed_sources, package_sources, violations)


def test_imports_point_one_way():
    sources = installed_sources()
    assert {module.split(".")[0] for module in sources} >= set(PRODUCT_PACKAGES)
    assert len(sources) > 100, "the walk found too few modules to mean anything"
    found = violations(sources)
    assert not found, "imports against the direction:\n" + "\n".join(map(str, found))


def test_every_cluster_room_has_rules():
    """A new subpackage or top-level module of cluster/ must be added to the room table (or be an entry point)."""
    rooms = {cluster_room(module) for module in installed_sources(("cluster",))}
    assert rooms - CLUSTER_ENTRY_POINTS == set(ALLOWED_CLUSTER_ROOMS)


def test_every_engine_room_has_rules():
    """A new subpackage or top-level module of engine/ must be added to the room tables."""
    rooms = {engine_room(module) for module in installed_sources(("engine",))}
    assert rooms == set(ALLOWED_ENGINE_ROOMS)


def test_no_import_circles():
    circles = import_cycles(installed_sources())
    assert not circles, f"modules that import one another in a circle: {circles}"


def _plant(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for parent in path.relative_to(root).parents:
            if parent != Path("."):
                (root / parent / "__init__.py").touch()
    sources: dict[str, Path] = {}
    for package in {Path(relative).parts[0] for relative in files}:
        sources.update(package_sources(root / package, package))
    return sources


def test_checker_reports_each_kind_of_wrong_arrow(tmp_path):
    sources = _plant(tmp_path, {
        "engine/model/causal_lm.py": "def f():\n    from cluster.api import grpc_server\n",  # engine -> cluster
        "engine/config.py": "",
        "engine/sequence.py": "from engine.kv import block_allocator\n",                   # types -> kv
        "engine/kv/block_allocator.py": "from engine.config import C\n",                     # allowed
        "engine/core/scheduler.py": "from engine.kv.block_allocator import B\nfrom engine import sequence\n",
        "engine/runner/model_runner.py": "from engine.core.scheduler import S\nfrom engine.model import x\n",
        "kv_transfer/manifest.py": "import engine.config\n",                                 # only the pool glue may
        "kv_transfer/engine_pool.py": "from engine import config\nimport proto\n",           # allowed
        "prefill_worker/worker.py": "import decode_worker.worker\nimport deploy.job\n",      # sibling; deploy
        "decode_worker/worker.py": "import ray\nfrom kv_transfer import manifest\n",          # no Ray; allowed
        "cluster/backend.py": "",
        "cluster/api/grpc_server.py": "from ..backend import x\nfrom cluster.coordinator import start\n",
        "cluster/coordinator/start.py": "from ..workers import launch\n",                     # allowed (relative)
        "cluster/workers/launch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from cluster.coordinator.start import y\n",          # workers -> coordinator
        "cluster/serve.py": "import cluster.api.grpc_server, cluster.workers.launch, tests.support\n",
        "deploy/job.py": "import cluster.serve\nimport tests\n",                               # scripts: anything
    })
    found = {(v.importer, v.imported) for v in violations(sources)}
    assert found == {
        ("engine.model.causal_lm", "cluster.api.grpc_server"),
        ("engine.sequence", "engine.kv.block_allocator"),
        ("engine.runner.model_runner", "engine.core.scheduler"),
        ("kv_transfer.manifest", "engine.config"),
        ("prefill_worker.worker", "decode_worker.worker"),
        ("prefill_worker.worker", "deploy.job"),
        ("decode_worker.worker", "ray"),
        ("cluster.api.grpc_server", "cluster.coordinator.start"),
        ("cluster.workers.launch", "cluster.coordinator.start"),
        ("cluster.serve", "tests.support"),
    }


def test_checker_finds_a_planted_circle(tmp_path):
    sources = _plant(tmp_path, {
        "engine/text/tokenizer.py": "from engine.text.detokenizer import D\n",
        "engine/text/detokenizer.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from engine.text.tokenizer import T\n",
        "engine/text/chat_template.py": "from engine.text import tokenizer\n",               # into the circle only
    })
    assert import_cycles(sources) == [["engine.text.detokenizer", "engine.text.tokenizer"]]


def test_every_package_says_what_it_is_for():
    """Each package's __init__.py opens with a docstring (what the room owns, which process it runs in)."""
    packages = {m: p for m, p in installed_sources().items() if p.name == "__init__.py"}
    assert "cluster.api" in packages and "kv_transfer.grpc" in packages
    silent = [m for m, p in packages.items() if len(ast.get_docstring(ast.parse(p.read_text())) or "") < 40]
    assert not silent, f"packages without a docstring saying what they are for: {silent}"
