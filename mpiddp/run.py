"""The elastic launcher: run a training job on a set of nodes and, when it ends because nodes
died or became unreachable, run it again on the nodes still alive (docs/elastic.md).

    python -m mpiddp.run --hosts node1:4,node2:4,node3:4 --min-nodes 2 -- python train.py
    python -m mpiddp.run --min-nodes 2 -- python train.py        # inside sbatch: srun

The job itself goes on from its last ``mpiddp.elastic`` snapshot. Lost nodes are named by the
ranks' lost-peer watchdog (files in ``MPIDDP_LOST_NODES_DIR``), by mpiexec (hydra: a rank
"KILLED BY SIGNAL: 9" "RUNNING AT host"; Open MPI: "process rank N ... exited on signal 9";
Intel MPI: no proxy starts there, "Unable to run bstrap_proxy on host"), by srun ("srun:
error: host: task N: Killed") or, before every relaunch through mpiexec, by a probe that
cannot start a process there in time; they are left out of the next launch, and may rejoin a
later one when the host discovery command lists them again. A rank that crashed (a
segmentation fault or an abort: MPICH's survivors can crash when a peer's link goes), or a
node whose launcher daemon was lost (Open MPI's, Intel MPI's proxy), does not make its node
lost by itself: the probe decides. A job that fails with no node lost and no rank killed or
crashed (a bug in the script) is not run again.

The three families of ``mpiexec`` are driven, told apart by ``mpiexec --version``: MPICH's
hydra (and MVAPICH's: ``-hosts a:2,b:2``), Intel MPI's hydra (``-hosts a,b -ppn 2``, or a
machine file of ``host:slots`` lines where the hosts' slots differ: its ``-hosts`` takes no
slot counts) and Open MPI's (``--host``, ``--map-by slot``, every ``MPIDDP_*`` variable
forwarded with ``-x``, which both hydras do by themselves).

No torch and no MPI here: this process only starts and watches the launcher.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

EXIT_TOO_FEW_NODES = 3
EXIT_PREEMPTED = 75          # the job asked to be requeued (mpiddp.checkpoint)
# Hydra's report of a rank that ended badly: "=   RUNNING AT host" then "=   EXIT CODE: n"
# (MPICH) or "=   KILLED BY SIGNAL: n (Killed)" (Intel MPI, and MPICH for some), n the signal
# for a signalled rank. Intel MPI reports every rank of the node that its proxy then killed.
HYDRA_RUNNING_AT = re.compile(r"RUNNING AT (\S+)")
HYDRA_ENDED_BY = re.compile(r"(?:EXIT CODE|KILLED BY SIGNAL): (\d+)")
KILLED_SIGNALS = (9, 15)       # the node went (or its processes were killed with it)
CRASH_SIGNALS = (6, 7, 11)     # the rank crashed on a node that may well be alive
# Open MPI's (PRRTE's) report of a rank that ended by a signal; the node is its hostname, so
# the rank names the launch host instead (ranks fill the hosts in order: ``--map-by slot``).
OPEN_MPI_ENDED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+"
                            r"signal (\d+)")
# ... and of a node whose daemon it lost (a node or its link gone), named by hostname only.
OPEN_MPI_LOST_DAEMON = re.compile(r"lost communication with a remote daemon")
# Intel MPI's mpiexec: a node whose proxy it lost ("[mpiexec@vm] Error: Downstream from host
# h exited abnormally"), and a host where it could not start its proxy at all (down, a wrong
# name, no passwordless ssh: "Error: Unable to run bstrap_proxy on h (pid 1, exit code 65280)").
INTEL_LOST_PROXY = re.compile(r"Downstream from host (\S+) exited abnormally")
INTEL_NO_PROXY = re.compile(r"Unable to run bstrap_proxy on (\S+)")
# Each rank's host as launched, in rank order ('a,a,b,b'): the watchdog's name for its node
# (engine/liveness.py ``launch_host``) where the launcher does not say it (Open MPI).
LAUNCH_HOSTS = "MPIDDP_LAUNCH_HOSTS"
# A watchdog that reports lost nodes ends its job; its ranks exit by themselves 10 s later at
# the latest. Open MPI's mpiexec then still waits for the daemon of a node that is gone (an
# emulated cut link: until the link came back), so after this long it is ended.
REPORTED_MPIEXEC_GRACE_S = 30.0
PROBE_TIMEOUT_S = 10.0         # a node that cannot start 'true' in this time is lost
SRUN_STEP_ABORTED = "srun: Job step aborted"
SRUN_LOST = re.compile(r"srun: error: (\S+): tasks? [\d\-,]+: (?:Killed|Terminated)|"
                       r"srun: error: Node failure on (\S+)")


def say(message: str) -> None:
    """A line on stderr stamped with the wall-clock time (to the millisecond), so that a
    node's loss, the relaunch and the job's restart can be timed from the log."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    print(f"mpiddp.run [{stamp}]: {message}", file=sys.stderr, flush=True)


