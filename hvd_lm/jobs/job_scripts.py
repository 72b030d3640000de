"""Job scripts: a launch template rendered for a scheduler and a size (what ``hvd-lm launch``
writes; :mod:`hvd_lm.jobs.job_plans` decides the sizes and runs the command).

The templates in ``launch/`` (repository root) are plain, runnable shell scripts. Every size/config
setting sits in a knobs block at the top as ``NAME="${NAME:-default}"  # comment`` (environment
overrides win) and, for batch schedulers, in ``#SBATCH``/``#PBS`` directive lines. Rendering
replaces those defaults and directives with concrete values and leaves the rest of the script
untouched, so a rendered script reads (and runs) exactly like the template.

A world of N ranks is N GPUs, one rank per GPU (Horovod docs, "Running Horovod"); ``--gpus`` is the
world size and ``--gpus-per-node`` the ranks per node. ``--device cpu`` renders the same layout
without asking the scheduler for GPUs (CPU clusters, tests).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import hvd_lm
from hvd_lm.util.units import scheduler_time

#: scheduler name -> template file in the launch directory
SCHEDULERS = {"horovodrun": "horovodrun_local.sh",
              "horovodrun-multinode": "horovodrun_multinode.sh",
              "horovodrun-elastic": "horovodrun_elastic.sh", "mpirun": "mpirun.sh",
              "slurm": "slurm.sbatch", "pbs": "pbs.qsub", "torchrun": "torchrun.sh"}
#: scheduler -> the knobs its template takes from the size and flags (each set when it has a
#: value), beside CONFIG and OUT_DIR, which every template takes
SCHEDULER_KNOBS = {"horovodrun": ("NP", "CONTROLLER"), "mpirun": ("NP",), "slurm": ("LAUNCHER",),
                   "horovodrun-multinode": ("NP", "NETWORK_INTERFACE", "CONTROLLER"),
                   "horovodrun-elastic": ("NP", "MAX_NP", "NETWORK_INTERFACE"),
                   "torchrun": ("NETWORK_INTERFACE", "NPROC_PER_NODE", "NNODES")}
#: how each rendered job is started (for the sweep's submit script)
SUBMIT = {k: {"slurm": "sbatch", "pbs": "qsub"}.get(k, "bash") for k in SCHEDULERS}

_KNOB = re.compile(r'^(?P<name>[A-Z][A-Z0-9_]*)="\$\{(?P=name):-(?P<default>.*)\}"'
                   r'(?P<rest>\s*(?:#.*)?)$', re.M)
# Characters that cannot sit inside a double-quoted "${NAME:-...}" default as literal text.
_UNSAFE = re.compile(r'[$`"\\}\n]')
#: A scheduler directive's value (``#SBATCH --partition=VALUE``, ``#PBS -N VALUE``): one word of
#: letters, digits and ``_ . , : = + -``, not starting with ``-``, at most 128 characters. sbatch
#: and qsub split a directive line into options at whitespace, so a value with a space (``gpu
#: --output=FILE``) would add options of its own; SLURM partition, account and job names and PBS
#: queue and job names are words of this kind (SLURM ``--partition`` takes ``a,b`` lists, PBS
#: ``-l select`` takes ``1:ncpus=8``).
_DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.,:=+-]{0,127}$")
#: A host or network interface name given to horovodrun/mpirun (``-H``, ``--network-interface``):
#: letters, digits, ``_ . -`` (and ``,`` between names), not starting with ``-``.
_HOST_WORD = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$")
#: PBS ``ncpus`` per GPU rank without ``--cpus-per-task``: its training thread, the batch
#: read-ahead thread, Horovod's background thread and NCCL's (a DGX-1 has 40 cores for 8 GPUs,
#: 5 each); a CPU rank (``--device cpu``) gets 1 core, a rank per core.
PBS_CORES_PER_GPU_RANK = 4


def template_dir() -> Path:
    """The launch templates: ``$HVD_LM_LAUNCH_DIR`` or ``launch/`` beside the ``hvd_lm`` package.

    Raises:
        FileNotFoundError: the directory is missing (e.g. a non-editable install without the
            repository checkout).
    """
    d = Path(os.environ.get("HVD_LM_LAUNCH_DIR") or hvd_lm.REPO_ROOT / "launch")
    if not d.is_dir():
        raise FileNotFoundError(f"launch templates not found at {d}: run from a checkout of the "
                                "repository or set HVD_LM_LAUNCH_DIR")
    return d


@dataclass(frozen=True)
class JobSize:
    """Layout of one job.

    Attributes:
        gpus: world size = ranks = GPUs (one rank per GPU).
        nodes: nodes.
        tasks_per_node: ranks (GPUs) per node.
    """

    gpus: int
    nodes: int
    tasks_per_node: int


def job_size(gpus: int, gpus_per_node: int, nodes: int | None = None) -> JobSize:
    """Nodes for ``gpus`` ranks at ``gpus_per_node`` per node (derived, or checked when given).

    Fewer GPUs than one node holds use one node with ``gpus`` ranks; more must fill whole nodes.

    Raises:
        ValueError: non-positive counts, GPUs that do not fill whole nodes, or ``nodes`` that
            disagrees with the derived count.
    """
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"need --gpus >= 1 and --gpus-per-node >= 1, got {gpus} and "
                         f"{gpus_per_node}")
    per_node = min(gpus, gpus_per_node)
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs do not fill {gpus_per_node}-GPU nodes evenly "
                         f"({gpus / gpus_per_node:.2f} nodes); use a multiple of {gpus_per_node}")
    size = JobSize(gpus, gpus // per_node, per_node)
    if nodes is not None and nodes != size.nodes:
        raise ValueError(f"--nodes {nodes} does not match {gpus} GPUs at {gpus_per_node} per node "
                         f"(that is {size.nodes} node{'s' * (size.nodes > 1)} x "
                         f"{size.tasks_per_node} GPUs)")
    return size


def check_directive_value(flag: str, value: str) -> str:
    """``value`` if a scheduler directive can hold it (:data:`_DIRECTIVE_VALUE`), else an error
    naming ``flag``.

    Raises:
        ValueError: whitespace, a leading ``-``, another character, or too long.
    """
    if not _DIRECTIVE_VALUE.fullmatch(value):  # fullmatch: "$" also matches before a final \n
        why = ("whitespace would start another sbatch/qsub option" if re.search(r"\s", value)
               else "it may not start with '-'" if value.startswith("-")
               else "too long" if len(value) > 128 else "it holds another character")
        raise ValueError(f"{flag} {value[:80]!r}: not a scheduler name ({why}); use one word of "
                         "letters, digits and _ . , : = + -")
    return value


def check_host_words(flag: str, value: str) -> str:
    """``value`` (comma-separated host or interface names) if each is a name
    (:data:`_HOST_WORD`), else an error naming ``flag``.

    Raises:
        ValueError: an empty name, whitespace, a leading ``-`` (it would read as an option).
    """
    for word in value.split(","):
        if not _HOST_WORD.fullmatch(word):
            raise ValueError(f"{flag} {value[:80]!r}: {word[:80]!r} is not a host or interface "
                             "name (letters, digits, _ . -; not starting with '-')")
    return value


def set_knobs(text: str, knobs: dict[str, str]) -> str:
    """Replace the defaults of ``NAME="${NAME:-default}"`` lines.

    Raises:
        KeyError: a knob the template does not have (naming the ones it has).
        ValueError: a value with shell-special characters.
    """
    found = set(knob_defaults(text))
    if missing := set(knobs) - found:
        raise KeyError(f"template has no knob(s) {sorted(missing)} (it has {sorted(found)})")

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in knobs:
            return m.group(0)
        value = knobs[name]
        if _UNSAFE.search(value):
            raise ValueError(f"{name}={value!r}: the characters $ ` \" \\ }} and newlines cannot "
                             "be rendered into a template default; edit the script instead")
        if value.startswith("-"):  # "${X:- --flag}" reads better than "${X:---flag}"
            value = " " + value
        return _keep_comment_column(m.group(0), f'{name}="${{{name}:-{value}}}"', m.group("rest"))

    return _KNOB.sub(sub, text)


def _keep_comment_column(old_line: str, new_code: str, rest: str) -> str:
    """``new_code`` + ``rest`` with a trailing ``# comment`` kept at its old column when it fits."""
    if not rest.strip():
        return new_code
    column = len(old_line) - len(rest.lstrip())
    return new_code + " " * max(1, column - len(new_code)) + rest.strip()


