"""mpiddp.elastic: snapshots that restore on any rank count, and a sampler that trains every
sample of an interrupted epoch exactly once across a resize (docs/elastic.md)."""
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from mpi_launch import ROOT, Job, assert_ok, mpi_command, process_gone, reported, run_mpi
from mpiddp.elastic import ElasticSampler, State, list_snapshots, write_durably
from mpiddp.torch.features.elastic import _newest_readable


def trained(dataset: int, batch: int, sizes_and_steps, seed=3) -> Counter:
    """Sample ids trained in one epoch by ranks of successive runs (size, steps to run)."""
    seen, consumed = Counter(), 0
    for size, steps in sizes_and_steps:
        samplers = [ElasticSampler(dataset, batch, seed=seed, rank=r, size=size)
                    for r in range(size)]
        for s in samplers:
            s.set_epoch(0, consumed=consumed)
        iterators = [iter(s) for s in samplers]
        for _ in range(steps):
            batches = [next(it, None) for it in iterators]
            if batches[0] is None:
                assert all(b is None for b in batches), "ranks ran different step counts"
                break
            for b in batches:
                seen.update(b)
        consumed = samplers[0].consumed
        assert all(s.consumed == consumed for s in samplers)
    return seen


@pytest.mark.parametrize("plan", [[(3, 4), (2, 100)], [(2, 1), (5, 3), (1, 100)],
                                  [(4, 100)], [(1, 7), (7, 100)]])
def test_every_sample_once_across_resizes(plan):
    seen = trained(101, 4, plan)
    assert sorted(seen) == list(range(101)), f"skipped: {set(range(101)) - set(seen)}"
    assert max(seen.values()) == 1, f"duplicated: {[i for i, n in seen.items() if n > 1]}"


def test_ranks_run_the_same_number_of_steps():
    for size in range(1, 9):
        lengths = {len(list(ElasticSampler(37, 3, rank=r, size=size))) for r in range(size)}
        assert len(lengths) == 1, f"{size} ranks: step counts {lengths}"


def test_a_half_written_snapshot_is_never_loaded(tmp_path):
    write_durably(str(tmp_path / "snapshot-3-a.pt"), _saved({"n": 3}))
    # A writer killed mid-write leaves only its temporary file behind:
    (tmp_path / "snapshot-4-b.pt.tmp123").write_bytes(_saved({"n": 4})[:20])
    # A file corrupted on disk after its rename is skipped for an older one.
    (tmp_path / "snapshot-5-c.pt").write_bytes(b"not a snapshot")
    assert sorted(n for n, _, _ in list_snapshots(str(tmp_path))) == [3, 5]
    assert _newest_readable(str(tmp_path)) == (3, {"n": 3})


def _saved(obj) -> bytes:
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def epoch_ids(directory) -> dict[int, Counter]:
    counts: dict[int, Counter] = {}
    for path in directory.glob("ids.*"):
        for line in path.read_text().splitlines():
            epoch, sample = map(int, line.split())
            counts.setdefault(epoch, Counter())[sample] += 1
    return counts


def test_resize_from_three_ranks_to_two(tmp_path):
    """3 ranks stop part-way through epoch 2; 2 ranks restore and finish: every epoch trains
    each of the 103 samples once, parameters and momentum are equal on every rank."""
    first = run_mpi("elastic_worker.py", 3, tmp_path, 3, "--stop-at", 12, timeout=120)
    assert_ok(first)
    stopped = reported(first, "stopped")[0]
    assert stopped == {"check": "stopped", "step": 12, "consumed": 36}, stopped
    second = run_mpi("elastic_worker.py", 2, tmp_path, 3, timeout=120)
    assert_ok(second)
    restored = reported(second, "restored")[0]
    assert restored["restored"] and restored["epoch"] == 1 and restored["consumed"] == 36, \
        restored
    ids = epoch_ids(tmp_path)
    assert sorted(ids) == [0, 1, 2]
    for epoch, counts in ids.items():
        assert sorted(counts) == list(range(103)), f"epoch {epoch}: samples skipped"
        assert max(counts.values()) == 1, \
            f"epoch {epoch}: duplicated {[i for i, n in counts.items() if n > 1]}"
    finished = reported(second, "finished")
    assert len(finished) == 2 and finished[0]["params"] == finished[1]["params"]