def parse_hosts(text: str, default_slots: int) -> list[tuple[str, int]]:
    """'a:2,b' or lines of 'a:2' / 'a slots=2' -> [(host, slots)] in order, no repeats."""
    hosts: dict[str, int] = {}
    for item in re.split(r"[,\n]", text):
        item = item.split("#", 1)[0].strip()
        if not item:
            continue
        match = re.match(r"^(\S+?)(?::(\d+)|\s+slots=(\d+))?$", item)
        if not match:
            raise ValueError(f"cannot read host entry {item!r} (expected host, host:slots "
                             "or 'host slots=N')")
        hosts.setdefault(match.group(1), int(match.group(2) or match.group(3) or default_slots))
    return list(hosts.items())


def rank_hosts(hosts: list[tuple[str, int]]) -> list[str]:
    """Each rank's host when ranks fill ``hosts`` in order, each its slots (rank r: entry r)."""
    return [host for host, slots in hosts for _ in range(slots)]


def mpiexec_family(mpiexec: list[str]) -> str:
    """'openmpi' for Open MPI's mpiexec, 'intel' for Intel MPI's, else 'hydra' (MPICH,
    MVAPICH)."""
    try:
        out = subprocess.run([*mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "hydra"
    text = out.stdout + out.stderr
    if "Open MPI" in text:
        return "openmpi"
    return "intel" if "Intel(R) MPI Library" in text else "hydra"


def hydra_ended(output: str) -> list[tuple[str, str]]:
    """(host, exit code or signal) of each rank hydra reports as ended badly: each "RUNNING AT
    host" with the first "EXIT CODE: n" or "KILLED BY SIGNAL: n" after it, before the next
    report. Searched in the whole text, not line by line: the ranks' own output may share
    lines with it (Intel MPI forwards it in pieces, not whole lines)."""
    found = []
    reports = list(HYDRA_RUNNING_AT.finditer(output))
    for report, following in zip(reports, reports[1:] + [None]):
        end = following.start() if following else len(output)
        ended = HYDRA_ENDED_BY.search(output, report.end(), end)
        if ended:
            found.append((report.group(1), ended.group(1)))
    return found


def slurm_hosts() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, check=True).stdout
    return out.split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpiddp.run", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", help="host[:slots],... to run on")
    where.add_argument("--hostfile", help="file with a 'host[:slots]' per line")
    p.add_argument("--host-discovery-script", metavar="CMD",
                   help="command printing the usable 'host[:slots]' lines; run before every "
                        "launch (a node that comes back rejoins at the next one)")
    p.add_argument("--launcher", choices=["auto", "mpiexec", "srun"], default="auto",
                   help="auto: srun inside a Slurm allocation without --hosts, else mpiexec")
    p.add_argument("-N", "--ranks-per-node", type=int, default=1,
                   help="ranks per node when a host gives no slots")
    p.add_argument("--min-nodes", type=int, default=1,
                   help="stop (exit status 3) when fewer nodes than this are left")
    p.add_argument("--max-restarts", type=int, default=10, help="relaunches at most")
    p.add_argument("--mpiexec", default=None,
                   help="mpiexec command to use, arguments allowed (default: the one next to "
                        "python)")
    p.add_argument("--srun-args", default="--mpi=pmi2", help="extra srun arguments")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no training command given (put it after --)")
    return args


