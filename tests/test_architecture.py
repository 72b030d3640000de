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
          "cli"]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("hvd_lm", "data_prep", "benchmarks"):
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
    demo, which run it, and transfer's dataset loader, which reads Blitzer .review files with
    prepare's own reader: one owner of the input formats)."""
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
            assert not dp or m in ("hvd_lm.cli", "hvd_lm.jobs.demo", "hvd_lm.transfer.datasets"), \
                f"{m} imports {dp}"


def test_the_benchmarks_stand_beside_the_installed_package():
    """benchmarks/ (the benchmarks and the scaling study, run from a checkout) builds on hvd_lm
    and data_prep; neither imports it, and pip installs hvd_lm and data_prep only (a top-level
    ``tools`` or ``benchmarks`` package would collide with other projects')."""
    import tomllib
    up = {m: sorted(d for d in deps if d.split(".")[0] == "benchmarks")
          for m, deps in project_graph().items() if not m.startswith("benchmarks")}
    assert not any(up.values()), {m: d for m, d in up.items() if d}
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert find["packages"]["find"]["include"] == ["hvd_lm*", "data_prep*"]


@pytest.mark.parametrize("library,owners", [
    ("horovod", {"hvd_lm.comm.engine"}),
    ("mpi4py", {"hvd_lm.comm.mpi", "benchmarks.baselines"}),
    ("torch.distributed", {"hvd_lm.comm.torch_engine", "benchmarks.baselines"}),
])
def test_each_collective_library_has_one_caller(library, owners):
    """Horovod is called from hvd_lm.comm.engine only; mpi4py from hvd_lm.comm.mpi and the
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
    """Following one step of ``hvd-lm train`` means reading the loop, the step and the engine,
    checked by following the calls, not only the imports: every project function a real step
    calls (traced with ``sys.setprofile`` through ``train_step`` of a tiny LM, k = 2, Adam on
    the CPU) lives in train/step.py, the engine (comm: the facade and the engine under it),
    the model's own forward (model/) or the data's batch; no call goes back out of the step
    to the loop's components (counting, metrics, checkpointer). And the loop calls the step's
    two halves itself, counting the previous step between them (its syntax tree)."""
    import sys

    import torch

    from hvd_lm.model.config import ModelConfig
    from hvd_lm.model.lm import LanguageModel
    from hvd_lm.train import step
    from hvd_lm.train.data import Batch

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(hidden_size=8, embed_dim=4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 9))
    batch = Batch(x[:, :-1], x[:, 1:], torch.zeros(2, 8, dtype=torch.bool), 16)
    called: set[str] = set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if (event == "call" and name.startswith(str(REPO / "hvd_lm"))
                and frame.f_code.co_name != "<module>"):  # not a module's first import
            called.add(Path(name).relative_to(REPO).as_posix())

    def one_step():
        step.train_step(model, opt, torch.amp.GradScaler("cpu", enabled=False), [batch, batch],
                        model.init_state(2), step.StepSpec(torch.device("cpu"), k=2))

    one_step()  # untraced: what a first step imports (module-level code) is not the step
    sys.setprofile(profile)
    try:
        one_step()
    finally:
        sys.setprofile(None)
    assert "hvd_lm/train/step.py" in called and "hvd_lm/model/lm.py" in called
    others = {f for f in called if not f.startswith(("hvd_lm/model/", "hvd_lm/comm/"))}
    assert others <= {"hvd_lm/train/step.py", "hvd_lm/train/data.py"}, others

    tree = ast.parse((REPO / "hvd_lm/train/loop.py").read_text())
    steps = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "steps")
    calls = [ast.unparse(c.func) for c in ast.walk(steps) if isinstance(c, ast.Call)]
    calls = [c for c in calls if c in ("step.backward", "counter.settle", "step.update")]
    assert calls == ["step.backward", "counter.settle", "step.update"], calls


# ---- reading a path: hvd_lm/util/files.py is the one owner --------------------------------------

#: Modules whose ``open(PATH)`` opens a file (a bare ``open`` is the builtin).
_OPENERS = {"io", "os", "gzip", "bz2", "lzma", "tarfile", "codecs"}
#: ``module.function`` calls that read a path.
_LOADERS = {("np", "load"), ("numpy", "load"), ("json", "load"), ("h5py", "File"),
            ("torch", "load"), ("np", "fromfile")}

#: Every read of a path outside hvd_lm/util/files.py, as ``(file, call(first argument))``, and
#: why it may read on its own. What a user, a cache or an environment variable names goes through
#: files.py (a regular file only, a size cap per kind, streamed where large); the reads here
#: touch only what the command itself wrote, the kernel's /proc and /sys files, the package's own
#: files, or (the last group) a path its caller has already checked with files.py. An entry no
#: longer in the code fails the test too, so the list stays the list.
OWN_READS = {
    # ---- /proc, /sys and /dev: the kernel's files of this process and machine
    ("hvd_lm/comm/threads.py", "open(BOOT_ID)"): "/proc/sys/kernel/random/boot_id",
    ("hvd_lm/model/mfu.py", "open('/proc/cpuinfo')"): "the CPU model, for the peak's key",
    ("hvd_lm/train/deadline.py", "os.open(os.devnull)"): "/dev/null, written to",
    # ---- what the command itself writes, in its own folders
    ("hvd_lm/util/atomic.py", "os.open(directory)"): "fsync of the folder it renamed into",
    ("hvd_lm/util/atomic.py", "open(part)"):
        "its own temporary file (or each file of an exported folder), before the rename",
    ("hvd_lm/formats/shards.py", "h5py.File(tmp)"): "the shard writer's temporary file",
    ("hvd_lm/jobs/download.py", "open(tmp)"): "the download's temporary file, written",
    ("hvd_lm/jobs/demo.py", "lm_json.read_text()"): "the demo's eval output, in its folder",
    ("hvd_lm/jobs/demo.py", "summary_json.read_text()"): "the demo's prepare summary",
    ("hvd_lm/jobs/demo.py", "(transfer_dir / 'transfer.json').read_text()"): "its transfer",
    ("hvd_lm/jobs/report.py", "(t / 'transfer.md').read_text()"): "the demo's transfer folder",
    ("benchmarks/bench_fusion.py", "Path(path).read_text()"): "the autotune log it asked for",
    ("benchmarks/bench_fusion.py", "log.read_text()"): "the autotune log it asked for",
    ("benchmarks/bench_transfer.py", "np.load(cfg.worker)"): "the problem its driver wrote",
    ("benchmarks/control_plane.py", "open('/proc/self/smaps')"): "this process's memory",
    ("benchmarks/bench_prepare.py", "open(tmp)"): "the corpus the bench writes",
    ("benchmarks/bench_prepare.py", "meta_path.read_text()"): "the bench corpus's own description",
    ("benchmarks/bench_prepare.py", "gzip.open(path)"): "the corpus the bench wrote",
    ("data_prep/pipeline.py", "(work / 'map' / f'u{u:05d}' / 'stats.json').read_text()"):
        "prepare's work folder (OUT/.prepare)",
    ("data_prep/pipeline.py", "(work / 'sorted' / f'b{b:05d}' / 'stats.json').read_text()"):
        "prepare's work folder",
    ("data_prep/plan.py", "np.load(work / 'sorted' / f'b{b:05d}' / 'lengths.npy')"): "work",
    ("data_prep/plan.py", "open(bdir / 'data.bin')"): "prepare's work folder",
    ("data_prep/plan.py", "np.load(bdir / 'lengths.npy')"): "prepare's work folder",
    ("data_prep/sort.py", "open(self.dir / f'b{b:05d}.idx')"): "prepare's spill files",
    ("data_prep/sort.py", "open(self.dir / f'b{b:05d}.dat')"): "prepare's spill files",
    ("data_prep/sort.py", "np.fromfile(ix)"): "prepare's spill files",
    ("data_prep/sort.py", "np.fromfile(fi)"): "prepare's spill files",
    ("data_prep/sort.py", "open(dt)"): "prepare's spill files",
    ("data_prep/sort.py", "open(ix)"): "prepare's spill files",
    ("data_prep/sort.py", "open(ix_path)"): "prepare's spill files",
    ("data_prep/sort.py", "open(dt_path)"): "prepare's spill files",
    ("data_prep/sort.py", "open(part / 'data.bin')"): "prepare's sorted buckets, written",
    # ---- the package's own files, and the toolchain an install builds with
    ("hvd_lm/jobs/doctor_agent.py", "p.read_bytes()"): "hvd_lm's sources, for their digest",
    ("hvd_lm/jobs/job_scripts.py", "(templates / SCHEDULERS[spec.scheduler]).read_text()"):
        "the package's launch/ templates (HVD_LM_LAUNCH_DIR: the tests' copy)",
    # ---- a path its caller has checked with files.py (or is_file) first
    ("hvd_lm/formats/checkpoint.py", "open(latest)"): "after is_file(); 256 bytes read",
    ("hvd_lm/formats/checkpoint.py", "torch.load(path)"): "after open_regular and zip checks",
    ("hvd_lm/formats/shards.py", "h5py.File(path)"): "after check_regular (_open_h5)",
    ("hvd_lm/transfer/datasets.py", "tarfile.open(p)"): "after is_file(); streamed members",
    ("hvd_lm/util/digest.py", "open(path)"): "hashes what its caller opened or wrote",
    ("data_prep/gzip_blocks.py", "open(path)"): "an input, after sniff's check_regular",
    ("data_prep/pipeline.py", "open(spec.path)"): "an input, after sniff's check_regular",
    ("data_prep/tars.py", "tarfile.open()"): "fileobj= the stream open_regular opened",
}


def path_reads(path: Path) -> list[str]:
    """Every call in ``path`` that opens or reads a path, as ``call(first argument)``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        module = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
            else None
        if (isinstance(f, ast.Name) and f.id == "open") or (isinstance(f, ast.Attribute) and (
                f.attr in ("read_text", "read_bytes") or (module in _OPENERS and f.attr == "open")
                or (module, f.attr) in _LOADERS)):
            out.append(f"{ast.unparse(f)}({ast.unparse(node.args[0]) if node.args else ''})")
    return out


def test_every_read_of_a_path_goes_through_files_py():
    """``open(``, ``.read_text(``, ``.read_bytes(``, ``np.load(``, ``json.load(``,
    ``h5py.File(`` (and gzip/tarfile/os opens, ``torch.load``, ``np.fromfile``) in hvd_lm/ and
    data_prep/ outside hvd_lm/util/files.py are the reads of :data:`OWN_READS` only: a FIFO a
    user names blocks a bare ``open`` and ``/dev/zero`` never ends, so a new reader of a user's,
    a cache's or an environment variable's path must use files.py (issue 56: prepare --resume,
    the CPU peak cache, metrics.jsonl, --hostfile and the feature cache read on their own)."""
    seen, stray = set(), []
    for p in project_modules().values():
        rel = str(p.relative_to(REPO))
        if rel == "hvd_lm/util/files.py":
            continue
        for call in path_reads(p):
            (seen.add if (rel, call) in OWN_READS else stray.append)((rel, call))
    assert not stray, "reads a path on its own (use hvd_lm/util/files.py, or add it to " \
        f"OWN_READS with why): {stray}"
    stale = set(OWN_READS) - seen
    assert not stale, f"OWN_READS lists reads no longer in the code: {sorted(stale)}"