def test_a_sharded_optimizer_resizes_without_a_conversion(tmp_path):
    """zero_stage=2 on 3 ranks, then 2, then 5: commits hold the whole optimizer state, which
    each next run re-shards over its own ranks; the parameters end as those of the same
    resizes unsharded (both on the ring, so that the sums are added in the same order),
    trained side by side in the same launches."""
    env = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}
    both = ("--zero-stage", "0,2")
    for ranks, stop in ((3, 9), (2, 18)):
        assert_ok(run_mpi("elastic_worker.py", ranks, tmp_path, 2, "--stop-at", stop, *both,
                          timeout=150, env=env))
    last = run_mpi("elastic_worker.py", 5, tmp_path, 2, *both, timeout=150, env=env)
    assert_ok(last)
    ends = []
    for stage in (0, 2):
        restored = reported(last, f"restored stage {stage}")[0]
        assert restored["restored"] and restored["step"] == 18, restored
        finished = reported(last, f"finished stage {stage}")
        assert len(finished) == 5
        assert all(f["params"] == finished[0]["params"] for f in finished)
        ends.append(finished[0]["params"])
    assert ends[0] == ends[1]


def elastic_launch(tmp_path, *launcher_args, die_at=12, timeout=150, freeze=False, env=None,
                   die_runs=1):
    """``python -m mpiddp.run`` on two "nodes" of this machine (hydra starts both locally:
    localhost and 127.0.0.1); the worker's last rank, on 127.0.0.1, SIGKILLs itself at
    ``die_at`` in the first run."""
    cmd, env = mpi_command("elastic_worker.py", 2, tmp_path, 3, "--die-at", die_at,
                           "--die-runs", die_runs, *(["--freeze"] if freeze else []), env=env)
    worker_cmd = cmd[cmd.index("-n") + 2:]
    hosts = [] if "--host-discovery-script" in launcher_args else \
        ["--hosts", "localhost:1,127.0.0.1:1"]
    launcher = [sys.executable, "-m", "mpiddp.run", *hosts, *map(str, launcher_args), "--",
                *worker_cmd]
    started = time.monotonic()
    result = Job(launcher, env).wait(timeout)
    return result, time.monotonic() - started


def test_launcher_relaunches_without_the_lost_node(tmp_path):
    result, _ = elastic_launch(tmp_path, "--min-nodes", 1)
    assert_ok(result)
    assert "lost node(s) 127.0.0.1; relaunching" in result.output, result.output
    assert "relaunch 1 on 1 node(s): localhost:1" in result.output, result.output
    restored = [r for r in reported(result, "restored") if r["restored"]]
    assert restored and restored[0]["step"] == 12 and restored[0]["size"] == 1, result.output
    ids = epoch_ids(tmp_path)
    for epoch, counts in ids.items():
        assert sorted(counts) == list(range(103)), f"epoch {epoch}: samples skipped"
        assert max(counts.values()) == 1, f"epoch {epoch}: samples trained twice"
    assert no_worker_left(tmp_path)


def test_launcher_relaunches_when_the_watchdog_finds_a_rank_gone(tmp_path):
    """A frozen rank (as a node whose link is down) is found by the lost-peer watchdog,
    which names its launch host to the launcher through MPIDDP_LOST_NODES_DIR."""
    result, elapsed = elastic_launch(tmp_path, "--min-nodes", 1, freeze=True,
                                     env={"MPIDDP_PEER_CHECK_TIME": "2"})
    assert_ok(result)
    assert "rank 0's watchdog found lost: 127.0.0.1" in result.output, result.output
    assert "relaunch 1 on 1 node(s): localhost:1" in result.output, result.output
    restored = [r for r in reported(result, "restored") if r["restored"]]
    assert restored and restored[0]["step"] == 12, result.output
    assert no_worker_left(tmp_path)


