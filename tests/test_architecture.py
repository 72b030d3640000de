"""The architecture, checked from the code's own imports (every ``import`` statement, at any
depth, parsed with ``ast``): layers only import downwards, no module imports itself back through
others, and each collective library is called from its one module."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Sub-packages of hvd_lm, lowest first: a module may import its own layer and those below.
LAYERS = ["util", "options", "formats", "model", "comm", "install", "train", "transfer", "jobs",
          "perf", "cli"]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("hvd_lm", "data_prep"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            mods[module_name(path)] = path
    return mods


def imports_of(path: Path) -> set[str]:
    """Every module named by an import statement in ``path`` (``from a import b`` counts ``a``
    and, when ``a.b`` is a module, ``a.b``)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def project_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def layer(mod: str) -> int | None:
    parts = mod.split(".")
    if parts[0] != "hvd_lm" or len(parts) < 2:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def test_the_tree_has_the_documented_layers():
    pkgs = {p.name for p in (REPO / "hvd_lm").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert pkgs == set(LAYERS) - {"cli"}
    flat = {p.stem for p in (REPO / "hvd_lm").glob("*.py")}
    assert flat == {"__init__", "__main__", "cli"}


def test_no_import_loop():
    graph = project_graph()
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n] if n in stack else [m, n]
                pytest.fail("import loop: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_imports_only_run_down_the_layers():
    bad = []
    for m, deps in project_graph().items():
        lm = layer(m)
        if lm is None:
            continue
        for d in deps:
            ld = layer(d)
            if ld is not None and ld > lm:
                bad.append(f"{m} ({LAYERS[lm]}) imports {d} ({LAYERS[ld]})")
    assert not bad, "\n".join(bad)


def test_data_prep_builds_on_the_ground_floors_and_the_launcher_only():
    """data_prep (the offline tool beside the library) uses util, options, formats and the
    launcher environment / MPI of comm; the library never imports it (but the CLI and the
    demo, which run it)."""
    graph = project_graph()
    allowed = ("hvd_lm.util", "hvd_lm.options", "hvd_lm.formats", "hvd_lm.comm.world",
               "hvd_lm.comm.mpi")
    for m, deps in graph.items():
        if m.startswith("data_prep"):
            up = {d for d in deps if d.startswith("hvd_lm.") and d != "hvd_lm.comm"  # package
                  and not d.startswith(allowed)}
            assert not up, f"{m} imports {sorted(up)}"
        elif m.startswith("hvd_lm"):
            dp = {d for d in deps if d.startswith("data_prep")}
            assert not dp or m in ("hvd_lm.cli", "hvd_lm.jobs.demo"), f"{m} imports {dp}"


@pytest.mark.parametrize("library,owners", [
    ("horovod", {"hvd_lm.comm.horovod"}),
    ("mpi4py", {"hvd_lm.comm.mpi", "hvd_lm.perf.baselines"}),
    ("torch.distributed", {"hvd_lm.comm.torch_engine", "hvd_lm.perf.baselines"}),
])
def test_each_collective_library_has_one_caller(library, owners):
    """Horovod is called from hvd_lm.comm.horovod only; mpi4py from hvd_lm.comm.mpi and the
    raw-MPI baseline; torch.distributed from the torch engine (hvd_lm.comm.torch_engine: its one
    caller in the library) and otherwise only from the baselines the benchmarks compare the
    engines with."""
    users = set()
    for m, path in project_modules().items():
        names = imports_of(path)
        if any(n == library or n.startswith(library + ".") for n in names):
            users.add(m)
    assert users <= owners, f"{library} imported by {sorted(users - owners)}"


MAX_LINES = 500


def test_no_module_is_over_the_limit():
    """A module over 500 lines is where concerns pile up (data_prep/pipeline.py once reached
    1,020): split it at its seams. No exceptions: the tests and their helpers too (six test
    files had grown to 522-909 lines)."""
    files = [*project_modules().values(), *sorted((REPO / "tests").rglob("*.py"))]
    over = {str(p.relative_to(REPO)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines: {over}"


#: Names two tools (the library and data_prep, the tool beside it) use for the same thing.
SAME_MEANING = {"cli": "the tool's command line", "settings": "the tool's settings tree",
                "resume": "continuing the tool's interrupted run"}


def test_module_names_mean_one_thing():
    """No two modules share a name for different things (a reader who meets ``launch`` or
    ``config`` must not have to ask which one): a shared name is one of :data:`SAME_MEANING`,
    once per tool."""
    seen: dict[str, list[str]] = {}
    for m in project_modules():
        leaf = m.rsplit(".", 1)[-1]
        if leaf not in ("__init__", "__main__", "hvd_lm", "data_prep"):
            seen.setdefault(leaf, []).append(m)
    shared = {k: v for k, v in seen.items() if len(v) > 1}
    assert set(shared) <= set(SAME_MEANING), shared
    for name, mods in shared.items():
        assert sorted(m.split(".")[0] for m in mods) == ["data_prep", "hvd_lm"], mods


def test_a_step_is_read_in_three_files():
    """Following one step of ``hvd-lm train`` means reading the loop, the step and the Horovod
    module: what train_step imports from the project, besides data classes and configuration,
    is the comm package (whose functions are comm/horovod.py's: ``comm.synchronize``,
    ``comm.skip_synchronize``), the device's autocast and the data's batch. That the loop and
    the benchmarks call it, once per step: tests/test_step_order.py."""
    graph = project_graph()
    step_deps = {d for d in graph["hvd_lm.train.step"]
                 if d not in ("hvd_lm", "hvd_lm.model", "hvd_lm.train")}
    assert step_deps <= {"hvd_lm.comm", "hvd_lm.model.device", "hvd_lm.train.data"}, step_deps