def knob_defaults(text: str) -> dict[str, str]:
    """``{NAME: default}`` of a template's knobs block."""
    return {m.group("name"): m.group("default") for m in _KNOB.finditer(text)}


def set_directive(text: str, prefix: str, key: str, value: str, sep: str) -> str:
    """Set the scheduler directive ``<prefix> <key><sep><value>`` (``#SBATCH --time=1:00:00``,
    ``#PBS -l walltime=1:00:00``), enabling a disabled ``#<prefix>`` line; a directive the
    template lacks is added after its last directive line. A trailing ``# comment`` is kept.

    Raises:
        ValueError: a value no directive can hold (:func:`check_directive_value`).
    """
    value = check_directive_value(f"{prefix} {key}", value)
    pat = re.compile(rf"^#?{re.escape(prefix)} {re.escape(key)}{re.escape(sep)}\S*(?P<rest>.*)$",
                     re.M)
    line = f"{prefix} {key}{sep}{value}"
    if pat.search(text):
        return pat.sub(lambda m: _keep_comment_column(m.group(0), line, m.group("rest")), text,
                       count=1)
    lines = text.split("\n")
    last = max((i for i, x in enumerate(lines) if x.startswith(prefix + " ")), default=0)
    lines.insert(last + 1, line)
    return "\n".join(lines)