def test_a_node_listed_again_by_discovery_rejoins_at_the_next_relaunch(tmp_path):
    """Discovery lists both hosts every time. Run 1 loses 127.0.0.1 and run 2 (on localhost
    alone) loses localhost: run 3 goes on 127.0.0.1, which came back, and finishes."""
    result, _ = elastic_launch(tmp_path, "--host-discovery-script",
                               "echo localhost:1; echo 127.0.0.1:1", die_runs=2)
    assert_ok(result)
    assert "relaunch 1 on 1 node(s): localhost:1" in result.output, result.output
    assert "relaunch 2 on 1 node(s): 127.0.0.1:1" in result.output, result.output
    steps = [r["step"] for r in reported(result, "restored") if r["restored"]]
    assert steps == [12, 24], result.output
    ids = epoch_ids(tmp_path)
    for epoch, counts in ids.items():
        assert sorted(counts) == list(range(103)) and max(counts.values()) == 1, epoch
    assert no_worker_left(tmp_path)


def test_launcher_stops_below_min_nodes_keeping_the_snapshot(tmp_path):
    result, _ = elastic_launch(tmp_path, "--min-nodes", 2)
    assert not result.timed_out and result.returncode == 3, result.output
    assert "only 1 node(s) left (localhost; lost: 127.0.0.1), fewer than --min-nodes 2: " \
           "stopping" in result.output, result.output
    assert _newest_readable(str(tmp_path))[1]["step"] == 12
    assert no_worker_left(tmp_path)


def test_launcher_does_not_rerun_a_failing_script(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = Job([sys.executable, "-m", "mpiddp.run", "--hosts", "localhost:2", "--",
                  sys.executable, "-c", "import sys; sys.exit(4)"], env).wait(60)
    assert result.returncode == 4, result.output
    assert "failed (status 4) with no node lost and no rank killed: not running it again" \
        in result.output
    assert result.output.count("launch") == 1, result.output


def test_a_host_intel_mpi_cannot_reach_is_named(tmp_path):
    """Under Intel MPI (scripts/dev/test_intelmpi.sh): a host where its mpiexec cannot start its
    proxy is named, with the likely causes, and left out like a lost node."""
    from mpi_launch import mpiexec_path
    from mpiddp.run import mpiexec_family
    if mpiexec_family([mpiexec_path()]) != "intel":
        pytest.skip("needs Intel MPI's mpiexec (scripts/dev/test_intelmpi.sh)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = Job([sys.executable, "-m", "mpiddp.run", "--hosts", "no-such-host.invalid:1",
                  "--", sys.executable, "-c", "print('STARTED')"], env).wait(60)
    assert result.returncode == 3, result.output
    assert "mpiexec could not start its proxy on no-such-host.invalid (\"Unable to run " \
           "bstrap_proxy on no-such-host.invalid\"): the host is down or unreachable, its " \
           "name is wrong, or ssh to it asks for a password" in result.output, result.output
    assert "only 0 node(s) left (none; lost: no-such-host.invalid)" in result.output
    assert "STARTED" not in result.output


def test_the_launcher_imports_no_torch():
    code = "import sys, runpy; sys.modules['torch'] = None; " \
           "import importlib.util as u; spec = u.spec_from_file_location('r', 'mpiddp/run.py');" \
           "m = u.module_from_spec(spec); spec.loader.exec_module(m); print(m.parse_hosts(" \
           "'a:2,b\\nc slots=3', 1))"
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "[('a', 2), ('b', 1), ('c', 3)]", out.stderr
    # Run as users run it: `python -m mpiddp.run` imports the package first, which must then
    # load neither torch nor mpi4py.MPI (an MPI initialised in the batch script, outside any
    # job step; before, it did both).
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "mpiddp.run", "--help"],
                         cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: python -m mpiddp.run" in out.stdout, out.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")]
    assert "mpiddp" in imported, imported       # the package, run.py then runs as __main__
    assert not [m for m in imported if m.split(".")[0] in ("torch", "mpi4py", "numpy")], imported


