"""What ``hvd-lm doctor`` concludes from the hosts' facts: the checks (same code everywhere,
shards, GPUs), the interfaces every host reaches every other one through, the one it picks and
the variables it exports, and the human report. Pure functions over the facts and probe results
the agents return (:mod:`hvd_lm.jobs.doctor` gathers them); no process, socket or ssh here."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The environment variables the doctor sets (and checks when already set), in order: the
#: templates' knob (-> horovodrun --network-interface), NCCL's bootstrap and socket transport,
#: torch.distributed's Gloo, OpenMPI's TCP BTL (MPI traffic) and its runtime's out-of-band channel.
EXPORTS = ("NETWORK_INTERFACE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
           "OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include")
#: The ``iface`` of the probes of the torch engine's rendezvous port (not an interface name).
RENDEZVOUS = "(rendezvous)"


@dataclass
class Report:
    """What the doctor found (``--format json`` prints it).

    Attributes:
        hosts: [(host, slots)].
        facts: host -> the agent's facts (versions, interfaces, GPUs, shards).
        ssh: "a -> b" -> {"ok", "error"} for every ordered pair checked.
        reach: interface -> list of failures "a -> b: why" (empty: shared).
        shared: interfaces every host reaches every other one through.
        chosen: the interface(s) to use ('' when none is needed: one host).
        exports: variable -> value the launch should set.
        rendezvous: ``host:port`` of the torch engine's rendezvous once checked ('' otherwise).
        launcher: how the agents started (``hvd-lm doctor --launcher``: ssh, srun, mpirun).
        errors: every failed check, one line each (the first is raised).
    """

    hosts: list
    facts: dict = field(default_factory=dict)
    ssh: dict = field(default_factory=dict)
    reach: dict = field(default_factory=dict)
    shared: list = field(default_factory=list)
    chosen: str = ""
    exports: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    seconds: float = 0.0
    rendezvous: str = ""
    launcher: str = "ssh"


def check_versions(report: Report) -> None:
    """Same Python (version and path), hvd_lm (version and source digest) and torch/Horovod/
    mpi4py/numpy everywhere; a difference is one error naming both hosts."""
    hosts = list(report.facts)
    for h in hosts[1:]:
        mine, want = ({**{k: x[k] for k in ("python", "executable", "hvd_lm", "hvd_lm_digest")},
                       **x["packages"]} for x in (report.facts[h], report.facts[hosts[0]]))
        diff = [f"{k} {v} on {h} vs {want.get(k)} on {hosts[0]}" for k, v in mine.items()
                if v != want.get(k)]
        if diff:
            report.errors.append("hosts differ: " + "; ".join(diff) + " (every host needs the "
                                 "same environment at the same path)")


def check_paths(report: Report, results: dict[str, dict], paths: dict[str, str],
                here: str) -> set[str]:
    """Every host sees every path of ``paths`` (``{absolute path: what it is}``, each existing
    on the doctor's own host ``here``; the agents' ``results[host]["paths"]``): one error per
    host naming the paths it lacks and why that matters (every rank starts in the working
    folder and reads the others at the same path: a shared filesystem). Returns the hosts that
    lack one (their shard check would only repeat it)."""
    lacking = set()
    for h, res in results.items():
        if missing := [p for p, ok in res.get("paths", {}).items() if not ok and p in paths]:
            lacking.add(h)
            report.errors.append(
                f"{h} lacks {'; '.join(paths[p] for p in missing)}, which {here} has: every rank "
                "starts in the working folder and reads the data, config and run folder at the "
                f"same path, so they must be on a filesystem every host shares (or copied to the "
                f"same path on {h})")
    return lacking


def check_shards(report: Report, folder: str, skip: set[str] = frozenset()) -> None:
    """Every host reads the shard folder and sees the same manifest (hosts in ``skip`` are
    already reported as lacking a path)."""
    ref_host, ref = None, None
    for h, s in ((h, f["shards"]) for h, f in report.facts.items() if h not in skip):
        if "error" in s:
            report.errors.append(f"{h}: cannot read the shards: {s['error']}")
        elif ref is None:
            ref_host, ref = h, s
        elif s["manifest_sha256"] != ref["manifest_sha256"]:
            report.errors.append(f"{h} sees another {folder} than {ref_host} (manifest sha256 "
                                 f"{s['manifest_sha256'][:12]} vs {ref['manifest_sha256'][:12]}): "
                                 "put the shards on a shared filesystem or copy them identically")


def check_gpus(report: Report, device: str) -> None:
    """``cuda``: every host needs a GPU per slot; ``auto``: the same, where a host has GPUs."""
    for h, slots in report.hosts:
        g = report.facts[h]["gpus"]
        if device != "cpu" and (device == "cuda" or g) and g < slots:
            report.errors.append(f"{h}: {slots} slots but {g} GPU(s): one rank per GPU (lower "
                                 f"its slots to {g}, or --device cpu)")


def analyse_reach(report: Report, results: dict[str, dict]) -> None:
    """From every host's probe results: per interface name present on every host, the failed
    (a -> b) connections; shared = none failed. Loopback counts only when every host is this
    one machine."""
    hosts = list(report.facts)
    names = set.intersection(*(set(report.facts[h]["interfaces"]) for h in hosts))
    own = {h: {a for i in report.facts[h]["interfaces"].values() for a in i["addrs"]}
           for h in hosts}
    report.reach = reach = {n: [] for n in sorted(names)}  # interface -> its failures
    for a, res in results.items():
        for p in res["probes"]:
            b, addr = p["target"], p["addr"]
            if p["iface"] not in reach or (p["ok"] and p["token"] == report.facts[b]["token"]):
                continue
            why = (f"reached {p['host']}, not {b}" if p["ok"] else p["error"] + (
                f" ({addr} is also {a}'s own address)" if addr in own[a] else ""))
            reach[p["iface"]].append(f"{a} -> {addr} ({p['iface']} of {b}): {why}")
    for n in reach:
        if report.facts[hosts[0]]["interfaces"][n]["loopback"] and len(hosts) > 1:
            reach[n].append("loopback: reaches only its own host")
    report.shared = [n for n, fails in reach.items() if not fails]


def choose(report: Report, wanted: str, env: dict[str, str]) -> None:
    """Pick the interface (or verify ``wanted`` and the interface variables already set in
    ``env``), then fill :attr:`Report.exports` with what is not set yet."""
    hosts = list(report.facts)
    f0 = report.facts[hosts[0]]["interfaces"]

    def verify(names: list[str], source: str) -> None:
        shared = f"; shared by all hosts: {', '.join(report.shared) or 'none'}"
        for n in names:
            if n not in report.reach:
                missing = [h for h in hosts if n not in report.facts[h]["interfaces"]]
                report.errors.append(f"{source}: interface {n} is missing (or down, or without "
                                     f"an IPv4 address) on {', '.join(missing)}{shared}")
            elif report.reach[n]:
                report.errors.append(f"{source}: interface {n} does not connect the hosts: "
                                     f"{report.reach[n][0]}{shared}")

    if wanted:
        names = [x for x in wanted.split(",") if x]
        verify(names, "--network-interface")
        report.chosen = ",".join(names)
    elif len(hosts) > 1:  # (one host: nothing crosses a network, no interface is chosen)
        report.chosen = min(report.shared, default="", key=lambda n: (f0[n]["loopback"], -min(
            report.facts[h]["interfaces"][n]["speed_mbit"] for h in hosts), n))  # fastest
        if not report.chosen:
            first = next((f"{n}: {fails[0]}" for n, fails in report.reach.items()
                          if fails and not f0[n]["loopback"]), "no interface name is common "
                         "to all hosts")
            report.errors.append("no network interface connects every pair of hosts (" + first
                                 + "); fix the network or name one with --network-interface")
    for var in EXPORTS:
        value = env.get(var, "")
        if value and var != "NETWORK_INTERFACE" and not value.startswith(("^", "=")):
            verify([x for x in value.split(",") if x], f"{var}={value} (from the environment)")
    if report.chosen:
        report.exports = {var: report.chosen for var in EXPORTS if not env.get(var)}


def check_rendezvous(report: Report, results: dict[str, dict], port: int,
                     env: dict[str, str]) -> None:
    """The torch engine's rendezvous: the first host's agent could open ``port`` (its facts'
    ``rendezvous``) and every other host reached it there by the first host's name, and that
    reached the first host (its token); one error per failure, else the ``MASTER_ADDR`` /
    ``MASTER_PORT`` exports (values already in ``env`` are kept)."""
    first = report.hosts[0][0]
    opened = report.facts[first].get("rendezvous") or {}
    if opened.get("error"):
        report.errors.append(f"rendezvous: {opened['error']}; pick another with MASTER_PORT "
                             "(and --rendezvous-port)")
        return
    before = len(report.errors)
    for host, p in ((h, p) for h, res in results.items() for p in res["probes"]
                    if p["iface"] == RENDEZVOUS):
        if not p["ok"]:
            report.errors.append(
                f"rendezvous: {host} cannot reach {first}:{port} ({p['error']}): the torch "
                f"engine's ranks meet there; open TCP port {port} on {first} to the other "
                "hosts (a firewall?) or pick another with MASTER_PORT")
        elif p["token"] != report.facts[first]["token"]:
            report.errors.append(
                f"rendezvous: {host} reaches {p['host']}, not {first}, at {first}:{port}: "
                f"the name {first} means another machine there (/etc/hosts, DNS)")
    if len(report.errors) == before:
        report.rendezvous = f"{first}:{port}"
        meet = {"MASTER_ADDR": first, "MASTER_PORT": str(port)}
        report.exports.update({var: value for var, value in meet.items() if not env.get(var)})


def render(report: Report) -> str:
    """The human report (what ``--format text`` prints)."""
    hosts = list(report.facts)
    f0 = report.facts[hosts[0]]
    lines = [f"hvd-lm doctor: {len(hosts)} host(s) "
             f"({', '.join(f'{h}:{s}' for h, s in report.hosts)}), checked in "
             f"{report.seconds:.1f} s"]
    if report.ssh:
        bad = [k for k, v in report.ssh.items() if not v["ok"]]
        lines.append(f"  ssh          {len(report.ssh) - len(bad)} of {len(report.ssh)} host pairs "
                     "ok (batch mode, both ways)" + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    elif report.launcher != "ssh" and len(hosts) > 1:
        lines.append(f"  ssh          not checked: {report.launcher} started the agents, one per "
                     "host")
    pk = ", ".join(f"{k} {v}" for k, v in f0["packages"].items() if v)
    lines.append(f"  python       {f0['python']} ({f0['executable']}); hvd_lm {f0['hvd_lm']} "
                 f"(source {f0['hvd_lm_digest']}); {pk}"
                 + ("" if len(hosts) == 1 else " on every host" if not any(
                     e.startswith("hosts differ") for e in report.errors) else f" on {hosts[0]}"))
    for h in hosts:
        ifs = ", ".join(f"{n} {'/'.join(i['addrs'])}" + (f" {i['speed_mbit']} Mbit/s"
                                                          if i["speed_mbit"] > 0 else "")
                        for n, i in report.facts[h]["interfaces"].items())
        lines.append(f"  {h:12} {ifs}; GPUs: {report.facts[h]['gpus']}")
    lines.append(f"  shared       {', '.join(report.shared) or 'none'} (an ephemeral TCP port on "
                 "it reached from every other host)")
    lines += [f"  not shared   {n}: {fails[0]}" for n, fails in report.reach.items() if fails]
    readable = [h for h, f in report.facts.items() if f["shards"] and "error" not in f["shards"]]
    s = report.facts[readable[0]]["shards"] if readable else None
    if s:
        where = ("on every host" if len(readable) == len(hosts) else
                 f"on {', '.join(readable)} only (the ERROR below names the rest)")
        lines.append(f"  shards       manifest sha256 {s['manifest_sha256'][:12]}, {s['shards']} "
                     f"shards ({s['bytes'] / 1e6:.1f} MB) readable {where}")
    if report.rendezvous:
        lines.append(f"  rendezvous   {report.rendezvous} (--backend torch): opened on "
                     f"{report.hosts[0][0]}, reached from every other host")
    if report.chosen and not report.errors:
        x = report.chosen
        lines += [f"  use          {x}:",
                  f"    horovodrun --network-interface {x}",
                  f"    mpirun -mca btl_tcp_if_include {x} -mca oob_tcp_if_include {x}",
                  f"    NCCL_SOCKET_IFNAME={x} GLOO_SOCKET_IFNAME={x}"]
    elif len(hosts) == 1:
        lines.append("  use          (one host: no interface needed)")
    lines += [f"  ERROR        {e}" for e in report.errors]
    return "\n".join(lines)
