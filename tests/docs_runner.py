"""How tests/test_docs.py meets a docs page's shell commands: each command extracted from the
fenced ``bash`` blocks (mktestdocs), then run, checked by its own parser, or named, as that
module's docstring lays out; the session carries what earlier blocks wrote."""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mktestdocs
import yaml

from tests import _warm
from tests._mp import REPO

CORES = 2                    # ranks are capped here; more needs a documented way (see above)
#: Inputs no block can create, each with the reason (user files and cluster outputs).
EXTERNAL = {
    "runs/scaling/g*": "written by the sweep's jobs on a SLURM cluster",
    ".whl": "the wheel folder a GPU node's session carries (scripts/gpu_check.sh)",
    ".gpu/shards": "written by scripts/gpu_data.sh (the card's data: every shared review file)",
    ".gpu/sst2": "written by scripts/gpu_data.sh (SST-2 beside the card's shards)",
    "/shared/fs/data": "an output folder on a cluster's shared filesystem",
    "/shared/fs/out": "an output folder on a cluster's shared filesystem",
    "data/imdb_train.jsonl": "written by the Python heredoc just before it (a GPU node's block)",
    "generating-reviews-discovering-sentiment/model": "OpenAI's released weights, which a user "
    "clones from GitHub (tests never download them)",
}
OUTPUT_FLAGS = {"--out", "--out-dir", "--json", "--plot", "-o", "--output", "--heatmap"}
#: Flags whose value looks like a path but is not one (globs over a tar archive's members).
PATTERN_FLAGS = {"--tar-members"}
#: hvd-lm commands whose last positional argument is the folder they write.
POSITIONAL_OUTPUT = {"export", "import-openai"}
PATHLIKE = re.compile(r"/|\.(ya?ml|json|jsonl|csv|tsv|gz|sbatch|qsub|sh|txt|pt|png)$")
#: Templates that run on this machine as they are (the rest need hosts or a scheduler).
LOCAL_TEMPLATES = {"horovodrun_local.sh", "mpirun.sh", "horovodrun_elastic.sh", "torchrun.sh"}
REMOTE_KNOBS = {"HOSTS", "HOSTFILE", "DISCOVERY"}


@dataclass
class Cmd:
    """One simple command of a block: where it is, its environment prefix and its words."""

    doc: str
    line: int
    text: str
    env: dict[str, str]
    argv: list[str]
    shell: bool = False          # has a redirection: run through bash as written
    gpu: bool = False            # its block needs a CUDA GPU (`--device cuda`, `-m cuda`)

    def where(self) -> str:
        return f"{self.doc}:{self.line}: `{self.text.strip()}`"


@dataclass
class Session:
    """The clone the blocks run in, the shell variables set so far, what checked commands
    would have written, and a log of what was run or checked (printed on failure)."""

    root: Path
    env: dict[str, str]
    variables: dict[str, str] = field(default_factory=dict)
    produced: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)


# ---- extraction ----------------------------------------------------------------------------------
def _expand_braces(word: str) -> list[str]:
    m = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not m:
        return [word]
    return [y for alt in m.group(1).split(",")
            for y in _expand_braces(word[:m.start()] + alt + word[m.end():])]