@pytest.mark.parametrize("orig_argv, launcher", [
    (["python", "-m", "mpiddp.run", "--hosts", "a:2"], True),
    (["python", "-Im", "mpiddp.run"], True), (["python", "-mmpiddp.run"], True),
    (["python", "-X", "importtime", "-u", "-m", "mpiddp.run"], True),
    (["python", "-Ximporttime", "-Bm", "mpiddp.run"], True),
    (["python", "-W", "ignore", "-m", "mpiddp.run"], True),
    (["python", "train.py", "-m", "mpiddp.run"], False),        # the script's own arguments
    (["python", "-c", "import mpiddp", "-m", "mpiddp.run"], False),
    (["python", "-m", "mylib.train"], False),     # a package of the user's imports mpiddp
])
def test_the_launcher_is_told_by_the_interpreters_options(orig_argv, launcher):
    import mpiddp
    assert mpiddp._running_the_launcher(orig_argv, ["-m"]) is launcher
    # and only while -m locates its module (afterwards sys.argv[0] is the module's path)
    assert mpiddp._running_the_launcher(orig_argv, ["/x/mpiddp/run.py"]) is False


def no_worker_left(directory) -> bool:
    """No process whose command line names this test's directory is still running."""
    time.sleep(0.5)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(directory).encode() in f.read() and not process_gone(int(pid)):
                    return False
        except OSError:
            continue
    return True


def test_state_extras_and_consumed_are_attributes():
    sampler = ElasticSampler(10, 2, rank=0, size=1)
    state = State(torch.nn.Linear(1, 1), sampler=sampler, directory="unused", writer=False,
                  seen=3)
    state.seen += 1
    state.consumed = 4
    assert (state.seen, sampler.consumed, state.consumed) == (4, 4, 4)
    with pytest.raises(ValueError, match="would hide"):
        State(torch.nn.Linear(1, 1), directory="unused", writer=False, commit=1)


def test_srun_command_excludes_the_lost_nodes():
    from mpiddp.run import Launcher, parse_args
    launcher = Launcher(parse_args(["--launcher", "srun", "-N", "2", "--", "python", "t.py"]))
    launcher.excluded = {"n3"}
    cmd = launcher.command([("n1", 2), ("n2", 2)])
    assert cmd[:2] == ["srun", "--mpi=pmi2"] and cmd[-2:] == ["python", "t.py"], cmd
    for arg in ("--no-kill", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                "--nodelist=n1,n2", "--exclude=n3"):
        assert arg in cmd, (arg, cmd)


def test_lost_nodes_from_srun_and_hydra_output(tmp_path):
    from mpiddp.run import Launcher, parse_args
    launcher = Launcher(parse_args(["--", "true"]))
    (tmp_path / "lost.0").write_text("# from n1\nn7\n")
    (tmp_path / "lost.3").write_text("# from n7\nn1\nn2\n")
    srun_out = "srun: error: n4: task 3: Killed\nsrun: error: Node failure on n5\n"
    hydra_out = ("=   PID 1 RUNNING AT 10.0.0.9\n=   EXIT CODE: 9\n"
                 "=   PID 2 RUNNING AT 10.0.0.8\n=   EXIT CODE: 11\n")
    assert launcher.lost_nodes(srun_out + hydra_out, str(tmp_path)) == (
        {"n4", "n5", "10.0.0.9"}, {"10.0.0.8"}, {"n1": {"n7"}, "n7": {"n1", "n2"}})
    # A rank that exits with an error status on a live node is not a lost node.
    (tmp_path / "empty").mkdir()
    # Once a survivor aborted the step, srun kills the other tasks and says so: not lost.
    aborted = ("srun: error: n2: task 2: Killed\n"
               "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
               "srun: error: n0: task 0: Killed\nsrun: error: n1: task 1: Killed\n"
               "srun: error: Node failure on n3\n")
    assert launcher.lost_nodes(aborted, str(tmp_path / "empty"))[0] == {"n2", "n3"}
    assert launcher.lost_nodes("=   PID 1 RUNNING AT h\n=   EXIT CODE: 1\n"
                               "srun: error: n4: task 3: Exited with exit code 1\n",
                               str(tmp_path / "empty")) == (set(), set(), {})