@dataclass
class RenderSpec:
    """Everything a rendered script depends on (see ``hvd-lm launch --help`` for each)."""

    scheduler: str
    size: JobSize
    device: str = "cuda"
    partition: str | None = None
    walltime: str | None = None
    config: str | None = None
    out_dir: str | None = None
    train_args: tuple[str, ...] = ()
    job_name: str = "hvd-lm"
    python: str | None = None
    launcher: str | None = None
    controller: str | None = None
    hosts: tuple[str, ...] = ()
    network_interface: str | None = None
    cpus_per_task: int | None = None
    header: tuple[str, ...] = ()
    elastic: bool = False
    min_np: int | None = None
    engine: str | None = None


def render(spec: RenderSpec, templates: Path | None = None) -> str:
    """The template of ``spec.scheduler`` (a key of :data:`SCHEDULERS`; ``spec.engine``: None,
    ``horovod`` or ``torch``, as ``hvd-lm launch``'s choices give them) with its knobs and
    directives filled in.

    Raises:
        ValueError: a layout the scheduler cannot express (more than one node
            for ``horovodrun``; host list of the wrong length), unsafe values.
    """
    templates = templates or template_dir()
    text = (templates / SCHEDULERS[spec.scheduler]).read_text()
    size, sched, tpn = spec.size, spec.scheduler, spec.size.tasks_per_node
    if spec.hosts and len(spec.hosts) != size.nodes:
        raise ValueError(f"--hosts lists {len(spec.hosts)} hosts but the job needs {size.nodes} "
                         f"node(s) ({size.gpus} GPUs at {size.tasks_per_node} per node)")
    # what goes into directives and launcher options, checked before anything is rendered
    if spec.partition is not None:
        check_directive_value("--partition", spec.partition)
    check_directive_value("--job-name", spec.job_name)
    walltime = spec.walltime and scheduler_time(spec.walltime, sched)
    for flag, value in (("--hosts", ",".join(spec.hosts) if spec.hosts else None),
                        ("--network-interface", spec.network_interface)):
        if value is not None:
            check_host_words(flag, value)
    for arg in spec.train_args:
        if not arg or re.search(r"\s", arg):
            raise ValueError(f"training flag {arg!r}: values with whitespace cannot go into "
                             "TRAIN_ARGS; put them in the YAML config (--config)")

    knobs = {"LAUNCH_DIR": str(templates.resolve()), "PYTHON": spec.python or sys.executable,
             "TRAIN_ARGS": " ".join(spec.train_args)}
    if spec.elastic and sched not in ("slurm", "horovodrun-elastic"):
        raise ValueError(f"--elastic works with --scheduler slurm or horovodrun-elastic, not "
                         f"{sched}")
    values = {"NP": size.gpus, "MAX_NP": size.gpus, "NETWORK_INTERFACE": spec.network_interface,
              "CONTROLLER": spec.controller, "NPROC_PER_NODE": tpn, "NNODES": size.nodes,
              "LAUNCHER": "elastic" if spec.elastic else spec.launcher, "OUT_DIR": spec.out_dir,
              "CONFIG": spec.config and Path(spec.config).resolve()}
    knobs.update({k: str(values[k]) for k in ("CONFIG", "OUT_DIR", *SCHEDULER_KNOBS.get(sched, ()))
                  if values[k]})
    if spec.min_np is not None:
        if not (spec.elastic or sched == "horovodrun-elastic"):
            raise ValueError("--min-np is for elastic jobs (--elastic)")
        if not 1 <= spec.min_np <= size.gpus:
            raise ValueError(f"--min-np {spec.min_np} must be in 1..{size.gpus} (--gpus)")
        knobs["MIN_NP"] = str(spec.min_np)
    if sched == "torchrun" and spec.engine == "horovod":
        raise ValueError("--scheduler torchrun trains on the torch engine: drop --engine horovod "
                         "(or use --scheduler horovodrun)")
    if spec.engine == "torch" and sched != "torchrun":  # srun's, mpirun's or PBS's ranks
        if sched.startswith("horovodrun") or spec.elastic:
            raise ValueError(f"--engine torch runs under torchrun, mpirun, slurm or pbs, not "
                             f"{'--elastic (Horovod elastic)' if spec.elastic else sched}")
        knobs["ENGINE"] = "torch"
    if sched == "horovodrun" and size.nodes > 1:
        raise ValueError(f"--scheduler horovodrun runs on one node, but {size.gpus} GPUs need "
                         f"{size.nodes} nodes: use horovodrun-multinode, mpirun, slurm or pbs")
    if spec.hosts and sched in ("torchrun", "horovodrun-multinode", "mpirun"):
        knobs["HOSTS"] = ",".join(f"{h}:{tpn}" for h in spec.hosts)
    elif sched == "horovodrun-multinode" and size.nodes == 1:  # (torchrun without hosts: the
        knobs["HOSTS"] = f"localhost:{size.gpus}"  # script asks for HOSTS or RDZV_ENDPOINT)
    elif sched == "horovodrun-multinode":  # hosts unknown until the machines are: a hostfile
        knobs["HOSTS"], knobs["HOSTFILE"] = "", "hostfile"
    elif sched == "mpirun" and size.nodes > 1:
        knobs["HOSTFILE"] = "hostfile"
    if sched == "slurm" and spec.elastic and spec.launcher not in (None, "elastic"):
        raise ValueError("--elastic runs the ranks with horovodrun: drop --launcher")
    gpus = tpn if spec.device == "cuda" else None
    cores = spec.cpus_per_task or (PBS_CORES_PER_GPU_RANK if gpus else 1)
    select = (f"{size.nodes}:ncpus={tpn * cores}"
              + (f":ngpus={tpn}" if gpus else "") + f":mpiprocs={tpn}")
    directives = {  # (key, value: None leaves the template's line as it is, separator), in order
        "slurm": [("--job-name", spec.job_name, "="), ("--nodes", size.nodes, "="),
                  ("--ntasks-per-node", tpn, "="), ("--gpus-per-node", gpus, "="),
                  ("--cpus-per-task", spec.cpus_per_task, "="), ("--time", walltime, "="),
                  ("--partition", spec.partition, "=")],
        "pbs": [("-N", spec.job_name, " "), ("-l select", select, "="),
                ("-l walltime", walltime, "="), ("-q", spec.partition, " ")]}
    for key, value, sep in directives.get(sched, ()):
        if value:
            text = set_directive(text, "#SBATCH" if sched == "slurm" else "#PBS", key, str(value),
                                 sep)
    text = set_knobs(text, knobs)
    if spec.header:
        first, _, rest = text.partition("\n")
        text = "\n".join([first, *(f"# {h}" for h in spec.header), rest])
    return text