def commands(doc: str) -> list[Cmd]:
    """The simple commands of every ``bash`` block of ``doc`` (continuations joined, comments
    dropped, ``&&`` lists split, ``{a,b}`` alternatives expanded into one command each)."""
    text = (REPO / doc).read_text()
    out = []
    pos = 0
    for block in mktestdocs.grab_code_blocks(text, lang="bash"):
        start = text.index(block, pos)
        pos = start + len(block)
        line0 = text.count("\n", 0, start) + 1
        gpu = bool(re.search(r"--device cuda|-m cuda\b", block))
        if gpu or re.search(r"^\s*(for|while|if) |<<", block, re.M):
            check = subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True)
            assert check.returncode == 0, f"{doc}:{line0}: bash -n: {check.stderr}"
        logical = re.sub(r"\\\n\s*", " ", block)
        heredoc, pending = None, ""
        for i, line in enumerate(logical.splitlines()):
            if heredoc:                               # a heredoc's body is not shell
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
            if m:
                heredoc = m.group(1)
            line = re.sub(r"^\s*for \w+ in .*; do\s*$|^\s*done\s*$", "", line)
            line, pending = pending + line, ""
            try:
                words = shlex.split(line, comments=True)
            except ValueError:                        # a quoted string goes on: next line too
                pending = line + "\n"
                continue
            if not words:
                continue
            shell = any(w.startswith(">") for w in words)
            parts: list[list[str]] = [[]]
            for w in words:
                if w in ("&&", ";"):
                    parts.append([])
                else:
                    parts[-1].append(w)
            for part in parts:
                env = {}
                while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):
                    k, v = part.pop(0).split("=", 1)
                    env[k] = v
                alts = [[]]
                for w in part:
                    alts = [a + [x] for a in alts for x in _expand_braces(w)]
                for argv in alts:
                    out.append(Cmd(doc, line0 + i, line, env, argv, shell, gpu))
    return out


# ---- classification helpers ----------------------------------------------------------------------
def _expand(word: str, s: Session) -> list[str]:
    word = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                  lambda m: s.variables.get(m.group(1), m.group(0)), word)
    if any(c in word for c in "*?[") and not _placeholder(word):
        return sorted(glob.glob(word, root_dir=s.root)) or [word]   # bash: no match, kept as is
    return [word]


def _placeholder(word: str) -> bool:
    """``...``, ``FILES...`` or a variable no earlier line set (a loop's ``$B``)."""
    return "..." in word or "$" in word


def _hvd_lm_argv(argv: list[str]) -> list[str] | None:
    """``hvd-lm`` arguments for an hvd_lm / data_prep command line, else None."""
    prog = Path(argv[0]).name
    if prog == "hvd-lm":
        return argv[1:]
    if prog.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        prefix = {"hvd_lm": [], "data_prep": [], "hvd_lm.transfer": ["transfer"],
                  "benchmarks": ["bench"]}.get(argv[2])   # python -m benchmarks NAME ...
        return None if prefix is None else [*prefix, *argv[3:]]
    return None


def _split_launcher(argv: list[str]) -> tuple[list[str], list[str], dict]:
    """(launcher words, inner command, facts) for horovodrun / mpirun / torchrun lines, else
    ([], argv, {}). horovodrun and torchrun are parsed by their own parsers; mpirun by OpenMPI's
    option arities."""
    prog = Path(argv[0]).name
    if prog == "torchrun":
        from torch.distributed.run import get_args_parser
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = get_args_parser().parse_args(argv[1:])
        except SystemExit:
            raise AssertionError(f"torchrun rejects {argv[1:]}: {err.getvalue()}") from None
        script = [args.training_script, *args.training_script_args]
        inner = (["python", "-m", *script] if args.module else
                 script if args.no_python else ["python", *script])
        n = int(args.nproc_per_node) * int(str(args.nnodes).split(":")[-1])
        hosts = "localhost" if args.standalone or str(args.nnodes) == "1" else \
            args.rdzv_endpoint or "several hosts"
        return (argv[:len(argv) - len(script)], inner,   # "exec": the words torchrun runs
                {"np": n, "hosts": hosts, "exec": script})
    if prog == "horovodrun":
        from horovod.runner import launch as hl
        saved = sys.argv
        sys.argv = ["horovodrun", *argv[1:]]
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                args = hl.parse_args()
        except SystemExit:
            raise AssertionError(f"horovodrun rejects {argv[1:]}: {err.getvalue()}") from None
        finally:
            sys.argv = saved
        inner = list(args.command)
        hosts = args.hosts or f"localhost:{args.num_proc}"
        return argv[:len(argv) - len(inner)], inner, {"np": args.num_proc, "hosts": hosts}
    if prog == "mpirun":
        arity = {"-np": 1, "-n": 1, "-bind-to": 1, "--bind-to": 1, "-map-by": 1, "--map-by": 1,
                 "-H": 1, "--host": 1, "-x": 1, "-hostfile": 1, "--hostfile": 1, "-mca": 2,
                 "--mca": 2, "--oversubscribe": 0, "-oversubscribe": 0}
        i, facts = 1, {"np": None, "hosts": "localhost", "oversubscribe": False}
        while i < len(argv) and argv[i].startswith("-"):
            opt = argv[i]
            assert opt in arity, f"mpirun option {opt} unknown to this test: add its arity"
            if opt in ("-np", "-n"):
                facts["np"] = int(argv[i + 1])
            if opt in ("-H", "--host", "-hostfile", "--hostfile"):
                facts["hosts"] = argv[i + 1]
            facts["oversubscribe"] |= "oversubscribe" in opt
            i += 1 + arity[opt]
        return argv[:i], argv[i:], facts
    return [], argv, {}