def fake_mpiexec(tmp_path, version: str) -> str:
    script = tmp_path / "mpiexec"
    script.write_text(f"#!/bin/sh\necho '{version}'\n")
    script.chmod(0o755)
    return str(script)


def test_open_mpi_and_hydra_commands(tmp_path):
    """Open MPI's mpiexec takes --host, fills the hosts in order and forwards only the
    variables named with -x; hydra's takes -hosts and forwards everything."""
    from mpiddp.run import Launcher, parse_args
    env = {"MPIDDP_LOST_NODES_DIR": "/d", "MPIDDP_LAUNCH_HOSTS": "n1,n1,n2,n2", "HOME": "/h"}
    hosts = [("n1", 2), ("n2", 2)]
    ompi = fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.11")
    launcher = Launcher(parse_args(["--mpiexec", ompi, "--", "python", "t.py"]))
    assert launcher.command(hosts, env) == [
        ompi, "--host", "n1:2,n2:2", "--map-by", "slot", "-x", "MPIDDP_LAUNCH_HOSTS",
        "-x", "MPIDDP_LOST_NODES_DIR", "-n", "4", "python", "t.py"]
    (tmp_path / "hydra").mkdir()
    hydra = fake_mpiexec(tmp_path / "hydra", "HYDRA build details:")
    launcher = Launcher(parse_args(["--mpiexec", hydra, "--", "python", "t.py"]))
    assert launcher.command(hosts, env) == [hydra, "-hosts", "n1:2,n2:2", "-n", "4", "python",
                                            "t.py"]


def test_intel_mpi_commands(tmp_path):
    """Intel MPI's -hosts takes names only (an entry 'n1:2' is a host it cannot reach) and,
    without -ppn, fills the first host with as many ranks as it has cores: -ppn when every
    host has the same slots, a machine file of 'host:slots' lines when they differ."""
    from mpiddp.run import Launcher, mpiexec_family, parse_args
    intel = fake_mpiexec(tmp_path, "Intel(R) MPI Library for Linux* OS, Version 2021.14 "
                                   "Build 20240911 (id: b3fc682)")
    assert mpiexec_family([intel]) == "intel"
    launcher = Launcher(parse_args(["--mpiexec", intel, "--", "python", "t.py"]))
    env = {"MPIDDP_LOST_NODES_DIR": "/d"}
    assert launcher.command([("n1", 2), ("n2", 2)], env) == [
        intel, "-hosts", "n1,n2", "-ppn", "2", "-n", "4", "python", "t.py"]
    assert launcher.host_arguments([("n3", 1)]) == ["-hosts", "n3", "-ppn", "1"]   # the probe
    cmd = launcher.command([("n1", 2), ("n2", 1)], env)
    machine_file = cmd[cmd.index("-machinefile") + 1]
    assert cmd == [intel, "-machinefile", machine_file, "-n", "3", "python", "t.py"], cmd
    with open(machine_file) as f:
        assert f.read() == "n1:2\nn2:1\n"
    launcher.close()
    assert not os.path.exists(machine_file)