# ---- launch commands for ranks on this machine or given hosts (the demo, the benchmarks, tests)

def local_mpi_env(**extra: str) -> dict[str, str]:
    """Environment for ranks launched on this machine by ``mpirun``/``horovodrun`` (tests,
    benchmarks, the demo): this interpreter's bin folder first on ``PATH``, the repository on
    ``PYTHONPATH``, one OpenMP thread per rank unless set, OpenMPI allowed to run as root and in
    containers (no ptrace single-copy), and ``OMPI_MCA_mpi_yield_when_idle=1``: with ranks sharing
    cores, OpenMPI's busy-polling in Horovod's MPI controller steals the compute threads' cores
    (docs/training.md). ``extra`` is applied last."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    repo = str(hvd_lm.REPO_ROOT)
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.update(extra)
    return env


#: Variables ``mpirun`` forwards to ranks on other hosts (``-x``), by name or prefix (Horovod docs,
#: "Running Horovod": ``-x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH``); OpenMPI forwards OMPI_*.
FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "OMP_", "HOROVOD_", "NCCL_",
             "GLOO_", "MASTER_", "HVD_LM_")


def mpirun_argv(np_: int, argv: list[str], hosts: str = "", network_interface: str = "",
                env: Mapping[str, str] | None = None) -> list[str]:
    """``mpirun -np N`` with Horovod's recommended OpenMPI flags (docs "Running Horovod": no
    binding, slots in order, ob1 PML, no openib BTL), then this interpreter and ``argv``.

    Args:
        hosts: ``host:slots,...`` (``-H``); '' = this node. With hosts, every variable of ``env``
            (default: this process's) named in :data:`FORWARDED` is passed on with ``-x``.
        network_interface: the interface OpenMPI's TCP BTL and out-of-band channel use across
            hosts (``btl_tcp_if_include``, ``oob_tcp_if_include``: what ``hvd-lm doctor``
            prints); '' = OpenMPI's choice, which a docker0 on the hosts makes hang.
    """
    cmd = ["mpirun", "-np", str(np_)]
    if hosts:
        cmd += ["-H", hosts]
        prefixes = tuple(x for x in FORWARDED if x.endswith("_"))
        cmd += [w for n in sorted(os.environ if env is None else env)
                if n in FORWARDED or n.startswith(prefixes) for w in ("-x", n)]
    if network_interface:
        cmd += ["-mca", "btl_tcp_if_include", network_interface,
                "-mca", "oob_tcp_if_include", network_interface]
    return cmd + ["-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl",
                  "^openib", sys.executable, *argv]


def horovodrun_argv(np_: int, argv: list[str], controller: str = "gloo", hosts: str = "",
                    network_interface: str = "") -> list[str]:
    """``horovodrun -np N -H localhost:N --gloo|--mpi`` with this interpreter and ``argv``
    (the ``horovodrun`` beside this interpreter when there is one); ``hosts`` (``host:slots,...``)
    instead of localhost, ``network_interface`` as ``--network-interface``."""
    here = Path(sys.executable).parent / "horovodrun"
    hr = str(here) if here.exists() else "horovodrun"
    nic = ["--network-interface", network_interface] if network_interface else []
    return [hr, "-np", str(np_), "-H", hosts or f"localhost:{np_}", f"--{controller}", *nic,
            sys.executable, *argv]
