"""Which module may import which (docs/architecture.md): arrows point down the table, never back up, and only
the engine package talks to DeepSpeed. Read from the source (ast), so a lazy import inside a function counts too."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "rlhf_engine")

# room -> the rooms it may import (besides the standard library, torch and third-party model/data libraries)
ALLOWED = {
    "errors": set(),
    "comm": set(),
    "logit_kernels": set(),
    "ppo_math": {"logit_kernels"},
    "estimators": {"ppo_math"},
    "policy_losses": {"ppo_math"},
    "config": {"errors", "ppo_math", "estimators", "policy_losses"},  # (lazily: the registered names)
    "rollout": {"ppo_math"},
    "packing": set(),
    "hf_fields": set(),
    "pretrained": {"errors"},
    "assets": {"pretrained"},
    "faults": set(),
    "signals": set(),
    "hooks": {"faults"},
    "plugins": set(),
    "rewards": {"errors", "hf_fields", "plugins", "rollout", "engine"},  # engine: only the served reward model (scorers.py, lazily)
    "envs": {"comm", "plugins", "rollout", "rewards"},
    "outputs": {"errors"},
    "data": {"comm", "config", "errors", "rollout", "pretrained"},
    "servers": set(),  # rollout servers: HTTP client, pool, weight push, the vLLM extension (torch, vLLM, stdlib)
    "engine": {"comm", "config", "errors", "hf_fields", "hooks", "packing", "ppo_math", "pretrained", "rollout",
               "servers"},  # pretrained: the built-in model names (generation/choice.py reads the actor's config)
    "trainer": {"comm", "config", "data", "engine", "envs", "errors", "estimators", "hf_fields", "outputs", "policy_losses",
                "ppo_math", "pretrained",
                "rewards", "rollout", "faults", "hooks", "signals"},
    "cli": {"comm", "config", "engine", "errors", "rewards", "signals"},
}


def _sources(root: str):
    """(path relative to root, parsed module) of every .py file of the package below `root`."""
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                yield os.path.relpath(path, root), ast.parse(open(path).read())


def _imports():
    """(importing room, imported module) for every import statement of the package."""
    out = []
    for rel_path, tree in _sources(ROOT):
        rel = rel_path[:-3].split(os.sep)
        pkg = rel if rel[-1] == "__init__" else rel[:-1]
        pkg = [p for p in pkg if p != "__init__"]
        room = rel[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                    names = base + (node.module.split(".") if node.module else [])
                    if not node.module:  # `from .. import faults`
                        out += [(room, ".".join(["rlhf_engine", *names, a.name])) for a in node.names]
                        continue
                    out.append((room, ".".join(["rlhf_engine", *names])))
                else:
                    out.append((room, node.module or ""))
            elif isinstance(node, ast.Import):
                out += [(room, a.name) for a in node.names]
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_runs_back_up():
    bad = sorted({(room, target) for room, target in _imports() if target.startswith("rlhf_engine.")
                  and _room(target) != room and _room(target) not in ALLOWED.get(room, set())})
    assert not bad, f"imports against the layering (room -> module): {bad}"


def test_only_the_engine_imports_deepspeed():
    bad = sorted({room for room, target in _imports() if target.split(".")[0] == "deepspeed" and room != "engine"})
    assert not bad, bad


@pytest.mark.parametrize("room", ["ppo_math", "logit_kernels", "estimators", "policy_losses", "comm"])
def test_the_math_rooms_import_torch_only(room):
    """Besides the standard library, the rooms of their own row and their own modules (a package room), torch only."""
    ours = {t for r, t in _imports() if r == room and t.startswith("rlhf_engine.")}
    third = {t.split(".")[0] for r, t in _imports() if r == room and not t.startswith("rlhf_engine.")}
    assert third - {"__future__", "dataclasses", "typing", "math", "datetime"} <= {"torch"}, third
    assert {_room(t) for t in ours} - {room} <= ALLOWED[room], ours


def test_negative_control_a_trainer_import_in_the_engine_is_caught(tmp_path, monkeypatch):
    """The check itself can fail: an engine module importing the trainer is reported."""
    import shutil

    copy = tmp_path / "rlhf_engine"
    shutil.copytree(ROOT, copy)
    with open(copy / "engine" / "zero3.py", "a") as f:
        f.write("\nfrom ..trainer import plan  # noqa\n")
    monkeypatch.setitem(globals(), "ROOT", str(copy))
    with pytest.raises(AssertionError, match="engine"):
        test_no_import_runs_back_up()


# torch.distributed calls that talk to other ranks: only rlhf_engine/comm.py makes them (it puts every tensor on the
# device the group's backend serves; a CPU tensor under NCCL is refused)
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
               "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
               "all_to_all", "all_to_all_single", "new_group", "destroy_process_group"}


def _collective_calls(root: str) -> list:
    """(file, line, name) of every torch.distributed collective named outside comm.py: `torch.distributed.X`,
    `<alias of torch.distributed>.X`, and `from torch.distributed import X`."""
    out = []
    for rel, tree in _sources(root):
        if rel == "comm.py":
            continue
        aliases = {"torch.distributed"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
            elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                out += [(rel, node.lineno, a.name) for a in node.names if a.name in COLLECTIVES]
            elif isinstance(node, ast.ImportFrom) and node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and ast.unparse(node.value) in aliases:
                out.append((rel, node.lineno, node.attr))
    return out


def test_only_comm_calls_collectives():
    bad = _collective_calls(ROOT)
    assert not bad, f"collectives outside rlhf_engine/comm.py (use comm's, which place tensors by backend): {bad}"


@pytest.mark.parametrize("line", ["torch.distributed.all_reduce(flags)\n",
                                  "import torch.distributed as td\ntd.barrier()\n",
                                  "from torch.distributed import broadcast_object_list\n"])
def test_negative_control_a_collective_outside_comm_is_caught(tmp_path, line):
    import shutil

    copy = tmp_path / "rlhf_engine"
    shutil.copytree(ROOT, copy)
    with open(copy / "trainer" / "preemption.py", "a") as f:
        f.write("\n" + line)
    assert [c[0] for c in _collective_calls(str(copy))] == [os.path.join("trainer", "preemption.py")]


# ---- no circles inside a room ----------------------------------------------------------------------------------------
def _module_graph(root: str) -> dict:
    """module -> the package's modules it imports (every import statement, lazy ones too), by dotted name below
    `root` ('engine.generation.hf'; a package is its __init__: 'engine.generation')."""
    files = {}
    for rel_path, tree in _sources(root):
        parts = rel_path[:-3].split(os.sep)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        files[name] = (tree, parts[:-1] if is_pkg else parts[:-1])
    graph = {}
    for name, (tree, pkg) in files.items():
        edges = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = pkg[:len(pkg) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # `from . import hf`: the submodule when there is one
                sub = ".".join(target + [alias.name])
                edges.add(sub if sub in files else ".".join(target))
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def _circles(graph: dict) -> list:
    """Import cycles among modules of one room (the first name part), each as its path."""
    found, state = [], {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.split(".")[0] != node.split(".")[0]:
                continue
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_circles_inside_a_room():
    assert _circles(_module_graph(ROOT)) == []


def test_negative_control_a_circle_inside_a_room_is_caught(tmp_path):
    """The shape generation/ had: the package builds its registry from a backend that imports the package back."""
    pkg = tmp_path / "engine" / "generation"
    pkg.mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("class Base:\n    pass\n\n\ndef registry():\n    from .hf import HF\n"
                                     "    return {'hf': HF}\n")
    (pkg / "hf.py").write_text("from . import Base\n\n\nclass HF(Base):\n    pass\n")
    assert _circles(_module_graph(str(tmp_path))) == [["engine.generation", "engine.generation.hf",
                                                       "engine.generation"]]