def test_lost_nodes_from_intel_mpi_output(tmp_path):
    """Intel MPI's reports, as its mpiexec 2021.14 printed them here: a rank killed (it reports
    every rank of that node, which its proxy killed too), a crash, a node whose proxy was lost,
    and a host where no proxy could start. The ranks' own output shares lines with them."""
    from mpiddp.run import Launcher, parse_args
    launcher = Launcher(parse_args(["--", "true"]))
    killed = ("upup 0 30488\n 1 30489\nup 2 30486\n\n" + "=" * 83 + "\n"
              "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
              "=   RANK 2 PID 30486 RUNNING AT 127.0.0.1\n=   KILLED BY SIGNAL: 9 (Killed)\n"
              + "=" * 83 + "\nstep 12 done\n" + "=" * 83 + "\n"
              "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
              "=   RANK 3 PID 30487 RUNNING AT 127.0.0.1\n=   KILLED BY SIGNAL: 9 (Killed)\n")
    assert launcher.lost_nodes(killed, str(tmp_path)) == ({"127.0.0.1"}, set(), {})
    crashed = ("=   RANK 1 PID 30070 RUNNING AT node-b\n"
               "=   KILLED BY SIGNAL: 11 (Segmentation fault)\n")
    assert launcher.lost_nodes(crashed, str(tmp_path)) == (set(), {"node-b"}, {})
    lost_proxy = ("up 1 31487\n[mpiexec@vm] Error: Downstream from host node-c exited "
                  "abnormally\n[mpiexec@vm] Trying to close other downstreams\n")
    lost, crashed, _ = launcher.lost_nodes(lost_proxy, str(tmp_path))
    assert not lost and crashed == {"node-c, whose Intel MPI proxy was lost"}   # the probe decides
    no_proxy = ("[mpiexec@vm] Error: Unable to run bstrap_proxy on node-d (pid 30858, exit code "
                "65280)\n[mpiexec@vm] Error setting up the bootstrap proxies\n")
    assert launcher.lost_nodes(no_proxy, str(tmp_path)) == ({"node-d"}, set(), {})
    # An MPI_Abort (a watchdog ending the job) names no node.
    aborted = ("Abort(1) on node 0 (rank 0 in comm 0): application called "
               "MPI_Abort(MPI_COMM_WORLD, 1) - process 0\n")
    assert launcher.lost_nodes(aborted, str(tmp_path)) == (set(), set(), {})


def test_lost_nodes_from_open_mpi_output(tmp_path):
    """Open MPI names a node by its hostname; the rank names it as launched."""
    from mpiddp.run import Launcher, parse_args, rank_hosts
    assert rank_hosts([("a", 2), ("b", 2)]) == ["a", "a", "b", "b"]
    launcher = Launcher(parse_args(["--", "true"]))
    out = ("prterun noticed that process rank 3 with PID 27617 on node vm exited on\n"
           "signal 9 (Killed).\n"
           "prterun noticed that process rank 1 with PID 27600 on node vm exited on signal "
           "11 (Segmentation fault).\n")
    assert launcher.lost_nodes(out, str(tmp_path), [("a", 2), ("b", 2)]) == \
        ({"b"}, {"a"}, {})
    # A rank beyond the host list (not launched by this launcher) keeps Open MPI's name.
    assert launcher.lost_nodes(out, str(tmp_path), [("a", 2)])[0] == {"vm"}
    lost, crashed, _ = launcher.lost_nodes(
        "PRTE has lost communication with a remote daemon.\n", str(tmp_path), [("a", 1)])
    assert not lost and crashed, crashed      # the probe before the relaunch names it