class Launcher:
    def __init__(self, args):
        self.args = args
        self.use_srun = args.launcher == "srun" or (
            args.launcher == "auto" and not (args.hosts or args.hostfile)
            and bool(os.environ.get("SLURM_JOB_ID")))
        self.excluded: set[str] = set()
        self._family = None
        self._files: tempfile.TemporaryDirectory | None = None    # Intel MPI's machine files

    @property
    def family(self) -> str:
        if self._family is None:
            self._family = mpiexec_family(self.mpiexec())
        return self._family

    def host_arguments(self, hosts: list[tuple[str, int]], env=None) -> list[str]:
        """mpiexec's arguments for ``hosts`` (and, for Open MPI, forwarding every
        ``MPIDDP_*`` variable of ``env`` to the other nodes, as hydra does by itself). Ranks
        fill the hosts in order, each its slots, in every family (``rank_hosts``)."""
        listed = ",".join(f"{h}:{n}" for h, n in hosts)
        if self.family == "openmpi":
            forward = [arg for name in sorted(env or {}) if name.startswith("MPIDDP_")
                       for arg in ("-x", name)]
            return ["--host", listed, "--map-by", "slot", *forward]
        if self.family == "intel":
            # Its -hosts takes names only ("a:2" is a host it cannot reach), and without -ppn
            # it puts as many ranks on the first host as it has cores.
            if len({n for _, n in hosts}) == 1:
                return ["-hosts", ",".join(h for h, _ in hosts), "-ppn", str(hosts[0][1])]
            return ["-machinefile", self.machine_file(hosts)]
        return ["-hosts", listed]

    def machine_file(self, hosts: list[tuple[str, int]]) -> str:
        """A file of ``host:slots`` lines (Intel MPI's -machinefile), removed by ``close``."""
        if self._files is None:
            self._files = tempfile.TemporaryDirectory(prefix="mpiddp-run-hosts-")
        fd, path = tempfile.mkstemp(dir=self._files.name, suffix=".hosts", text=True)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{h}:{n}\n" for h, n in hosts))
        return path

    def close(self) -> None:
        if self._files is not None:
            self._files.cleanup()
            self._files = None

    def candidates(self) -> list[tuple[str, int]]:
        args = self.args
        if args.host_discovery_script:
            out = subprocess.run(args.host_discovery_script, shell=True, capture_output=True,
                                 text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"host discovery {args.host_discovery_script!r} failed "
                                   f"(status {out.returncode}): {out.stderr.strip()}")
            return parse_hosts(out.stdout, args.ranks_per_node)
        if args.hosts:
            return parse_hosts(args.hosts, args.ranks_per_node)
        if args.hostfile:
            with open(args.hostfile) as f:
                return parse_hosts(f.read(), args.ranks_per_node)
        names = slurm_hosts()
        if names:
            return [(h, args.ranks_per_node) for h in names]
        return [("localhost", args.ranks_per_node)]

    def mpiexec(self) -> list[str]:
        if self.args.mpiexec:
            return shlex.split(self.args.mpiexec)
        return [shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"]

    def command(self, hosts: list[tuple[str, int]], env=None) -> list[str]:
        if self.use_srun:
            per_node = hosts[0][1]
            return ["srun", *self.args.srun_args.split(), "--no-kill", "--kill-on-bad-exit=0",
                    f"--nodes={len(hosts)}", f"--ntasks={per_node * len(hosts)}",
                    f"--ntasks-per-node={per_node}",
                    f"--nodelist={','.join(h for h, _ in hosts)}",
                    *([f"--exclude={','.join(sorted(self.excluded))}"] if self.excluded else []),
                    *self.args.command]
        return [*self.mpiexec(), *self.host_arguments(hosts, env),
                "-n", str(sum(n for _, n in hosts)), *self.args.command]

    def launch(self, hosts, restart: int, lost_dir: str) -> tuple[int, str]:
        """Run the job once; echo its output as it comes; (exit status, output)."""
        env = dict(os.environ, MPIDDP_LOST_NODES_DIR=lost_dir,
                   MPIDDP_ELASTIC_RESTART=str(restart),
                   **{LAUNCH_HOSTS: ",".join(rank_hosts(hosts))})
        proc = subprocess.Popen(self.command(hosts, env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, bufsize=1)
        forward = lambda signum, frame: os.killpg(proc.pid, signum)     # noqa: E731
        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT,
                                                           signal.SIGUSR1)}
        lines: list[str] = []
        echo = threading.Thread(target=self._echo, args=(proc.stdout, lines), daemon=True)
        echo.start()
        try:
            status = self._wait(proc, lost_dir)
            echo.join(timeout=5)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            try:                        # leave no rank behind, whatever happened
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return status, "".join(lines)

    @staticmethod
    def _echo(stream, lines: list) -> None:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)

    @staticmethod
    def _wait(proc: subprocess.Popen, lost_dir: str) -> int:
        """The job's exit status; mpiexec is ended where it outlives a watchdog's report of
        lost nodes by ``REPORTED_MPIEXEC_GRACE_S``."""
        reported = None
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if reported is None:
                if any(name.startswith("lost.") for name in os.listdir(lost_dir)):
                    reported = time.monotonic()
            elif time.monotonic() - reported > REPORTED_MPIEXEC_GRACE_S:
                say(f"mpiexec has not ended {REPORTED_MPIEXEC_GRACE_S:g} s after a watchdog "
                    "reported lost nodes (it may be waiting for a node that is gone): "
                    "ending it")
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()

    def lost_nodes(self, output: str, lost_dir: str,
                   hosts: list[tuple[str, int]] = ()) -> tuple[set[str], set[str], dict]:
        """What the job's end (on ``hosts``) says: (nodes lost by mpiexec's or srun's
        account, nodes where a rank crashed, the watchdogs' reports {reporting node: nodes it
        found lost})."""
        lost, crashed, reports = set(), set(), {}
        for name in sorted(os.listdir(lost_dir)):
            if name.startswith("lost."):
                with open(os.path.join(lost_dir, name)) as f:
                    lines = [line.strip() for line in f if line.strip()]
                reporter = next((line[len("# from "):] for line in lines
                                 if line.startswith("# from ")), f"rank {name[5:]}")
                named = {line for line in lines if not line.startswith("#")}
                say(f"rank {name[5:]}'s watchdog found lost: {', '.join(sorted(named))}")
                reports.setdefault(reporter, set()).update(named)
        placed = rank_hosts(list(hosts))
        ended = hydra_ended(output) + [
            (placed[int(rank)] if int(rank) < len(placed) else node, code)
            for rank, node, code in OPEN_MPI_ENDED.findall(output)]
        for host, code in ended:        # (host, signal or exit code), hydra's and Open MPI's
            if int(code) in KILLED_SIGNALS:
                lost.add(host)
            elif int(code) in CRASH_SIGNALS:
                crashed.add(host)
        if OPEN_MPI_LOST_DAEMON.search(output):
            # Named by hostname, which need not be how the hosts were given: let the probe
            # before the relaunch find which node it was.
            crashed.add("a node whose Open MPI daemon was lost")
        # A proxy that ended abnormally may have been killed on a node that is alive: the probe
        # decides. A host where no proxy could start is lost, as it would fail the probe.
        crashed.update(f"{host}, whose Intel MPI proxy was lost"
                       for host in INTEL_LOST_PROXY.findall(output))
        for host in sorted(set(INTEL_NO_PROXY.findall(output))):
            say(f"mpiexec could not start its proxy on {host} (\"Unable to run bstrap_proxy on "
                f"{host}\"): the host is down or unreachable, its name is wrong, or ssh to it "
                "asks for a password (Intel MPI starts its proxies over passwordless ssh, or "
                "through the scheduler inside a Slurm or PBS job)")
            lost.add(host)
        # Once srun aborts the step (a rank called MPI_Abort: it found a partner gone), it
        # kills the tasks still running, which it then reports "Killed" too: only the tasks
        # killed before that, and nodes that failed, are lost.
        aborted = output.find(SRUN_STEP_ABORTED)
        for match in SRUN_LOST.finditer(output):
            if match.group(2) or aborted < 0 or match.start() < aborted:
                lost.add(match.group(1) or match.group(2))
        return lost, crashed, reports

    def decide_lost(self, hosts: list[str], lost: set[str], reports: dict) -> set[str]:
        """The nodes to leave out: those hydra or srun named, those the probe cannot start a
        process on, and those the watchdogs named, except in the report of a node that is
        itself lost (a node cut off finds every other node lost)."""
        named = set().union(*reports.values())
        # A report naming every other node is what a node cut off says; it may be the only
        # report when the survivors' ranks crashed before their watchdogs spoke (seen in
        # CI: MPICH on a survivor died of the broken connection first). Probe then.
        cut_off_like = any(found >= set(hosts) - {reporter} for reporter, found in reports.items())
        if not named & set(reports) and not cut_off_like:
            # The reports agree (no reporter is named lost by another): no need to wait for
            # the probe of the nodes they name, which takes its whole timeout on a cut link.
            return set(lost) | named | self.unreachable(
                [h for h in hosts if h not in lost | named])
        lost = set(lost) | self.unreachable([h for h in hosts if h not in lost])
        for reporter, found in reports.items():
            if reporter in lost:
                say(f"not believing {reporter}'s watchdog: its own node is lost")
            else:
                lost |= found
        return lost

    def unreachable(self, hosts: list[str]) -> set[str]:
        """The hosts where the launcher cannot start ``true`` within ``PROBE_TIMEOUT_S`` (all
        probed at once). Only through mpiexec: under srun, Slurm's node health does this."""
        if self.use_srun or not hosts:
            return set()
        probes = {h: subprocess.Popen([*self.mpiexec(), *self.host_arguments([(h, 1)]), "-n",
                                       "1", "true"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True) for h in hosts}
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        failed = set()
        for host, probe in probes.items():
            try:
                if probe.wait(max(0.0, deadline - time.monotonic())) != 0:
                    failed.add(host)
            except subprocess.TimeoutExpired:
                failed.add(host)
            finally:
                try:
                    os.killpg(probe.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                probe.wait()
        if failed:
            say(f"probe: no process starts on {', '.join(sorted(failed))} within "
                f"{PROBE_TIMEOUT_S:g} s: lost")
        return failed

    def run(self) -> int:
        args = self.args
        for restart in range(args.max_restarts + 1):
            hosts = [(h, n) for h, n in self.candidates() if h not in self.excluded]
            if len(hosts) < args.min_nodes:
                say(f"only {len(hosts)} node(s) left ({', '.join(h for h, _ in hosts) or 'none'}"
                    f"; lost: {', '.join(sorted(self.excluded)) or 'none'}), fewer than "
                    f"--min-nodes {args.min_nodes}: stopping. The last snapshot is kept; "
                    "run again with more nodes to go on from it.")
                return EXIT_TOO_FEW_NODES
            say(f"{'launch' if restart == 0 else f'relaunch {restart}'} on {len(hosts)} "
                f"node(s): {', '.join(f'{h}:{n}' for h, n in hosts)}")
            started = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="mpiddp-run-") as lost_dir:
                status, output = self.launch(hosts, restart, lost_dir)
                lost, crashed, reports = self.lost_nodes(output, lost_dir, hosts)
            ran = time.monotonic() - started
            if status == 0:
                say(f"the job finished after {ran:.1f} s")
                return 0
            if status == EXIT_PREEMPTED:
                say(f"the job was preempted (status {status}): passing it on")
                return status
            if not lost and not crashed and not reports:
                say(f"the job failed (status {status}) with no node lost and no rank "
                    "killed: not running it again")
                return status
            if crashed:
                say(f"a rank crashed on {', '.join(sorted(crashed))}")
            # A crash may be a survivor's reaction to a node it lost, which nobody may have
            # named yet; a watchdog may be on the cut-off side. So before relaunching, every
            # node not known lost must prove that a process starts there.
            lost = self.decide_lost([h for h, _ in hosts], lost, reports)
            if not lost:
                say(f"the job ended (status {status}) after {ran:.1f} s with every node "
                    "alive: relaunching on the same nodes from the last snapshot")
                continue
            # With a discovery command, a node lost now is left out of the next launch only:
            # the command may list it again later (it came back). A fixed list cannot say.
            self.excluded = lost if args.host_discovery_script else self.excluded | lost
            say(f"the job ended (status {status}) after {ran:.1f} s: lost node(s) "
                f"{', '.join(sorted(lost))}; relaunching on the others from the last snapshot")
        say(f"{args.max_restarts} relaunches done: giving up")
        return 1


def main(argv=None) -> int:
    launcher = Launcher(parse_args(argv))
    try:
        return launcher.run()
    finally:
        launcher.close()


if __name__ == "__main__":
    sys.exit(main())