def _local_hosts(hosts: str) -> bool:
    return all(h.split(":")[0] in ("localhost", "127.0.0.1") for h in hosts.split(","))


def _cap_ranks(launcher: list[str]) -> list[str]:
    out = list(launcher)
    for i, w in enumerate(out[:-1]):
        if w in ("-np", "-n"):
            out[i + 1] = str(min(int(out[i + 1]), CORES))
        if w == "-H" and _local_hosts(out[i + 1]):
            out[i + 1] = f"localhost:{min(int(out[i + 1].split(':')[1]), CORES)}"
        if w in ("--nproc-per-node", "--nproc_per_node") and out[i + 1].isdigit():
            out[i + 1] = str(min(int(out[i + 1]), CORES))
    return out


def _flag(argv: list[str], name: str) -> str | None:
    for i, w in enumerate(argv):
        if w == name and i + 1 < len(argv):
            return argv[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def _config_value(argv: list[str], root: Path, section: str, key: str):
    cfg = _flag(argv, "--config")
    if cfg and (root / cfg).is_file():
        return ((yaml.safe_load((root / cfg).read_text()) or {}).get(section) or {}).get(key)
    return None


def shrink(hvd: list[str], root: Path) -> list[str]:
    """The documented size reductions (module docstring) of an ``hvd-lm`` argument list: flags
    appended at the end, where argparse lets the last occurrence win."""
    out = list(hvd)
    if hvd[:1] == ["train"]:
        steps = _flag(out, "--max-steps") or _config_value(out, root, "optim", "max_steps")
        out += ["--max-steps", str(max(2, int(steps) // 500) if steps else 2)]
        if not (_flag(out, "--hidden-size") or _config_value(out, root, "model", "hidden_size")):
            out += ["--hidden-size", "64"]
    if hvd[:1] == ["transfer"]:
        n, c = _flag(out, "--max-examples"), _flag(out, "--max-chars")  # --max-chars 0: all
        out += ["--max-examples", str(min(int(n), 200) if n else 200),
                "--max-chars", str(min(int(c), 256) if c and int(c) > 0 else 256)]
    return out


def _inputs_and_outputs(argv: list[str]) -> tuple[list[str], list[str]]:
    ins, outs = [], []
    if argv[:1] and argv[0] in POSITIONAL_OUTPUT:
        words = [w for w in argv[1:] if not w.startswith("-")]
        outs.append(words[-1])
        argv = [w for w in argv if w != words[-1]]
    for i, w in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if w.startswith("-") or "://" in w or _placeholder(w) or prev in PATTERN_FLAGS:
            continue
        if prev in OUTPUT_FLAGS:
            outs.append(w)
        elif PATHLIKE.search(w):
            ins.append(w)
    return ins, outs


def _check_inputs(cmd: Cmd, argv: list[str], s: Session, skip: set[str] = frozenset()) -> bool:
    """Every input exists or an earlier block writes it; True when all of them exist (a
    command whose input only a checked, not run, command would write is checked too)."""
    ins, outs = _inputs_and_outputs(argv)
    made = True
    for p in ins:
        if p in skip or p in EXTERNAL:
            continue
        exists = (s.root / p).exists()
        known = exists or any(p == q or p.startswith(q.rstrip("/") + "/") for q in s.produced)
        assert known, f"{cmd.where()}: input {p} does not exist and no earlier block writes it"
        made = made and exists
    s.produced.update(outs)
    return made


def _parse_hvd_lm(cmd: Cmd, hvd: list[str], s: Session) -> None:
    """Parse with hvd-lm's real parser (``python -m benchmarks``'s for ``["bench", ...]``);
    validate the settings when nothing is a placeholder."""
    from benchmarks import build_parser as bench_parser
    from hvd_lm.cli import build_parser
    build_parser, hvd = (bench_parser, hvd[1:]) if hvd[:1] == ["bench"] else (build_parser, hvd)
    words = []
    for w in hvd:                                     # a placeholder goes with its flag
        if _placeholder(w):
            if words and words[-1].startswith("--") and "=" not in words[-1]:
                words.pop()
        else:
            words.append(w)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser(words).parse_args(words)
    except SystemExit:
        raise AssertionError(f"{cmd.where()}: hvd-lm rejects it: {err.getvalue()}") from None
    if not any(map(_placeholder, hvd)) and "-h" not in words and "--help" not in words:
        cwd = os.getcwd()
        os.chdir(s.root)
        try:
            args.command_obj.settings(args)
        except Exception as e:  # noqa: BLE001 - reported with the doc line
            raise AssertionError(f"{cmd.where()}: invalid settings: {e}") from None
        finally:
            os.chdir(cwd)


def _ranks(argv: list[str], env: dict[str, str]) -> int:
    """Ranks a command starts: its ``-np``/``-n`` (mpirun, horovodrun, srun) or the template's
    ``NP``; 1 for a plain process."""
    n = int(env.get("NP") or env.get("NPROC_PER_NODE") or 1)
    for i, w in enumerate(argv[:-1]):
        if w in ("-np", "-n", "--nproc-per-node") and argv[i + 1].isdigit():
            n = max(n, int(argv[i + 1]))
    return n


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


def _execute(cmd: Cmd, argv: list[str], s: Session, env: dict | None = None,
             timeout: float = 600) -> None:
    run_env = dict(s.env, **(env or {}))
    if not cmd.gpu and _ranks(argv, run_env) > 1 and _ranks(argv, run_env) > _gpus():
        # More ranks than GPUs on this machine (a 1-GPU node): ranks cannot share a GPU
        # (docs/install.md, "GPU nodes"), so these blocks' `--device auto` ranks run on the CPU.
        run_env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.monotonic()
    if cmd.shell:
        proc = subprocess.run(["bash", "-c", cmd.text], cwd=s.root, env=run_env, text=True,
                              capture_output=True, timeout=timeout)
    else:  # warm where it can be (tests/_warm.py)
        proc = _warm.run_or_fresh(argv, s.root, run_env, timeout)
    s.log.append(f"ran     {cmd.where()} in {time.monotonic() - t0:.1f} s -> {' '.join(argv)}")
    if os.environ.get("HVD_LM_DOCS_TIMES"):  # where a doc's time goes: one line per command
        with open(os.environ["HVD_LM_DOCS_TIMES"], "a") as f:
            f.write(s.log[-1] + "\n")
    assert proc.returncode == 0, (f"{cmd.where()} exited {proc.returncode} (ran {argv})\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


# ---- one command ---------------------------------------------------------------------------------
#: hvd-lm commands that run here (the rest are checked): cheap, or shrunk by :func:`shrink`
#: (check-build, 12-16 s, is run as written by tests/test_foundation.py).
RUN_COMMANDS = {"prepare", "verify", "train", "eval", "transfer", "classify", "generate",
                "visualize", "export", "launch", "bench scaling-model", "bench scaling-report"}


def _template_knobs(path: Path) -> set[str]:
    from hvd_lm.jobs.job_scripts import knob_defaults
    return set(knob_defaults(path.read_text())) | set(
        re.findall(r"\b([A-Z][A-Z0-9_]+)\b", (REPO / "launch" / "env.sh").read_text()))


def _template(cmd: Cmd, script: str, env: dict[str, str], s: Session, run_it: bool) -> None:
    path = s.root / script
    assert path.is_file(), f"{cmd.where()}: {script} does not exist"
    unknown = set(env) - _template_knobs(path)
    assert not unknown, f"{cmd.where()}: {sorted(unknown)} are not knobs of {script}"
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    remote = REMOTE_KNOBS & {k for k, v in env.items() if v}
    hosts_file = env.get("HOSTS_FILE")
    if hosts_file and (s.root / hosts_file).is_file():
        remote |= set() if _local_hosts(",".join(
            (s.root / hosts_file).read_text().split())) else {"HOSTS_FILE"}
    if not run_it or Path(script).name not in LOCAL_TEMPLATES or remote:
        s.log.append(f"checked {cmd.where()}")
        return
    env = dict(env)
    if "OUT_DIR" not in env:                          # the run dir of the uncapped NP
        from hvd_lm.jobs.job_scripts import knob_defaults
        default = knob_defaults(path.read_text())["OUT_DIR"]
        env["OUT_DIR"] = default.replace("$NP", env.get("NP", str(CORES)))
    env["NP"] = str(min(int(env.get("NP", CORES)), CORES))
    if "NPROC_PER_NODE" in env:  # launch/torchrun.sh's ranks
        env["NPROC_PER_NODE"] = str(min(int(env["NPROC_PER_NODE"]), CORES))
    train = shlex.split(env.get("TRAIN_ARGS", ""))
    cfg_args = ["--config", env["CONFIG"]] if env.get("CONFIG") else []
    env["TRAIN_ARGS"] = " ".join(shrink(["train", *cfg_args, *train], s.root)[1 + len(cfg_args):])
    _check_inputs(cmd, [*cfg_args, *train], s)
    _execute(cmd, ["bash", script], s, env=env)


def handle(cmd: Cmd, s: Session) -> None:
    """Run or check one command (see the module docstring)."""
    argv = [x for w in cmd.argv for x in _expand(w, s)]
    if not argv:                                     # NAME=value alone: a shell variable
        for k, v in cmd.env.items():
            if "${" not in v:                        # a knobs-block line shown as an example
                s.variables[k] = _expand(v, s)[0]
            else:
                assert any(cmd.text.strip() in t.read_text() for t in
                           (REPO / "launch").iterdir()), f"{cmd.where()}: no template has it"
        return
    if Path(argv[0]).name == "timeout":              # timeout [OPTIONS] DURATION COMMAND...
        i = 1
        while argv[i].startswith("-"):
            i += 1
        argv = argv[i + 1:]
    prog = Path(argv[0]).name
    if prog == "source":
        assert (s.root / argv[1]).is_file(), f"{cmd.where()}: no {argv[1]}"
        return
    if prog == "pip" or (prog.startswith("python") and argv[1:2] in (["-"], ["-c"])):
        if argv[1:2] == ["-c"]:
            compile(argv[2], cmd.where(), "exec")
        s.log.append(f"checked {cmd.where()} (bash -n / compile only)")
        return
    if (prog.startswith("python") and argv[1:3] == ["-m", "pytest"]) or prog == "pytest":
        tests = [w for w in argv[1:] if w.startswith("tests/")]
        assert tests and all((s.root / w.split("::")[0]).exists() for w in tests), cmd.where()
        s.log.append(f"checked {cmd.where()} (tests run by `make test`)")
        return
    if prog.startswith("python") and argv[1:3] == ["-m", "tests.cluster"]:
        assert argv[3:4] and argv[3] in ("up", "down", "status", "shape", "link", "ping",
                                         "run"), f"{cmd.where()}: not a tests.cluster command"
        if argv[3] == "run" and "--" in argv:        # run NODE -- COMMAND: parse an hvd-lm one
            hvd = _hvd_lm_argv(argv[argv.index("--") + 1:])
            if hvd is not None:
                _parse_hvd_lm(cmd, hvd, s)
        s.log.append(f"checked {cmd.where()} (the cluster in a box needs root and namespaces; "
                     "the `cluster` tests run it)")
        return
    if prog == "make":
        targets = re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), re.M)
        assert set(argv[1:]) <= set(targets), f"{cmd.where()}: no such make target"
        if "demo" in argv[1:]:
            s.produced.add("runs/demo")               # what later blocks may read
        s.log.append(f"checked {cmd.where()} (make runs the whole suite / the demo)")
        return
    if prog in ("sbatch", "qsub"):
        script = argv[-1]
        assert (s.root / script).is_file() or script in s.produced, f"{cmd.where()}: no {script}"
        if (s.root / script).is_file():
            subprocess.run(["bash", "-n", str(s.root / script)], check=True, timeout=30)
            v = _flag(argv, "-v")
            names = set(cmd.env) | ({kv.split("=")[0] for kv in v.split(",")} if v else set())
            unknown = names - _template_knobs(s.root / script)
            assert not unknown, f"{cmd.where()}: {sorted(unknown)} are not knobs of {script}"
        s.log.append(f"checked {cmd.where()} (needs a scheduler)")
        return
    if prog == "bash" and len(argv) > 1:
        script = argv[1]
        if script.startswith("launch/"):
            return _template(cmd, script, cmd.env, s, run_it=True)
        assert (s.root / script).is_file(), f"{cmd.where()}: {script} does not exist"
        subprocess.run(["bash", "-n", str(s.root / script)], check=True, timeout=30)
        s.log.append(f"checked {cmd.where()} (cluster job or GPU node)")
        return
    if cmd.shell or prog in ("echo", "cmp", "mkdir", "cp"):
        return _execute(cmd, argv, s, env=cmd.env)
    launcher, inner, facts = _split_launcher(argv)
    hvd = _hvd_lm_argv(inner)
    assert hvd is not None, f"{cmd.where()}: the docs test does not know `{prog}`"
    _parse_hvd_lm(cmd, hvd, s)
    what = " ".join(hvd[:2]) if hvd[0] == "bench" else hvd[0]
    local = not launcher or _local_hosts(facts["hosts"])
    placeholders = any(_placeholder(w) for w in argv)
    if hvd[:2] == ["bench", "scaling-model"] and any(_flag(hvd, f) in s.produced - {None}
                                            for f in ("--bench-json",)):
        placeholders = True                          # its input was only checked, not made
    help_only = "-h" in hvd or "--help" in hvd
    needs_gpu = cmd.gpu and not torch_cuda()
    inputs_made = _check_inputs(cmd, hvd, s)
    if help_only or (what in RUN_COMMANDS and local and not placeholders and not needs_gpu
                     and inputs_made):
        if what == "bench scaling-report" and not any((s.root / w).exists() for w in hvd[2:]):
            s.log.append(f"checked {cmd.where()} (its runs come from a cluster)")
            return
        extra = shrink(hvd, s.root)[len(hvd):]        # shrink only appends flags
        full = [*_cap_ranks(launcher), *facts.get("exec", inner), *extra]
        return _execute(cmd, full, s, env=cmd.env)
    s.log.append(f"checked {cmd.where()}")


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