def test_launch_host_from_the_launchers_host_list(monkeypatch):
    """Under Open MPI (no PMI_HOSTNAME) a rank's launch host is its place in mpiddp.run's
    host list."""
    from mpiddp.engine.liveness import launch_host
    for name in ("PMI_HOSTNAME", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPIDDP_LAUNCH_HOSTS", "node-a,node-a,node-b,node-b")
    assert launch_host() == "node-a"            # this process is rank 0 of its world
    monkeypatch.setenv("PMI_HOSTNAME", "10.0.0.7")
    assert launch_host() == "10.0.0.7"


@pytest.mark.alone      # ended within 20 s (its fake mpiexec would sleep 300)
def test_mpiexec_that_outlives_a_watchdogs_report_is_ended(tmp_path, monkeypatch, capsys):
    """Open MPI's mpiexec waits for the daemon of a node whose link is gone after every rank
    has ended; the launcher ends it a while after the watchdog's report and goes on."""
    import mpiddp.run as run
    fake = tmp_path / "mpiexec"            # hydra-like; the job reports n3 lost, then hangs
    fake.write_text("#!/bin/sh\n"
                    "[ \"$1\" = --version ] && { echo 'HYDRA build details:'; exit 0; }\n"
                    "for last; do :; done; [ \"$last\" = true ] && exit 0\n"
                    "printf '# from n1\\nn3\\n' > \"$MPIDDP_LOST_NODES_DIR/lost.0\"\n"
                    "exec sleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setattr(run, "REPORTED_MPIEXEC_GRACE_S", 1.0)
    launcher = run.Launcher(run.parse_args(["--mpiexec", str(fake), "--hosts", "n1,n2,n3",
                                            "--max-restarts", "0", "--", "train"]))
    started = time.monotonic()
    assert launcher.run() == 1                      # no relaunch left: gives up
    assert time.monotonic() - started < 20
    said = capsys.readouterr().err
    assert "mpiexec has not ended 1 s after a watchdog reported lost nodes" in said, said
    assert "lost node(s) n3; relaunching" in said, said


def test_the_report_of_a_node_cut_off_is_not_believed(monkeypatch):
    """n7 lost its link: to its watchdog n1 and n2 are lost, to n1's n7 is. The probe finds
    n7 unreachable, so n7's report is discarded; a frozen rank on a reachable node (n3,
    named by n1) is lost all the same."""
    from mpiddp.run import Launcher, parse_args
    launcher = Launcher(parse_args(["--", "true"]))
    monkeypatch.setattr(launcher, "unreachable", lambda hosts: {"n7"} & set(hosts))
    reports = {"n1": {"n7", "n3"}, "n7": {"n1", "n2"}}
    assert launcher.decide_lost(["n1", "n2", "n3", "n7"], set(), reports) == {"n7", "n3"}
    assert launcher.decide_lost(["n1", "n2", "n3"], {"n9"}, {}) == {"n9"}
    # Reports that agree are believed without probing the nodes they name.
    probed = []
    monkeypatch.setattr(launcher, "unreachable", lambda hosts: probed.extend(hosts) or set())
    assert launcher.decide_lost(["n1", "n2", "n7"], set(), {"n1": {"n7"}, "n2": {"n7"}}) == \
        {"n7"}
    assert sorted(probed) == ["n1", "n2"]
    # The only report is from the node cut off (the survivors' ranks crashed first): it
    # names every other node, so the launcher probes them all and believes the probe.
    monkeypatch.setattr(launcher, "unreachable", lambda hosts: {"n7"} & set(hosts))
    assert launcher.decide_lost(["n1", "n2", "n7"], set(), {"n7": {"n1", "n2"}}) == {"n7"}
    assert launcher.decide_lost(["n1", "n7"], set(), {"n7": {"n1"}}) == {"n7"}


@pytest.mark.alone      # the probe's timeout: within 10 s (a hung host sleeps 60)
def test_probe_names_the_hosts_where_nothing_starts(tmp_path, monkeypatch):
    """Before a relaunch the launcher starts 'true' on every remaining host through its
    mpiexec; a host where that hangs (a cut link) or fails is lost, the others stay."""
    import mpiddp.run as run
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\n# -hosts HOST:1 -n 1 true\n"
                    'case "$2" in down*) sleep 60 ;; broken*) exit 1 ;; esac\nexec "$5"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(run, "PROBE_TIMEOUT_S", 2.0)
    launcher = run.Launcher(run.parse_args(["--mpiexec", str(fake), "--", "true"]))
    started = time.monotonic()
    assert launcher.unreachable(["up1", "down1", "broken1", "up2"]) == {"down1", "broken1"}
    assert time.monotonic() - started < 10
    srun = run.Launcher(run.parse_args(["--launcher", "srun", "--", "true"]))
    assert srun.unreachable(["down1"]) == set()       # Slurm's node health does it there