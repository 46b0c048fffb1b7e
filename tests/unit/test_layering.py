"""The import arrows of DESIGN.md, enforced on the source (every import, lazy ones included)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "rollpool"

# subpackage -> the rollpool subpackages it may import
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "broker": {"protocol"},
    "weights": {"protocol"},
    "workers": {"protocol", "weights"},
    "trainer_client": {"protocol", "weights"},
    "integrations": {"trainer_client", "protocol"},  # adapters for other trainers (protocol: the pure message types)
    "monitor": {"protocol"},
    "demo": {"protocol", "broker", "weights", "workers", "trainer_client", "monitor", "launch"},
    "launch": {"protocol", "broker", "weights", "workers", "trainer_client", "monitor"},
    "chaos": {"protocol", "broker", "weights", "workers", "trainer_client", "monitor", "launch"},
    "errors": {"protocol"},
    "__init__": set(),
}
HEAVY = {"torch", "sglang", "transformers", "ray", "safetensors"}
# where each third-party module may be imported (by rollpool subpackage / module path prefix)
THIRD_PARTY_HOMES: dict[str, tuple[str, ...]] = {
    "redis": ("monitor", "cli"),
    "sglang": ("workers/engines/sglang",),
    "torch": ("workers/engines", "weights", "demo", "trainer_client", "chaos"),  # chaos: an application like demo (publishes real tensors)
    "transformers": ("workers/engines", "demo"),
    "safetensors": ("workers/engines", "weights", "demo"),
    "ray": ("launch",),
    "aiohttp": ("workers/episodes", "workers/engines/sglang"),  # the episode endpoint (extra: episodes); the sglang engine and its child
    "trl": ("integrations/trl.py",),  # TRL's async GRPO trainer (extra: trl), imported lazily
}


def _modules() -> list[tuple[str, pathlib.Path]]:
    return [(str(p.relative_to(ROOT)), p) for p in ROOT.rglob("*.py")]


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(imported module, at module top level?) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top_level))
    return out


def _owner(rel: str) -> str:
    head = rel.split("/")[0]
    return head[:-3] if head.endswith(".py") else head


@pytest.mark.parametrize("rel,path", _modules(), ids=lambda x: str(x))
def test_imports_follow_the_arrows(rel: str, path: pathlib.Path) -> None:
    owner = _owner(rel)
    for mod, _top in _imports(path):
        parts = mod.split(".")
        # entry points (`python -m rollpool.x`) are the console script by another name: they may use rollpool.cli
        entry_point = rel.endswith("__main__.py") and mod == "rollpool.cli"
        if parts[0] == "rollpool" and len(parts) > 1 and owner not in ("cli", "__main__") and not entry_point:
            target = parts[1]
            if target in ("errors",):
                target = "protocol"
            if target != owner:
                assert target in ALLOWED.get(owner, set()), f"{rel} imports {mod}: {owner} -> {target} is not an allowed arrow"
        home = THIRD_PARTY_HOMES.get(parts[0])
        if home is not None:
            assert rel.startswith(home), f"{rel} imports {parts[0]}, which may be imported only under {home}"


# inside rollpool/workers: module -> the workers modules it may import (one way; review 2026-12, section 5).
# session and link depend only on protocol; the engines are one node (the Engine seam and its implementations).
WORKER_MODULES: dict[str, set[str]] = {
    "session": set(),
    "link": set(),
    "config": {"engines", "images"},  # WorkerConfig validates engine_options by the engine's options dataclass
    "images": set(),
    "reward": set(),
    "heap": set(),  # the collector's settings of a worker or agent process
    "engines": set(),
    "episodes": {"engines", "images", "heap"},  # the endpoint checks image_url parts by the worker's image rules
    "trajectories": {"engines", "reward"},
    "engine_supervisor": {"engines", "link", "config"},
    "weight_sync": {"engine_supervisor", "link", "engines", "config"},
    "worker": {"weight_sync", "engine_supervisor", "session", "link", "engines", "config", "reward", "trajectories", "episodes", "images", "heap"},
    "__init__": {"episodes"},  # the lazy EpisodeContext export
    "__main__": set(),
}


def _worker_module(rel: str) -> str:
    """``workers/engines/sim.py`` -> ``engines``; ``workers/session.py`` -> ``session``."""
    head = rel.split("/")[1]
    return head[:-3] if head.endswith(".py") else head


def test_the_worker_module_order_is_acyclic() -> None:
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"cycle: {' -> '.join((*path, node))}"
        if node in done:
            return
        for dep in WORKER_MODULES[node]:
            visit(dep, (*path, node))
        done.add(node)

    for node in WORKER_MODULES:
        visit(node, ())


@pytest.mark.parametrize("rel,path", [m for m in _modules() if m[0].startswith("workers/")], ids=lambda x: str(x))
def test_worker_modules_import_one_way(rel: str, path: pathlib.Path) -> None:
    me = _worker_module(rel)
    assert me in WORKER_MODULES, f"{rel}: add its place in the order to WORKER_MODULES"
    for mod, _top in _imports(path):
        parts = mod.split(".")
        if parts[:2] != ["rollpool", "workers"] or len(parts) < 3:
            continue
        target = parts[2]
        if target != me:
            assert target in WORKER_MODULES[me], f"{rel} imports {mod}: workers.{me} -> workers.{target} is not in the order"


# inside rollpool/weights: module -> the weights modules it may import (one way; review 2026-12-05, section 4). The pure
# core (config, manifest) at the bottom; each transport path (paths/) below the facades and never importing them; the
# server half (serving) below the paths' publisher ends; the facades (subscriber, publisher, relay) at the top.
WEIGHT_MODULES: dict[str, set[str]] = {
    "config": set(),
    "adapters": set(),
    "manifest": {"config"},
    "bucketing": {"manifest"},
    "mix64_kernel": set(),
    "native": set(),
    "mix64_native": {"native"},
    "gpu": {"mix64_kernel", "mix64_native"},
    "memory": {"gpu"},
    "delta": set(),
    "diff_kernel": set(),
    "delta_device": {"delta", "diff_kernel", "bucketing", "gpu", "manifest"},
    "delta_gpu": {"delta", "gpu"},
    "paths": set(),  # the package's docstring
    "paths.base": {"delta_gpu"},  # (a type only)
    "paths.network": {"paths.base", "manifest", "bucketing"},
    "paths.lane_native": {"native"},
    "paths.bulk": {"paths.base", "paths.lane_native", "manifest", "bucketing"},
    "paths.delta": {"paths.base", "paths.network", "paths.bulk", "paths.shm", "manifest", "bucketing", "delta", "delta_gpu", "gpu", "memory"},
    "serving": {"paths.base", "paths.bulk", "manifest", "bucketing", "delta", "config", "memory"},
    "snapshot": {"serving", "bucketing", "gpu", "memory"},
    "paths.shm": {"paths.base", "manifest", "bucketing", "gpu", "memory"},
    "paths.ipc_ring": {"paths.base", "manifest", "bucketing", "gpu", "serving", "snapshot", "ring"},
    "paths.cuda_ipc": {"paths.base", "paths.ipc_ring", "manifest", "bucketing", "gpu", "serving", "snapshot"},
    "watch": {"paths.base", "paths.network"},
    "subscriber": {"paths.base", "paths.network", "paths.bulk", "paths.shm", "paths.cuda_ipc", "paths.delta", "manifest", "config",
                   "bucketing", "gpu", "memory", "snapshot", "delta", "delta_gpu", "watch"},
    "publisher": {"serving", "snapshot", "paths.base", "paths.cuda_ipc", "config", "bucketing", "gpu", "memory", "manifest", "adapters",
                  "delta", "delta_device"},
    "ring": set(),
    "relay": {"subscriber", "serving", "paths.base", "manifest", "config", "memory", "delta"},
    "__init__": {"publisher", "subscriber", "relay"},  # the lazy exports
    "__main__": set(),
}


def _weights_module(rel: str) -> str:
    """``weights/paths/bulk.py`` -> ``paths.bulk``; ``weights/paths/__init__.py`` -> ``paths``; ``weights/serving.py`` -> ``serving``."""
    name = rel[len("weights/"):-3].replace("/", ".")
    return name.removesuffix(".__init__")


def test_the_weights_module_order_is_acyclic() -> None:
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"cycle: {' -> '.join((*path, node))}"
        if node in done:
            return
        for dep in WEIGHT_MODULES[node]:
            visit(dep, (*path, node))
        done.add(node)

    for node in WEIGHT_MODULES:
        visit(node, ())


@pytest.mark.parametrize("rel,path", [m for m in _modules() if m[0].startswith("weights/")], ids=lambda x: str(x))
def test_weights_modules_import_one_way(rel: str, path: pathlib.Path) -> None:
    me = _weights_module(rel)
    assert me in WEIGHT_MODULES, f"{rel}: add its place in the order to WEIGHT_MODULES"
    for mod, _top in _imports(path):
        parts = mod.split(".")
        if parts[:2] != ["rollpool", "weights"] or len(parts) < 3:
            continue
        target = ".".join(parts[2:])
        if target != me:
            assert target in WEIGHT_MODULES[me], f"{rel} imports {mod}: weights.{me} -> weights.{target} is not in the order"


@pytest.mark.parametrize("rel,path", [m for m in _modules() if m[0].startswith(("protocol/", "broker/"))], ids=lambda x: str(x))
def test_protocol_and_broker_import_nothing_heavy(rel: str, path: pathlib.Path) -> None:
    for mod, top in _imports(path):
        root = mod.split(".")[0]
        assert root not in HEAVY, f"{rel} imports {mod}"
        if rel.startswith("protocol/") and top:
            assert root not in ("zmq", "redis"), f"{rel} imports {mod} at module level"


def test_import_protocol_works_without_redis_zmq_or_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('redis', 'zmq', 'torch', 'sglang', 'transformers'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import rollpool.protocol, rollpool.errors\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
