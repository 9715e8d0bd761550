"""Single-process tests of the pure logic: settings, chunking, fusion plans, negotiation,
the response cache and stall reports."""
import dataclasses
import math
import os
from pathlib import Path

import pytest

from mpiddp.collectives.ring import chunk_bounds, owned_chunk
from mpiddp.collectives.shard_grid import RING_BY_NODE, RING_FLAT, RING_HYBRID, ShardGrid
from mpiddp.config import Settings, read_settings, setting_fields, unknown_settings
from mpiddp.errors import LaunchError
from mpiddp.horovod_env import HONOURED, horovod_messages
from mpiddp.launch_check import check_launch, ranks_on_this_node
from mpiddp.engine.fusion import plan_batches
from mpiddp.engine.cache_capacity import CapacityWatch
from mpiddp.engine.negotiation import RequestTable, ResponseCache, agree
from mpiddp.engine.request import (ALLGATHER, ALLREDUCE, BROADCAST, REDUCESCATTER, REFUSED,
                                   Request, Response)
from mpiddp.engine.stall import describe_stalls, find_stalls

ROOT = Path(__file__).parent.parent


def test_settings_defaults_and_parsing():
    assert read_settings({}) == Settings()
    s = read_settings({"MPIDDP_CYCLE_TIME": "2.5", "MPIDDP_FUSION_THRESHOLD": "1024",
                       "MPIDDP_ABORT_ON_EXCEPTION": "off", "MPIDDP_ALLREDUCE_ALGORITHM": "Ring",
                       "MPIDDP_LOG_LEVEL": "debug", "MPIDDP_CUDA_AWARE": "1"})
    assert (s.cycle_time, s.fusion_threshold, s.abort_on_exception) == (2.5, 1024, False)
    assert (s.allreduce_algorithm, s.log_level, s.cuda_aware) == ("ring", "DEBUG", "1")


@pytest.mark.parametrize("env,needle", [
    ({"MPIDDP_FUSION_THRESHOLD": "big"}, "MPIDDP_FUSION_THRESHOLD='big' is not a valid int"),
    ({"MPIDDP_FUSION_THRESHOLD": "-1"}, "must be at least 0"),
    ({"MPIDDP_CYCLE_TIME": "0"}, "MPIDDP_CYCLE_TIME"),
    ({"MPIDDP_ALLREDUCE_ALGORITHM": "tree"},
     "auto, ring, halving_doubling, recursive_doubling, native"),
    ({"MPIDDP_ABORT_ON_EXCEPTION": "maybe"}, "not a boolean"),
    ({"MPIDDP_STALL_SHUTDOWN_TIME": "soon"}, "MPIDDP_STALL_SHUTDOWN_TIME='soon'"),
    ({"MPIDDP_LAUNCH_CHECK": "maybe"}, "MPIDDP_LAUNCH_CHECK='maybe' is not a boolean"),
    ({"MPIDDP_CACHE_CAPACITY": "0"}, "MPIDDP_CACHE_CAPACITY"),
])
def test_bad_settings_are_named(env, needle):
    with pytest.raises(ValueError, match=None) as info:
        read_settings(env)
    assert needle in str(info.value)


def test_every_setting_has_its_own_parser_and_is_documented():
    # Parsers are declared per field, never guessed from annotations (which are strings or
    # types depending on `from __future__ import annotations`).
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for f in setting_fields():
        assert callable(f.metadata.get("parser")), f"{f.name} has no parser"
        assert f"MPIDDP_{f.name.upper()}" in docs, f"MPIDDP_{f.name.upper()} is not documented"
        if f.default is None:        # unset: decided at run time (e.g. by the node layout)
            continue
        # The default survives a round trip through its own parser.
        default = f.default if not isinstance(f.default, bool) else int(f.default)
        assert read_settings({f"MPIDDP_{f.name.upper()}": str(default)}) == Settings()


def test_horovod_variables_with_our_meaning_are_read_as_settings():
    env = {"HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_LOG_LEVEL": "trace",
           "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
           "HOROVOD_AUTOTUNE": "1", "HOROVOD_CYCLE_TIME": "5", "HOROVOD_TIMELINE": "DYNAMIC",
           "HOROVOD_CACHE_CAPACITY": "0"}
    s = read_settings(env)
    assert (s.fusion_threshold, s.log_level, s.hierarchical_allreduce) == (64 << 20, "DEBUG", "1")
    assert (s.stall_check_time, s.autotune) == (30.0, True)
    # Another meaning in Horovod: not read.
    assert (s.cycle_time, s.timeline, s.cache_capacity) == (50.0, "", 1024)
    assert {"fusion_threshold", "autotune"} <= s.explicit     # autotune leaves them alone
    # An MPIDDP_* variable set too wins.
    assert read_settings({**env, "MPIDDP_FUSION_THRESHOLD": "1024"}).fusion_threshold == 1024


def test_horovod_variables_are_each_reported_once():
    infos, warnings = horovod_messages({
        "HOROVOD_FUSION_THRESHOLD": "1024", "MPIDDP_FUSION_THRESHOLD": "2048",
        "HOROVOD_AUTOTUNE_LOG": "/x.csv", "HOROVOD_TIMELINE": "DYNAMIC",
        "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_FROBNICATE": "1", "PATH": "/bin"})
    assert infos == ["HOROVOD_AUTOTUNE_LOG=/x.csv read as MPIDDP_AUTOTUNE_LOG=/x.csv"]
    assert warnings[0].startswith("HOROVOD_FROBNICATE ignored: mpiddp has no such setting")
    assert warnings[1] == ("HOROVOD_FUSION_THRESHOLD=1024 ignored: "
                           "MPIDDP_FUSION_THRESHOLD=2048 is set too and wins")
    assert warnings[2].startswith("HOROVOD_GPU_OPERATIONS ignored: a Horovod build variable")
    assert warnings[3].startswith("HOROVOD_TIMELINE=DYNAMIC ignored: ")
    assert "mpiddp.start_timeline()" in warnings[3]
    assert warnings[4].startswith("HOROVOD_WITH_PYTORCH ignored: a Horovod build variable")
    assert warnings[5].startswith("HOROVOD_RANK, HOROVOD_SIZE ignored: set by horovodrun")
    assert len(warnings) == 6
    # Every honoured variable names a real setting.
    settings = {f"MPIDDP_{f.name.upper()}" for f in setting_fields()}
    assert {rule.setting for rule in HONOURED.values()} <= settings


def test_unknown_settings_are_ignored_with_a_hint():
    env = {"MPIDDP_STALL_SHUTDOWN_TIM": "5", "MPIDDP_fusion_threshold": "1", "MPIDDP_XYZZY": "1",
           "MPIDDP_VENV": "/opt/venv", "MPIDDP_SYSTEM_TESTS": "1", "MPIDDP_CYCLE_TIME": "7"}
    assert read_settings(env) == Settings(cycle_time=7.0)      # no error, unknowns ignored
    assert unknown_settings(env) == [
        "unknown setting MPIDDP_STALL_SHUTDOWN_TIM (ignored); did you mean "
        "MPIDDP_STALL_SHUTDOWN_TIME?",
        "unknown setting MPIDDP_XYZZY (ignored) (settings are listed in docs/configuration.md)",
        "unknown setting MPIDDP_fusion_threshold (ignored); did you mean "
        "MPIDDP_FUSION_THRESHOLD?"]
    assert unknown_settings({"MPIDDP_VNEV": "x"}) == [
        "unknown setting MPIDDP_VNEV (ignored); did you mean MPIDDP_VENV?"]
    # The project's own script variables, settings and other programs' variables pass.
    assert unknown_settings({"MPIDDP_VENV": "x", "MPIDDP_SYSTEM_TESTS": "1",
                             "MPIDDP_TIMELINE": "1", "SLURM_NTASKS": "2"}) == []


def test_stall_shutdown_is_finite_by_default_and_zero_waits_forever():
    assert Settings().stall_shutdown_time == 600.0
    assert Settings().stall_check_time < Settings().stall_shutdown_time
    assert read_settings({"MPIDDP_STALL_SHUTDOWN_TIME": "0"}).stall_shutdown_time == 0.0


# What srun really sets (Slurm 22.05): the batch script has SLURM_NTASKS and SLURM_PROCID but no
# SLURM_STEP_ID; a step has SLURM_STEP_ID and SLURM_STEP_NUM_TASKS; --mpi=pmi2 adds PMI_SIZE
# and SLURM_MPI_TYPE; --mpi=none adds neither.
_BATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": "0"}
_STEP = dict(_BATCH, SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_STEP_NUM_TASKS="2")
_PMI2_STEP = dict(_STEP, PMI_SIZE="2", PMI_RANK="1", SLURM_MPI_TYPE="pmi2")
# What Intel MPI's mpiexec (2021.14) sets in rank 1 of 2 (among many I_MPI_INFO_* and
# HYDRA_BSTRAP_* variables): hydra's PMI and local-rank variables, no PMI_HOSTNAME.
_INTEL_HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "11", "MPI_LOCALRANKID": "1",
                "MPI_LOCALNRANKS": "2", "I_MPI_HYDRA_UUID": "85740000-2bcd-77e1-5661-060032fd876e",
                "I_MPI_PIN_MAPPING": "2:0 0,1 1", "HYDRA_BSTRAP_LOCALHOST": "vm"}


@pytest.mark.parametrize("mpi_size,env", [
    (1, {}),                                         # plain python
    (1, _BATCH),                                     # the batch script itself: one process
    (1, dict(_STEP, SLURM_STEP_NUM_TASKS="1")),      # srun -n 1
    (2, _STEP), (2, _PMI2_STEP),                     # srun that MPI understood
    (1, {"PMI_SIZE": "1"}), (4, {"PMI_SIZE": "4"}),  # mpiexec -n 1 / -n 4
    (3, {"OMPI_COMM_WORLD_SIZE": "3"}),
    (2, _INTEL_HYDRA),                               # Intel MPI's mpiexec -n 2
    (2, dict(_PMI2_STEP, I_MPI_PMI_LIBRARY="/usr/lib/x86_64-linux-gnu/libpmi2.so.0")),
    (1, dict(_STEP, PMI_SIZE="1")),                  # mpiexec -n 1 run inside a 2-task step
    (1, dict(_STEP, MPIDDP_LAUNCH_CHECK="0")),       # the escape hatch
])
def test_launch_check_accepts_real_launches(mpi_size, env):
    check_launch(mpi_size, env)


@pytest.mark.parametrize("env,needles", [
    (_STEP, ["srun started 2 tasks but MPI sees 1 process per task: each would train alone",
             "no PMI (--mpi=none", "srun --mpi=pmi2", "--mpi=pmix", "mpiexec",
             "MPIDDP_LAUNCH_CHECK=0"]),
    (_PMI2_STEP, ["srun started 2 tasks but MPI sees 1", "--mpi=pmi2, which this MPI library "
                  "does not use", "--mpi=pmix"]),
    (dict(_STEP, SLURM_MPI_TYPE="pmix"), ["--mpi=pmix, which this MPI library does not use"]),
    ({"PMI_SIZE": "4", "PMI_RANK": "0"}, ["mpiexec started 4 processes (PMI_SIZE=4)",
                                          "MPI.Get_library_version()"]),
    ({"OMPI_COMM_WORLD_SIZE": "8"}, ["Open MPI's mpirun started 8 processes",
                                     "mpiexec of the MPI library mpi4py uses"]),
    (_INTEL_HYDRA, ["Intel MPI's mpiexec started 2 processes (PMI_SIZE=2) but MPI sees 1",
                    "mpiexec of the MPI library mpi4py uses"]),
])
def test_launch_check_refuses_singletons(env, needles):
    with pytest.raises(LaunchError) as info:
        check_launch(1, env)
    for needle in needles:
        assert needle in str(info.value)


_MARKED = {"_MPIDDP_MPI_PID": "1234", "PMI_SIZE": "2"}     # rank 1234's mark, inherited


@pytest.mark.parametrize("env, modules, started_by, kept_out", [
    (_MARKED, {}, "1234", True),                    # the rank's 'spawn' worker (or forkserver)
    ({"_MPIDDP_MPI_PID": "1234"}, {}, "1234", True),    # any launcher's rank
    (_MARKED, {"mpi4py.MPI": object()}, "1234", False),  # forked: MPI is there
    (_MARKED, {}, "77", False),      # the mark came through a launcher: a rank itself, or the
                                     # real rank a wrapper forked
    ({"PMI_SIZE": "2"}, {}, "77", False),           # no mark: a plain process's children
])
def test_mpi_kept_out_of_the_processes_a_rank_starts(monkeypatch, env, modules, started_by,
                                                     kept_out):
    # A DataLoader worker that 'spawn' or 'forkserver' starts from a rank must not initialise
    # MPI when it imports mpiddp (tests/test_data_loader.py runs the real thing).
    import mpi4py

    from mpiddp.runtime import mpi_environment
    monkeypatch.setattr(mpi4py.rc, "initialize", True)
    monkeypatch.setattr(mpi_environment, "_kept_out", False)
    started = lambda pid: pid == started_by          # noqa: E731
    assert mpi_environment.keep_mpi_out_of_rank_children(env, modules, started) is kept_out
    assert mpi4py.rc.initialize is not kept_out
    assert mpi_environment.mpi_kept_out() is kept_out


def test_a_rank_marks_itself_for_its_children_and_knows_its_parents():
    from mpiddp.runtime import mpi_environment as env
    for world, environ, marked in [(2, {}, True), (1, {"PMI_SIZE": "1"}, True),
                                   (1, {}, False)]:      # alone: its children may be alone
        env.mark_mpi_process(world, environ)
        assert environ.get(env.MPI_PROCESS_VARIABLE) == (str(os.getpid()) if marked else None)
    assert env.started_by(str(os.getppid()))
    assert env.started_by(str(env.parent_of(os.getppid())))
    assert not env.started_by(str(os.getpid())) and env.parent_of(os.getpid()) == os.getppid()


@pytest.mark.parametrize("env, expected", [
    ({"MPI_LOCALNRANKS": "8"}, 8),                                     # hydra
    (_INTEL_HYDRA, 2),                                                 # Intel MPI's hydra
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3),                          # Open MPI
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}, 3),  # srun, 3rd node
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "1"}, 4),
    ({"SLURM_STEP_TASKS_PER_NODE": "6"}, 6),
    ({"SLURM_STEP_TASKS_PER_NODE": "garbage"}, None),
    ({}, None),
])
def test_ranks_on_this_node_from_the_launcher(env, expected):
    # Decides whether waiting MPICH ranks must yield their core (more ranks than cores).
    assert ranks_on_this_node(env) == expected


def test_the_intel_mpi_wheel_gets_its_root_under_srun(tmp_path):
    # Under srun with I_MPI_PMI_LIBRARY and no I_MPI_ROOT, impi-rt 2021.14 spins in MPI_Init
    # forever (tests/test_slurm.py runs the real thing): mpiddp names the wheel's prefix.
    from mpiddp.intel_mpi import wheel_root
    from mpiddp.runtime.mpi_environment import point_intel_mpi_at_its_files
    (tmp_path / "opt" / "mpi" / "etc").mkdir(parents=True)
    srun = {"I_MPI_PMI_LIBRARY": "/lib/x86_64-linux-gnu/libpmi2.so.0"}
    root = lambda env, **kw: wheel_root(env, str(tmp_path), installed=lambda: True)  # noqa
    assert root(srun) == str(tmp_path)
    assert root(dict(srun, I_MPI_ROOT="/opt/intel/oneapi/mpi/2021.14")) is None   # a module's
    assert root({}) is None                           # mpiexec, or srun with Intel's own PMI
    assert wheel_root(srun, str(tmp_path), installed=lambda: False) is None   # no wheel here
    assert wheel_root(srun, str(tmp_path / "elsewhere"), installed=lambda: True) is None
    environ = dict(srun)
    point_intel_mpi_at_its_files(environ, root=root)
    assert environ["I_MPI_ROOT"] == str(tmp_path)


@pytest.mark.parametrize("env, expected", [
    (_INTEL_HYDRA, (1, "MPI_LOCALRANKID")),                    # Intel MPI's (and MPICH's) hydra
    (dict(_INTEL_HYDRA, SLURM_LOCALID="0"), (1, "MPI_LOCALRANKID")),   # mpiexec in an srun step
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "SLURM_LOCALID": "0"}, (3, "OMPI_COMM_WORLD_LOCAL_RANK")),
    (dict(_PMI2_STEP, SLURM_LOCALID="1"), (1, "SLURM_LOCALID")),   # srun --mpi=pmi2 (Intel too)
    ({"MPI_LOCALRANKID": "x"}, None),
])
def test_local_rank_from_the_launcher(env, expected):
    # The GPU a rank takes before MPI starts (local_device.py).
    from mpiddp.launcher_env import launcher_local_rank
    assert launcher_local_rank(env) == expected


@pytest.mark.parametrize("count,parts", [(0, 1), (0, 4), (1, 4), (7, 3), (10, 4), (97, 8)])
def test_chunk_bounds_cover_everything_evenly(count, parts):
    bounds = chunk_bounds(count, parts)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == count and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _ar(name, n, dtype="float32", op=1, device="cpu"):
    return Response(Request(name, ALLREDUCE, dtype, (n,), device, op=op))


def test_fusion_plan_groups_by_key_and_threshold():
    responses = [_ar("a", 10), _ar("b", 10), _ar("c", 10, "float64"), _ar("d", 100),
                 _ar("e", 5, op=2), Response(Request("f", BROADCAST, "float32", (3,), root=0)),
                 _ar("g", 1)]
    batches = plan_batches(responses, threshold_bytes=100)
    names = [[r.name for r in batch] for batch in batches]
    assert names == [["a", "b", "g"], ["c"], ["d"], ["e"], ["f"]]


def test_fusion_plan_fuses_the_sharded_halves_of_one_kind():
    def half(name, kind, n, ring_order=True, dtype="float32"):
        return Response(Request(name, kind, dtype, (n,), ring_order=ring_order))
    responses = [half("rs0", REDUCESCATTER, 10), half("ag0", ALLGATHER, 10),
                 half("rs1", REDUCESCATTER, 10), half("plain", REDUCESCATTER, 10, False),
                 half("rs2", REDUCESCATTER, 10, dtype="float64"), half("ag1", ALLGATHER, 10),
                 half("rs3", REDUCESCATTER, 90), _ar("a", 10),
                 half("node0", REDUCESCATTER, 10, RING_BY_NODE),
                 half("node1", REDUCESCATTER, 10, RING_BY_NODE)]
    names = [[r.name for r in batch] for batch in plan_batches(responses, threshold_bytes=100)]
    assert names == [["rs0", "rs1"], ["ag0", "ag1"], ["plain"], ["rs2"], ["rs3"], ["a"],
                     ["node0", "node1"]]


@pytest.mark.parametrize("local_size,cross_size", [(1, 1), (1, 5), (2, 2), (3, 2), (4, 3)])
def test_a_shard_grid_tiles_the_bucket_one_piece_per_rank(local_size, cross_size):
    """collectives/shard_grid.py: flat (one rank per node) is the ring's chunks and owners;
    by node, each node-local chunk is cut across the nodes, and every rank owns a piece of
    its own local rank's chunk, no two ranks the same."""
    size = local_size * cross_size
    for count in (0, 1, size - 1, 97, 1000):
        grids = [ShardGrid(l, local_size, c, cross_size)
                 for c in range(cross_size) for l in range(local_size)]
        bounds = grids[0].bounds(count)
        assert all(g.bounds(count) == bounds for g in grids)
        assert len(bounds) == size + 1 and bounds[0] == 0 and bounds[-1] == count
        assert all(a <= b for a, b in zip(bounds, bounds[1:]))
        assert sorted(g.owned for g in grids) == list(range(size))
        local = grids[0].local_bounds(bounds)
        assert local == chunk_bounds(count, local_size)
        for g in grids:
            assert local[g.local_rank] <= bounds[g.owned] <= bounds[g.owned + 1] \
                <= local[g.local_rank + 1]
            assert g.scratch_elements(bounds) >= max(
                bounds[p + 1] - bounds[p] for p in range(size))
        hybrid = [ShardGrid(g.local_rank, local_size, g.cross_rank, cross_size, True)
                  for g in grids]
        assert hybrid[0].bounds(count) == local and hybrid[0].ring_order == RING_HYBRID
        for node in range(cross_size):     # every node holds every piece once
            assert sorted(g.owned for g in hybrid if g.cross_rank == node) == \
                list(range(local_size))
        assert [g.replica for g in hybrid] == [g.cross_rank for g in grids]
        if local_size == 1:
            assert bounds == chunk_bounds(count, size)
            assert [g.owned for g in grids] == [owned_chunk(r, size, True) for r in range(size)]
            assert grids[0].ring_order == RING_FLAT
        else:
            assert grids[0].ring_order == RING_BY_NODE


def test_agree_reports_every_kind_of_mismatch():
    base = Request("w", ALLREDUCE, "float32", (4, 3))
    assert agree({0: base, 1: base}, 2).error is None
    shapes = agree({0: base, 1: base, 2: base._replace(shape=(3, 4))}, 3).error
    assert shapes == ("Mismatched allreduce shapes for 'w': ranks 0, 1 sent [4, 3], "
                      "rank 2 sent [3, 4]")
    assert "dtypes" in agree({0: base, 1: base._replace(dtype="float16")}, 2).error
    assert "devices" in agree({0: base, 1: base._replace(device="cuda:0")}, 2).error
    assert "Sum" in agree({0: base, 1: base._replace(op=0)}, 2).error
    gather = Request("g", ALLGATHER, "float32", (2, 5))
    ok = agree({0: gather, 1: gather._replace(shape=(7, 5))}, 2)
    assert ok.error is None and ok.sizes == (2, 7)
    assert "beyond the first" in agree({0: gather, 1: gather._replace(shape=(2, 6))}, 2).error


def test_request_table_waits_for_every_rank_and_joined_ranks():
    table = RequestTable(3)
    req = Request("x", ALLREDUCE, "float32", (2,))
    table.add(0, req)
    table.add(2, req)
    assert table.take_complete(joined=()) == []
    done = table.take_complete(joined={1})
    assert [r.name for r in done] == ["x"] and done[0].error is None
    table.add(0, Request("b", BROADCAST, "float32", (2,), root=0))
    table.add(2, Request("b", BROADCAST, "float32", (2,), root=0))
    (resp,) = table.take_complete(joined={1})
    assert "join()" in resp.error and resp.error_kind == REFUSED


def test_response_cache_hands_out_the_lowest_free_slot_and_grows():
    cache = ResponseCache(3)
    for name in "abc":
        cache.put(cache.next_slot(), _ar(name, 1))
    assert [cache.slot_of(n) for n in "abc"] == [0, 1, 2]
    cache.evict(cache.slot_of("b"))
    assert cache.next_slot() == 1                   # the emptied slot first
    assert cache.put(1, _ar("d", 1)) is None        # it held nothing
    assert cache.next_slot() == cache.slot_of("a")  # full: the least recently used
    assert cache.put(0, _ar("e", 1)) == "a"         # the name it evicted
    cache.grow(5)
    assert cache.next_slot() == 3                   # room again, in new slots
    cache.put(3, _ar("f", 1))
    assert cache.next_slot() == 4


def test_capacity_watch_counts_names_that_come_back_after_eviction():
    watch = CapacityWatch()
    for i in range(64):
        watch.evicted_for_room(f"r{i}", capacity=1024)

    def admit(names, capacity=1024):
        verdicts = []
        for name in names:
            watch.admit(name)
            verdicts.append(watch.too_small(capacity))
        return verdicts
    # A window is an eighth of the capacity: 128 admissions, judged when full.
    verdicts = admit([f"fresh{i}" for i in range(104)] + [f"r{i}" for i in range(24)])
    assert verdicts == [None] * 128         # 24 returns of 128: short of a quarter
    verdicts = admit([f"r{i}" for i in range(24, 56)] + [f"new{i}" for i in range(96)])
    assert verdicts[:-1] == [None] * 127 and verdicts[-1] == (32, 128)
    assert admit(["r0", "r1"]) == [None, None]  # came back already: fresh now
    watch.grown()                               # the cache grew: nothing evicted counts
    assert watch.returned == watch.admitted == 0
    assert admit(["r60"] + [f"x{i}" for i in range(7)], capacity=8) == [None] * 8
    for name in "pqr":
        watch.evicted_for_room(name, capacity=2)    # remembers the last 2 only
    verdicts = admit(["p", "q", "r"] + [f"y{i}" for i in range(5)], capacity=8)
    assert verdicts[-1] == (2, 8)           # q and r: a quarter of a window of 8 (the least)


def test_response_cache_slots_and_lru_eviction():
    cache = ResponseCache(2)
    for name in ("a", "b"):
        slot = cache.next_slot()
        cache.put(slot, _ar(name, 1))
    assert {cache.slot_of("a"), cache.slot_of("b")} == {0, 1}
    cache.touch(cache.slot_of("a"))
    victim = cache.next_slot()          # b is least recently used
    assert victim == cache.slot_of("b")
    cache.put(victim, _ar("c", 1))
    assert cache.slot_of("b") is None and cache.slot_of("c") == victim and len(cache) == 2


def test_stall_report_names_missing_ranks():
    pending = {0: {"a": 5.0, "b": 1.0}, 1: {"a": 4.0}, 2: {}}
    stalls = find_stalls(pending, joined=set(), size=3, min_age=2.0)
    assert [(s.name, s.missing_ranks) for s in stalls] == [("a", (2,))]
    text = describe_stalls(stalls)
    assert "rank 2 has not submitted: 'a'" in text and "5.0 s" in text
    assert find_stalls(pending, joined={2}, size=3, min_age=2.0) == []


def test_identity_values_leave_reductions_unchanged():
    import numpy as np
    import torch

    from mpiddp.buffers.dtypes import DTYPES, identity_value
    from mpiddp.buffers.host_reduce import reduce_into
    from mpiddp.reduce_ops import ReduceOp, reducible_ops

    for dtype in DTYPES.values():
        for op in ReduceOp:
            if op not in reducible_ops(dtype.kind):
                continue
            values = torch.tensor([-3, 0, 2, 5]).to(getattr(torch, dtype.name)) \
                if dtype.kind != "bool" else torch.tensor([True, False, True, False])
            flat = values.view(torch.int16).numpy().view(np.uint16) \
                if dtype.name == "bfloat16" else values.numpy()
            dst = flat.copy()
            reduce_into(dst, np.full_like(flat, identity_value(dtype, op)), op, dtype)
            assert np.array_equal(dst, flat), (dtype.name, op)


@pytest.mark.parametrize("algorithm,hierarchical,usable,nbytes,expected", [
    ("auto", "auto", True, 1 << 10, "native"),          # small: latency-bound, MPI's own
    ("auto", "auto", True, 1 << 24, "hierarchical"),    # what would take the ring, across nodes
    ("auto", "auto", False, 1 << 24, "ring"),           # one node (or uneven nodes)
    ("auto", "1", True, 1 << 10, "hierarchical"),
    ("auto", "0", True, 1 << 24, "ring"),
    ("ring", "1", True, 1 << 24, "ring"),               # a forced algorithm wins
    ("hierarchical", "auto", True, 1 << 10, "hierarchical"),
    ("hierarchical", "auto", False, 1 << 10, "ring"),   # cannot apply: the ring, never wrong
])
def test_algorithm_choice_with_the_hierarchical_all_reduce(algorithm, hierarchical, usable,
                                                           nbytes, expected):
    from mpiddp.collectives.algorithms import AlgorithmChoice
    from mpiddp.collectives.topology import Topology

    # 2 nodes x 2 ranks (usable), or 3 ranks spread unevenly over 2 nodes
    topology = Topology(0, 4, 0, 2, 0, 2, True) if usable else Topology(0, 3, 0, 2, 0, 2, False)
    assert topology.hierarchical_usable == usable
    choice = AlgorithmChoice(algorithm, 2 << 20, hierarchical, topology)
    assert choice.choose(nbytes).name == expected


def test_ring_threshold_default_depends_on_whether_ranks_span_nodes():
    from mpi4py import MPI

    from mpiddp.collectives.algorithms import default_ring_threshold
    from mpiddp.config import read_settings
    from mpiddp.engine.executor import Executor
    from mpiddp.engine.stats import EngineStats
    from mpiddp.engine.timeline import Timeline

    assert default_ring_threshold(flat_across_nodes=False) == 2 << 20
    assert default_ring_threshold(flat_across_nodes=True) == 256 << 10
    assert read_settings({}).ring_threshold is None                  # unset: by layout
    assert read_settings({"MPIDDP_RING_THRESHOLD": "65536"}).ring_threshold == 65536

    def executor(environ):
        return Executor(MPI.COMM_SELF, read_settings(environ), EngineStats(), Timeline(),
                        lambda *args, **kwargs: None)

    one_node = executor({}).algorithms
    assert (one_node.ring_threshold, one_node.cross_ring_threshold) == (2 << 20, 256 << 10)
    explicit = executor({"MPIDDP_RING_THRESHOLD": "4096"}).algorithms         # set: wins
    assert (explicit.ring_threshold, explicit.cross_ring_threshold) == (4096, 4096)


@pytest.mark.parametrize("nbytes,nodes,overlapping,threshold,expected", [
    (64 << 20, 2, True, 256 << 10, 16),      # 4 MiB segments, at most 16
    (256 << 20, 2, True, 256 << 10, 16),
    (16 << 20, 2, True, 256 << 10, 4),
    (6 << 20, 2, True, 256 << 10, 1),        # under two segments: not worth it
    (64 << 20, 2, False, 256 << 10, 1),      # blocking cross transport: nothing to overlap
    (64 << 20, 2, True, 2 << 20, 1),         # a segment's cross chunk would go native
    (64 << 20, 2, True, 1 << 20, 16),        # 2 MiB cross chunks (2 ranks per node): the ring
    (64 << 20, 8, True, 256 << 10, 4),       # ring steps of at least 1 MiB: fewer segments
    (64 << 20, 64, True, 256 << 10, 1),      # many nodes: the steps are small already
])
def test_pipeline_segments_of_the_hierarchical_all_reduce(nbytes, nodes, overlapping,
                                                           threshold, expected):
    from mpiddp.collectives.hierarchical import pipeline_segments

    class Cross:
        def Get_size(self):
            return nodes

    class Overlapping(Cross):
        def start_sendrecv(self, *args):
            raise AssertionError("not called")

    cross = Overlapping() if overlapping else Cross()
    assert pipeline_segments(nbytes, 2, cross, threshold) == expected


@pytest.mark.parametrize("count,local_size,cross_size,segments", [
    (1000, 2, 2, 1), (1000, 2, 2, 3), (1001, 3, 4, 16), (7, 2, 3, 5), (16, 4, 1, 2)])
def test_hierarchical_scratch_covers_every_phase(count, local_size, cross_size, segments):
    """The scratch holds the largest node-local chunk of any segment and, pipelined, the
    cross-node ring's largest chunk beside it."""
    from mpiddp.collectives.hierarchical import scratch_elements

    need = scratch_elements(count, local_size, cross_size, segments)
    seg = chunk_bounds(count, segments)
    for s in range(segments):
        local = chunk_bounds(seg[s + 1] - seg[s], local_size)
        largest_local = max(b - a for a, b in zip(local, local[1:]))
        if segments == 1:
            assert need >= largest_local
            continue
        cross = chunk_bounds(largest_local, cross_size)
        largest_cross = max(b - a for a, b in zip(cross, cross[1:]))
        local_part = -(-(-(-count // segments)) // local_size)
        assert local_part >= largest_local and need - local_part >= largest_cross


def test_overlap_trial_alternates_then_keeps_the_faster(monkeypatch):
    """The auto trial's phases, which steps it times, and the agreed decision."""
    from mpiddp.torch.gradients import overlap_trial
    clock = [0.0]
    monkeypatch.setattr(overlap_trial.time, "perf_counter", lambda: clock[0])
    agreed = []

    def agree(on, off):
        agreed.append((on, off))
        return on, off
    trial = overlap_trial.OverlapTrial(agree, "opt0")
    modes = []
    per_step = {True: 0.2, False: 0.1}       # overlap slower here: the standard path wins
    for _ in range(overlap_trial.PHASE_STEPS * len(overlap_trial.PHASES) + 3):
        clock[0] += per_step[trial.overlap]
        modes.append(trial.on_step())
    steps = overlap_trial.PHASE_STEPS
    assert modes[steps - 1] is False and modes[2 * steps - 1] is True   # switches at phase ends
    assert agreed == [pytest.approx((0.2, 0.1))]   # untimed steps (the switches) left out
    assert trial.decision is False and modes[-1] is False


# ---- the cost model and the automatic choice across nodes ---------------------------------
def test_cost_model_matches_the_algorithms_step_counts():
    from mpiddp.collectives.cost_model import (RING_STEP_OVERHEAD_S, LinkCosts, native_seconds,
                                               ring_seconds)

    link = LinkCosts(latency_s=1e-5, seconds_per_byte=1e-9)
    n = 1 << 24
    # Same bytes on the wire; the ring's 2(N-1) steps against Rabenseifner's 2 log2 N.
    for ranks in (2, 4, 16):
        wire = 2 * (ranks - 1) / ranks * n * 1e-9
        assert ring_seconds(n, ranks, link) == pytest.approx(
            wire + 2 * (ranks - 1) * (1e-5 + RING_STEP_OVERHEAD_S))
        assert native_seconds(n, ranks, link) == pytest.approx(
            wire + 2 * math.log2(ranks) * 1e-5)
    # Not a power of two: two extra exchanges of the whole buffer (fold in, fold out).
    assert native_seconds(n, 3, link) == pytest.approx(
        4 / 3 * n * 1e-9 + 4 * 1e-5 + 2 * (1e-5 + n * 1e-9))
    assert native_seconds(1024, 8, link) == pytest.approx(3 * (1e-5 + 1024e-9))  # doubling
    assert ring_seconds(n, 1, link) == native_seconds(n, 1, link) == 0


def test_ring_threshold_grows_with_nodes_and_link_speed():
    from mpiddp.collectives.cost_model import (NEVER, RING_TOLERANCE, LinkCosts, native_seconds,
                                               ring_seconds, ring_threshold)

    slow, fast = LinkCosts.from_rate(1, 30), LinkCosts.from_rate(100, 5)
    # 2 nodes on 1 Gbit/s: the 256 KiB measured there
    # (docs/dev/benchmark-record.md, "Across nodes").
    assert 200_000 < ring_threshold(2, slow) < 300_000
    for link in (slow, fast):
        sizes = [ring_threshold(n, link) for n in (2, 4, 8, 16, 64, 512)]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
        for ranks in (2, 4, 16):
            t = ring_threshold(ranks, link)
            # At the threshold the ring's extra cost is the tolerance of the transfer time.
            wire = 2 * (ranks - 1) / ranks * t * link.seconds_per_byte
            assert ring_seconds(t, ranks, link) - native_seconds(t, ranks, link) == \
                pytest.approx(RING_TOLERANCE * wire, rel=1e-3)
    assert ring_threshold(16, fast) > 100 * ring_threshold(16, slow) / 2
    assert ring_threshold(1, slow) == NEVER


def test_halving_doubling_costs_the_rings_bytes_in_fewer_steps():
    from mpiddp.collectives.cost_model import (NEVER, RING_STEP_OVERHEAD_S, RING_TOLERANCE,
                                               LinkCosts, halving_doubling_seconds,
                                               halving_doubling_threshold, native_seconds,
                                               ring_seconds)

    link, n = LinkCosts(1e-5, 1e-9), 1 << 24
    step = 1e-5 + RING_STEP_OVERHEAD_S
    assert halving_doubling_seconds(n, 2, link) == pytest.approx(ring_seconds(n, 2, link))
    assert halving_doubling_seconds(n, 16, link) == pytest.approx(
        8 * step + 2 * 15 / 16 * n * 1e-9)
    assert halving_doubling_seconds(n, 16, link) < ring_seconds(n, 16, link)
    # 12 ranks: 8 take part, 4 fold their whole buffers in and get them back.
    assert halving_doubling_seconds(n, 12, link) == pytest.approx(
        6 * step + 2 * 7 / 8 * n * 1e-9 + 2 * (step + n * 1e-9))
    for ranks in (2, 4, 16, 64):
        t = halving_doubling_threshold(ranks, link)
        wire = 2 * (ranks - 1) / ranks * t * link.seconds_per_byte
        assert halving_doubling_seconds(t, ranks, link) - native_seconds(t, ranks, link) == \
            pytest.approx(RING_TOLERANCE * wire, rel=1e-3)
    assert halving_doubling_threshold(1, link) == NEVER


def test_forward_overlaps_cycle_budget_follows_the_measured_links():
    from mpiddp.collectives.cost_model import (ENGINE_CYCLE_S, PRIORITY_CYCLE_MAX_BYTES,
                                               PRIORITY_CYCLE_MIN_BYTES,
                                               PRIORITY_CYCLE_TOLERANCE, LinkCosts,
                                               priority_cycle_bytes)

    mib = 1 << 20
    least = PRIORITY_CYCLE_MIN_BYTES
    assert least == mib
    # 2 nodes on 200 Mbit/s and on 1 Gbit/s, with the spread of latencies and rates the
    # engine measured there: 1 MiB, the best measured (4 MiB 9% slower on 200 Mbit/s, 2 MiB
    # 6% slower on 1 Gbit/s).
    for gbit, latency_us in ((0.2, 6), (0.2, 35), (0.96, 29), (1.24, 7), (1.17, 35)):
        assert priority_cycle_bytes(2, LinkCosts.from_rate(gbit, latency_us)) == least
    # 16 emulated nodes on 1 Gbit/s (their measured 337-823 us: each cycle synchronizes 16
    # ranks on 2 cores): 4-8 MiB, where 1 MiB was 1.2x slower; on 200 Mbit/s still 1 MiB.
    for gbit, latency_us in ((0.875, 337), (0.912, 459), (0.7, 823)):
        assert priority_cycle_bytes(16, LinkCosts.from_rate(gbit, latency_us)) in (4 * mib,
                                                                                    8 * mib)
    assert priority_cycle_bytes(16, LinkCosts.from_rate(0.2, 386)) == least
    # 2 nodes on the emulated ~6-14 Gbit/s: 8-16 MiB (1 MiB was 1.15x slower).
    for gbit, latency_us in ((5.95, 35), (10.3, 6), (14.2, 7)):
        assert priority_cycle_bytes(2, LinkCosts.from_rate(gbit, latency_us)) in (8 * mib,
                                                                                   16 * mib)
    # The rule: the size whose transfer makes the fixed cost (the engine's work and a round
    # trip per level of the negotiation) the tolerance of it, rounded down to a power of two.
    for ranks, link in ((2, LinkCosts.from_rate(14.2, 7)), (16, LinkCosts.from_rate(10, 20))):
        budget = priority_cycle_bytes(ranks, link)
        fixed = ENGINE_CYCLE_S + 2 * math.ceil(math.log2(ranks)) * link.latency_s
        def share(nbytes):
            return fixed / (2 * (ranks - 1) / ranks * nbytes * link.seconds_per_byte)
        assert share(2 * budget) < PRIORITY_CYCLE_TOLERANCE <= share(budget)
        assert budget & (budget - 1) == 0
    # Faster links, more bytes, up to the cap; one node (nothing to size): the least.
    sizes = [priority_cycle_bytes(16, LinkCosts.from_rate(g, 20)) for g in (10, 25, 100)]
    assert sizes == sorted(sizes) and least < sizes[0] < sizes[-1] == PRIORITY_CYCLE_MAX_BYTES
    assert priority_cycle_bytes(1, LinkCosts.from_rate(10, 6)) == least


def test_forward_overlaps_cycles_are_sized_for_the_steps_gradients():
    from mpiddp.collectives.cost_model import (ENGINE_CYCLE_S, GRADIENT_CYCLE_MIN_BYTES,
                                               PRIORITY_CYCLE_MAX_BYTES, LinkCosts,
                                               gradient_cycle_bytes, priority_cycle_bytes)

    kib, mib = 1 << 10, 1 << 20
    resnet50 = 102_000_000               # float32 gradients a step
    # The emulated cluster's simulated ResNet-50 (light: 20x smaller tensors on 200 Mbit/s;
    # heavy: 4x smaller on 1 Gbit/s), with the latencies the engine measured there: at 8
    # nodes on 200 Mbit/s 512 KiB (1 MiB, the links-only budget, was 1.2x slower, 256 KiB
    # 4% faster), at 2 nodes 256 KiB (1 MiB 1.1x slower); at 2 nodes on 1 Gbit/s 1 MiB, as
    # before; at 16 nodes on 1 Gbit/s with a core per rank 1 MiB (87% efficiency).
    light, heavy = resnet50 // 20, resnet50 // 4
    assert gradient_cycle_bytes(8, LinkCosts.from_rate(0.2, 300), light) == 512 * kib
    assert gradient_cycle_bytes(2, LinkCosts.from_rate(0.2, 20), light) == 256 * kib
    assert gradient_cycle_bytes(2, LinkCosts.from_rate(1.0, 20), heavy) == mib
    assert gradient_cycle_bytes(16, LinkCosts.from_rate(1.0, 50), heavy) == mib
    # The rule: F G / B + B s least at B = sqrt(G F / s), to the nearest power of two.
    for ranks, link, grads in ((4, LinkCosts.from_rate(10, 20), resnet50),
                               (64, LinkCosts.from_rate(25, 10), 4 * resnet50)):
        budget = gradient_cycle_bytes(ranks, link, grads)
        fixed = ENGINE_CYCLE_S + 2 * math.ceil(math.log2(ranks)) * link.latency_s
        per_byte = 2 * (ranks - 1) / ranks * link.seconds_per_byte

        def added(nbytes):
            return fixed * grads / nbytes + nbytes * per_byte
        assert budget & (budget - 1) == 0
        assert added(budget) <= min(added(budget / 2), added(budget * 2))
    # More gradients or a larger fixed cost: larger cycles; a faster link: larger too.
    link = LinkCosts.from_rate(10, 20)
    assert gradient_cycle_bytes(16, link, resnet50) < gradient_cycle_bytes(16, link, 16 * resnet50)
    assert gradient_cycle_bytes(16, LinkCosts.from_rate(10, 5), resnet50) <= \
        gradient_cycle_bytes(16, LinkCosts.from_rate(10, 500), resnet50)
    assert gradient_cycle_bytes(16, LinkCosts.from_rate(1, 20), resnet50) < \
        gradient_cycle_bytes(16, LinkCosts.from_rate(100, 20), resnet50)
    # Bounds; nothing measured (one node) or nothing to reduce: the links-only budget.
    assert gradient_cycle_bytes(2, LinkCosts.from_rate(0.01, 1), 1000) == GRADIENT_CYCLE_MIN_BYTES
    assert gradient_cycle_bytes(2, LinkCosts.from_rate(400, 500), 10 ** 12) == \
        PRIORITY_CYCLE_MAX_BYTES
    assert gradient_cycle_bytes(1, None, resnet50) == priority_cycle_bytes(1, None)
    assert gradient_cycle_bytes(4, link, 0) == priority_cycle_bytes(4, link)


def test_device_memorys_cycle_budget_follows_the_measured_allreduce():
    from mpiddp.collectives.cost_model import (PRIORITY_CYCLE_MAX_BYTES,
                                               PRIORITY_CYCLE_MIN_BYTES,
                                               PRIORITY_CYCLE_TOLERANCE,
                                               device_priority_cycle_bytes)

    mib = 1 << 20
    # Measured on an H200 shared by two ranks (0.74 ms + 0.25 ns/byte): the cap, 64 MiB,
    # where 1 MiB cycles ran ResNet-18 at 0.55x the standard path and 16 MiB at 0.94x.
    assert device_priority_cycle_bytes(740e-6, 0.25e-9) == PRIORITY_CYCLE_MAX_BYTES
    # The rule: the fixed cost the tolerance of the budget's transfer, a power of two below.
    for fixed, per_byte in ((150e-6, 0.2e-9), (300e-6, 0.64e-9), (60e-6, 0.8e-9)):
        budget = device_priority_cycle_bytes(fixed, per_byte)
        assert PRIORITY_CYCLE_MIN_BYTES < budget < PRIORITY_CYCLE_MAX_BYTES
        assert budget & (budget - 1) == 0
        assert fixed / (2 * budget * per_byte) < PRIORITY_CYCLE_TOLERANCE <= \
            fixed / (budget * per_byte)
    assert device_priority_cycle_bytes(150e-6, 0.2e-9) == 16 * mib
    # Cheap cycles on a slow path: the least; nothing measurable per byte: the most.
    assert device_priority_cycle_bytes(10e-6, 5e-9) == PRIORITY_CYCLE_MIN_BYTES
    assert device_priority_cycle_bytes(100e-6, 0.0) == PRIORITY_CYCLE_MAX_BYTES


def test_automatic_choice_across_nodes_follows_the_measured_links():
    from mpiddp.collectives.algorithms import LOCAL_RING_THRESHOLD, AlgorithmChoice
    from mpiddp.collectives.cost_model import (LinkCosts, halving_doubling_threshold,
                                               ring_threshold)
    from mpiddp.collectives.topology import Topology

    link = LinkCosts.from_rate(1, 30)
    flat16 = AlgorithmChoice("auto", None, "auto", Topology(0, 16, 0, 1, 0, 16, True), link)
    # 16 nodes: halving-doubling's 8 steps make it ours from a smaller size than the ring's 30.
    threshold = halving_doubling_threshold(16, link)
    assert threshold < ring_threshold(16, link) / 4
    assert flat16.ring_threshold == threshold
    assert flat16.choose(threshold).name == "native"
    assert flat16.choose(threshold + 1).name == "halving_doubling"
    # ... up to where the ring's extra steps cost at most the tolerance: the ring above.
    assert flat16.choose(ring_threshold(16, link)).name == "halving_doubling"
    assert flat16.choose(ring_threshold(16, link) + 1).name == "ring"
    assert flat16.choose(64 << 20).name == "ring"
    assert flat16.choose(256 << 10).name == "native"     # the ring would take it at 2 nodes
    two = AlgorithmChoice("auto", None, "auto", Topology(0, 2, 0, 1, 0, 2, True), link)
    assert two.choose(1 << 20).name == "ring"             # the same two messages: the ring
    # 12 nodes at 1 Gbit/s: folding whole buffers costs more than the ring's extra steps.
    twelve = AlgorithmChoice("auto", None, "auto", Topology(0, 12, 0, 1, 0, 12, True), link)
    assert twelve.ring_threshold == ring_threshold(12, link)
    assert twelve.choose(twelve.ring_threshold + 1).name == "ring"
    assert twelve.choose(256 << 20).name == "ring"
    # Without measured links (a threshold set by the user, or one node) the ring: nothing
    # says where halving-doubling would pay.
    unmeasured = AlgorithmChoice("auto", None, "auto", Topology(0, 8, 0, 1, 0, 8, True))
    assert {unmeasured.choose(n).name for n in (1 << 20, 64 << 20)} == {"ring"}
    eight_local = AlgorithmChoice("auto", None, "auto", Topology(0, 8, 0, 8, 0, 1, False), link)
    assert eight_local.choose(4 << 20).name == "ring"
    # 8 nodes x 2 ranks: the cross-node part's threshold is the 8-node ring's.
    hier = AlgorithmChoice("auto", None, "auto", Topology(0, 16, 0, 2, 0, 8, True), link)
    assert hier.cross_ring_threshold == ring_threshold(8, link)
    assert hier.ring_threshold == max(LOCAL_RING_THRESHOLD, ring_threshold(8, link))
    # A threshold the user set wins; one node ignores the links.
    pinned = AlgorithmChoice("auto", 4096, "auto", Topology(0, 16, 0, 1, 0, 16, True), link)
    assert (pinned.ring_threshold, pinned.cross_ring_threshold) == (4096, 4096)
    local = AlgorithmChoice("auto", None, "auto", Topology(0, 2, 0, 2, 0, 1, True), link)
    assert local.ring_threshold == LOCAL_RING_THRESHOLD


def test_over_the_sockets_host_buffers_skip_the_librarys_all_reduce_where_halving_doubling_fits():
    from mpiddp.collectives.algorithms import AlgorithmChoice
    from mpiddp.collectives.cost_model import LinkCosts
    from mpiddp.collectives.topology import Topology

    link = LinkCosts.from_rate(1, 30)
    for nodes in (4, 8, 16, 64):
        topology = Topology(0, nodes, 0, 1, 0, nodes, True)
        over_mpi = AlgorithmChoice("auto", None, "auto", topology, link)
        sockets = AlgorithmChoice("auto", None, "auto", topology, link, over_sockets=True)
        assert sockets.ring_threshold == over_mpi.ring_threshold      # device buffers' rule
        assert 0 < sockets.sockets_native_limit == sockets.recursive_doubling_limit \
            < over_mpi.ring_threshold
        # Between the two: the library's all-reduce over MPI, halving-doubling over the
        # sockets; above the ring's threshold the ring either way.
        middle = (sockets.recursive_doubling_limit + over_mpi.ring_threshold) // 2
        assert over_mpi.choose(middle).name == "native"
        assert sockets.choose(middle).name == "halving_doubling"
        assert sockets.choose(middle, host=False).name == "native"
        big = sockets.halving_doubling_limit + 1
        assert sockets.choose(big).name == over_mpi.choose(big).name == "ring"
    # Where halving-doubling does not fit (12 nodes: not a power of two) the library keeps
    # the sizes between recursive doubling and the ring.
    twelve = AlgorithmChoice("auto", None, "auto", Topology(0, 12, 0, 1, 0, 12, True), link,
                             over_sockets=True)
    assert twelve.sockets_native_limit == twelve.ring_threshold
    # A threshold the user set is kept.
    pinned = AlgorithmChoice("auto", 1 << 20, "auto", Topology(0, 16, 0, 1, 0, 16, True), link,
                             over_sockets=True)
    assert pinned.sockets_native_limit == 1 << 20


def test_recursive_doubling_over_the_sockets_takes_the_smallest_buffers():
    from mpiddp.collectives.algorithms import AlgorithmChoice
    from mpiddp.collectives.cost_model import (HOST_REDUCE_SECONDS_PER_BYTE, LinkCosts,
                                               halving_doubling_seconds,
                                               recursive_doubling_limit,
                                               recursive_doubling_seconds)
    from mpiddp.collectives.topology import Topology

    link = LinkCosts.from_rate(1, 30)
    # Host buffers: the reductions counted at NumPy's rate.
    host = dataclasses.replace(link, reduce_seconds_per_byte=HOST_REDUCE_SECONDS_PER_BYTE)
    # Up to the limit recursive doubling costs no more than halving-doubling, beyond it more;
    # at 2 ranks too (the same bytes in half the steps, but twice the reductions).
    for ranks in (2, 4, 8, 16, 12, 64):
        limit = recursive_doubling_limit(ranks, link, 1 << 30)
        assert 0 < limit < 1 << 30
        assert recursive_doubling_seconds(limit, ranks, host) <= \
            halving_doubling_seconds(limit, ranks, host)
        assert recursive_doubling_seconds(limit + 128, ranks, host) > \
            halving_doubling_seconds(limit + 128, ranks, host)
    # Slower per message (latency), more bytes; never above the ceiling.
    assert recursive_doubling_limit(16, LinkCosts.from_rate(1, 300), 1 << 30) > \
        recursive_doubling_limit(16, link, 1 << 30)
    assert recursive_doubling_limit(2, link, 12345) == 12345

    one_per_node = Topology(0, 16, 0, 1, 0, 16, True)
    choice = AlgorithmChoice("auto", None, "auto", one_per_node, link, over_sockets=True)
    limit = choice.recursive_doubling_limit
    assert 0 < limit < choice.ring_threshold
    # Host buffers: halving-doubling after it (16 ranks, one per node: it fits); device
    # buffers, which the sockets do not carry, the library's all-reduce.
    assert [choice.choose(n).name for n in (4096, limit, limit + 1)] == \
        ["recursive_doubling", "recursive_doubling", "halving_doubling"]
    assert choice.choose(limit + 1, host=False).name == "native"
    # Only over the sockets, with one rank per node and the links measured; a forced ring
    # threshold (autotune, the user) moves the limit with it.
    over_mpi = AlgorithmChoice("auto", None, "auto", one_per_node, link)
    assert over_mpi.choose(4096).name == over_mpi.choose(0).name == "native"
    two_per_node = Topology(0, 16, 0, 2, 0, 8, True)
    assert AlgorithmChoice("auto", None, "auto", two_per_node, link,
                           over_sockets=True).recursive_doubling_limit == 0
    assert AlgorithmChoice("auto", None, "auto", one_per_node, None,
                           over_sockets=True).recursive_doubling_limit == 0
    # At 2 nodes it is the library's own single exchange, without its polling: every buffer
    # up to the ring's threshold (native none but empty ones).
    two_nodes = AlgorithmChoice("auto", None, "auto", Topology(0, 2, 0, 1, 0, 2, True), link,
                                over_sockets=True)
    assert two_nodes.recursive_doubling_limit == two_nodes.ring_threshold > 0
    assert [two_nodes.choose(n).name for n in (0, 4096, two_nodes.ring_threshold,
                                               two_nodes.ring_threshold + 1)] == \
        ["recursive_doubling", "recursive_doubling", "recursive_doubling", "ring"]
    choice.configure("auto", ring_threshold=1000)
    assert choice.recursive_doubling_limit <= 1000
    assert choice.choose(2000).name != "recursive_doubling"
    assert choice.sockets_native_limit == 1000    # the caller's threshold, host buffers too
    # Forced: it applies across nodes (without the sockets its run is MPI_Allreduce's).
    forced = AlgorithmChoice("recursive_doubling", None, "auto", one_per_node, link)
    assert forced.choose(64 << 20).name == "recursive_doubling"
    single = Topology(0, 2, 0, 2, 0, 1, True)
    assert AlgorithmChoice("recursive_doubling", None, "auto", single).choose(64).name == "ring"


def test_transfer_sleep_setting_caps_the_sleeps_between_tests(monkeypatch):
    from mpi4py import MPI

    from mpiddp.buffers import backend_for
    from mpiddp.config import read_settings
    from mpiddp.transport import Pacing, network, transport_for

    assert read_settings({}).transfer_sleep_us is None
    assert read_settings({"MPIDDP_TRANSFER_SLEEP_US": "1000"}).transfer_sleep_us == 1000
    assert read_settings({"MPIDDP_TRANSFER_SLEEP_US": "0"}).transfer_sleep_us == 0
    with pytest.raises(ValueError, match="MPIDDP_TRANSFER_SLEEP_US"):
        read_settings({"MPIDDP_TRANSFER_SLEEP_US": "-1"})
    pacing = Pacing(1e-3, 8192)
    comm = transport_for(MPI.COMM_SELF, backend_for("cpu"), across_nodes=True, pacing=pacing)
    assert isinstance(comm, network.NetworkComm) and comm.pacing == pacing

    # A transfer that needs many tests: sleeps grow as a tenth of the time waited, to the cap,
    # and each wake tests a burst of ``tests_per_wake`` in a row.
    now, slept, tests, tests_at_sleep = [0.0], [], [0], []

    class Request:
        @staticmethod
        def Testall(requests):
            tests[0] += 1
            return tests[0] > 2000

    def sleep(seconds):
        slept.append(seconds)
        tests_at_sleep.append(tests[0])
        now[0] += seconds

    monkeypatch.setattr(network, "MPI", type("FakeMPI", (), {"Request": Request}))
    clock = type("FakeTime", (), {"perf_counter": staticmethod(lambda: now[0] + tests[0] * 1e-6),
                                  "sleep": staticmethod(sleep)})
    monkeypatch.setattr(network, "time", clock)        # this module's clock only
    network.PendingTransfer([], Pacing(1e-3, 4096, tests_per_wake=8)).wait()
    assert tests_at_sleep[0] > 50                       # unknown wire time: a 100 us spin first
    assert slept and max(slept) == pytest.approx(1e-3)
    assert min(slept) >= network.FIRST_SLEEP_SECONDS
    assert slept == sorted(slept)
    between = {b - a for a, b in zip(tests_at_sleep, tests_at_sleep[1:])}
    assert between == {8}, between                      # the burst, then the loop's own test
    assert tests[0] == 2001                             # stopped at the test that completed
    # A transfer expected to take 5 ms on the measured link: no spin (it cannot finish within
    # one), sleeps of a tenth of that from the start (no ramp from 10 us), still at most the cap.
    now[0], tests[0] = 0.0, 0
    slept.clear()
    tests_at_sleep.clear()
    network.PendingTransfer([], Pacing(1e-3, 4096), expected_s=5e-3).wait()
    assert tests_at_sleep[0] == 1, tests_at_sleep[:3]   # one test, then straight to sleep
    assert min(slept) == pytest.approx(5e-4) and max(slept) == pytest.approx(1e-3)
    assert network.NetworkComm(MPI.COMM_SELF, Pacing(1e-3, 4096, seconds_per_byte=8e-9)) \
        .pacing.seconds_per_byte == 8e-9
    # No cap (a link too fast for sleeps): one blocking wait, no test, no sleep.
    slept.clear()
    tests[0] = 0
    waited = []
    Request.Waitall = staticmethod(lambda requests: waited.append(requests))
    network.PendingTransfer(["r"], Pacing(0.0)).wait()
    assert waited == [["r"]] and not slept and tests[0] == 0


def test_pacing_follows_the_measured_link():
    from mpiddp.transport import pacing

    gbit = 8e-9                                  # seconds per byte at 1 Gbit/s
    # 1 Gbit/s: sleeps of the wire time of SLEEP_CALLS calls (about 1.2 ms; a burst of 8
    # tests after each moves more than that); polite from 0.5 ms of wire time.
    one = pacing.pacing_for(gbit)
    assert one.max_sleep_s == pytest.approx(pacing.SLEEP_CALLS * pacing.PROGRESS_BYTES * gbit)
    assert one.tests_per_wake * pacing.PROGRESS_BYTES * gbit > one.max_sleep_s
    assert 1e-3 < one.max_sleep_s < 1.5e-3
    assert one.polite_min_bytes == 62500 and not one.blocks
    assert one.seconds_per_byte == gbit                  # for each transfer's expected time
    # 1.5 Gbit/s: a shorter cap; 200 Mbit/s: a fifth of the bytes before a step is polite.
    assert pacing.pacing_for(gbit / 1.5).max_sleep_s == pytest.approx(one.max_sleep_s / 1.5)
    slow = pacing.pacing_for(5 * gbit)
    assert slow.polite_min_bytes == 12500
    # Very slow links: the cap stops at MAX_SLEEP_SECONDS, the threshold at 4 KiB.
    crawl = pacing.pacing_for(1000 * gbit)
    assert crawl.max_sleep_s == pacing.MAX_SLEEP_SECONDS
    assert crawl.polite_min_bytes == pacing.SMALLEST_POLITE_BYTES
    # 10 Gbit/s: a sleep would cap the transfer (sleeps that short are not honoured): block.
    fast = pacing.pacing_for(gbit / 10)
    assert fast.blocks and fast.max_sleep_s == 0
    assert fast.polite_min_bytes == pacing.POLITE_MIN_BYTES   # pieces still in flight
    assert "block" in fast.describe() and "bursts of 8 tests" in one.describe()
    # Nothing measured: the 200 us measured at 1 Gbit/s, the old 256 KiB threshold.
    assert pacing.pacing_for(None) == pacing.Pacing(200e-6, 256 * 1024)
    # The user's setting wins over the link; 0 always blocks.
    assert pacing.pacing_for(gbit / 10, 1000).max_sleep_s == pytest.approx(1e-3)
    assert pacing.pacing_for(gbit / 10, 1000).polite_min_bytes == pacing.POLITE_MIN_BYTES
    assert pacing.pacing_for(None, 500).max_sleep_s == pytest.approx(500e-6)
    assert pacing.pacing_for(gbit, 0).blocks


def test_a_cycle_spins_only_while_its_partners_answer_within_the_spin(monkeypatch):
    """Rule 5 of ``engine/waiting.py``: a cycle that brings work spins before sleeping, unless
    the last such wait outlasted the spin (partners not in lockstep: the spin would burn CPU
    in vain); a wait that the first sleeps see end within the spin's time turns it back on."""
    from mpiddp.engine import waiting

    now, calls = [0.0], [0]

    def perf_counter():
        now[0] += 1e-6          # every look at the clock costs a microsecond, as a spin does
        return now[0]

    def sleep(seconds):
        now[0] += seconds + 50e-6     # the kernel's timer slack

    monkeypatch.setattr(waiting, "time", type("FakeTime", (), {
        "perf_counter": staticmethod(perf_counter), "sleep": staticmethod(sleep)}))

    def partner_after(seconds):
        """A request's Test that completes ``seconds`` after the wait begins."""
        done_at = now[0] + seconds
        calls[0] = 0

        def test():
            calls[0] += 1
            return now[0] >= done_at
        return test

    policy = waiting.WaitPolicy(heartbeat=0.05)
    policy.entered(brought_work=True)
    policy.wait(partner_after(30e-6))         # in lockstep: found while spinning
    assert calls[0] > 5 and policy.spin_pays
    policy.wait(partner_after(2e-3))          # late: spun the whole spin, then slept
    assert not policy.spin_pays
    policy.wait(partner_after(30e-6))         # no spin now: the first sleep's test finds it
    assert calls[0] == 2 and policy.spin_pays
    policy.wait(partner_after(30e-6))         # and the next cycle spins again
    assert calls[0] > 5
    policy.wait(partner_after(2e-3))
    assert not policy.spin_pays
    # A partner seen late only because the sleeps overshoot (the last missed test was early
    # in the spin's time) counts as one the spin would have caught.
    policy.wait(partner_after(150e-6))
    assert calls[0] == 4 and policy.spin_pays     # missed at 0, ~60 and ~130 us, seen at ~220
    # A cycle entered to wait for others never spins and says nothing about lockstep.
    policy.after_cycle(executed=False, all_known=True, lacking=False)
    policy.entered(brought_work=False)
    assert not policy.spin
    policy.wait(partner_after(5e-3))
    assert policy.spin_pays


@pytest.mark.alone      # bounds on how long a wait takes
def test_inbox_hands_over_everything_and_its_waits_end():
    """engine/inbox.py: items come out in order, all at once; ``take(None)`` never waits; a
    timed take with nothing to take returns empty after about its timeout, also after items
    were taken (the state in which CPython 3.11-3.12's ``SimpleQueue.get(timeout=...)`` could
    wait forever); a put from another thread ends a wait at once, also a put made between
    two takes (no wake-up lost); a put while a wake-up is pending is fine."""
    import threading
    import time

    from mpiddp.engine.inbox import Inbox

    inbox = Inbox()
    assert inbox.take(None) == [] and inbox.drain() == []
    inbox.put(1)
    inbox.put_many([2, 3])
    inbox.put(4)                            # rung twice before anyone looked
    assert inbox.take(5.0) == [1, 2, 3, 4]
    for _ in range(3):                      # nothing there: each timed take ends
        start = time.perf_counter()
        assert inbox.take(0.02) == []
        assert 0.015 < time.perf_counter() - start < 2.0
    inbox.put("between")                    # rung between two takes
    start = time.perf_counter()
    assert inbox.take(5.0) == ["between"] and time.perf_counter() - start < 1.0
    timer = threading.Timer(0.05, inbox.put, args=("late",))
    timer.start()
    start = time.perf_counter()
    assert inbox.take(10.0) == ["late"]     # woken by the put, not the timeout
    assert time.perf_counter() - start < 5.0
    timer.join()
    assert inbox.take(0) == []


def test_watchdog_names_only_coordinators_waiting_for_work_behind_the_others():
    """engine/liveness.py: behind = began fewer cycles than the furthest rank *and* waits for
    work of its own (a stuck coordinator); a rank still busy in the previous cycle's long
    transfer (a huge broadcast on a slow link, its root already in the next cycle) is not."""
    import types

    from mpiddp.engine.liveness import Watchdog

    def behind(positions):     # rank -> (cycles begun, waiting for work, pending, pid)
        return Watchdog.behind(types.SimpleNamespace(positions=positions))

    assert behind({}) == []
    assert behind({0: (7, 0, 1, 10), 1: (6, 1, 1, 11), 2: (7, 0, 1, 12)}) == [1]
    assert behind({0: (7, 0, 0, 10), 1: (6, 0, 0, 11), 2: (6, 0, 0, 12)}) == []  # transfers
    assert behind({0: (7, 1, 0, 10), 1: (7, 1, 0, 11)}) == []    # idle together: heartbeat
    assert behind({0: (9, 0, 2, 10), 1: (8, 1, 2, 11), 2: (8, 1, 0, 12)}) == [1, 2]


def test_speculative_layout_and_sums():
    """engine/speculation.py: which cached all-reduces get a place (Sum or Average, host
    memory, a natively summed type, up to the budget in all, in slot order), what a rank
    puts there (its prescaled input where the name is ready here, zeros elsewhere), which
    ready responses the sum finishes; the layout follows the cache's changes."""
    import numpy as np

    from mpiddp.engine.handle import Handle
    from mpiddp.engine.request import Entry
    from mpiddp.engine.speculation import Speculation, build_layout
    from mpiddp.reduce_ops import ReduceOp

    def cached(name, shape=(2,), dtype="float32", **fields):
        return Response(Request(name, ALLREDUCE, dtype, shape, **fields))

    cache = ResponseCache(16)
    responses = [cached("old", shape=(8,)), cached("a"), cached("big", shape=(20,)),
                 cached("min", op=int(ReduceOp.MIN)), cached("gpu", device="cuda:0"),
                 cached("half", dtype="float16"), cached("flag", dtype="bool"),
                 cached("ints", dtype="int64"),
                 cached("avg", op=int(ReduceOp.AVERAGE), prescale=2.0),
                 Response(Request("bcast", BROADCAST, "float32", (2,), root=0)),
                 Response(cached("bad").request, error="mismatch"), cached("late", shape=(4,))]
    for slot, response in enumerate(responses):
        cache.put(slot, response)
    layout = build_layout(cache, budget=48)
    # The newest first: late (16 B), avg (8), ints (16), a (8); old (32 B) would pass the
    # budget; big alone is 80 B; the rest are not summed (op, device, type, kind, error).
    assert list(layout.places) == ["late", "avg", "ints", "a"]
    assert [b.dtype for b in layout.buffers] == [np.float32, np.int64]
    assert [(p.buffer, p.start, p.stop) for p in layout.places.values()] == \
        [(0, 0, 4), (0, 4, 6), (1, 0, 2), (0, 6, 8)]
    assert build_layout(ResponseCache(4), 48) is None
    a, avg, old = responses[1], responses[8], responses[0]

    def pending_entry(response, values):
        request = response.request
        return Entry(request, np.array(values, dtype=request.dtype), None, Handle(request.name))

    speculation = Speculation(48)
    pending = {"a": pending_entry(a, [1, 2]),
               "avg": pending_entry(avg, [3, 4]),            # prescaled by 2
               "old": pending_entry(old, [1] * 8)}           # no place: goes on as before
    floats, ints = speculation.begin(cache, pending)
    assert floats.tolist() == [0, 0, 0, 0, 6, 8, 1, 2] and ints.tolist() == [0, 0]
    floats += 1                                       # what the other ranks added
    ready = [a, avg, old]
    done, rest = speculation.finish(ready, pending)
    assert [(e.request.name, r.name, part.tolist()) for e, r, part in done] == \
        [("a", "a", [2, 3]), ("avg", "avg", [7, 9])]
    assert rest == [old] and list(pending) == ["old"]
    # A changed signature here gets no data (the bit vector marks the slot invalid, so it is
    # never ready: its name goes back through rank 0); a ready response that is not the one
    # the place was made for (defensive: its slot was reassigned) is left to run as before.
    pending["a"] = Entry(Request("a", ALLREDUCE, "float32", (3,)), np.ones(3, np.float32),
                         None, Handle("a"))
    floats, _ = speculation.begin(cache, pending)
    assert not floats.any()
    other = cached("a")
    done, rest = speculation.finish([other], pending)
    assert done == [] and rest == [other] and "a" in pending
    cache.put(1, cached("a2"))                      # the cache changed: a new layout
    speculation.begin(cache, {})
    assert "a2" in speculation._layout.places and "a" not in speculation._layout.places
    # Off, or nothing eligible: nothing to sum, every response runs as before.
    assert Speculation(0).begin(cache, pending) == []
    assert Speculation(48).finish(ready, pending) == ([], ready)


def test_speculation_budget_follows_the_measured_links():
    from mpiddp.collectives.cost_model import (SPECULATION_MAX_BYTES, SPECULATION_MIN_BYTES,
                                               LinkCosts,
                                               speculation_bytes)

    kib = 1 << 10
    # The bytes a link moves in one latency, rounded down to a power of two.
    assert speculation_bytes(LinkCosts.from_rate(10, 20)) == 16 * kib      # 25 KB
    assert speculation_bytes(LinkCosts.from_rate(100, 5)) == 32 * kib      # 62.5 KB
    assert speculation_bytes(LinkCosts.from_rate(0.2, 400)) == 8 * kib     # 10 KB
    # Bounds: slow links keep room for a 1024-float vector; fast ones stay small.
    assert speculation_bytes(LinkCosts.from_rate(1, 7)) == SPECULATION_MIN_BYTES == 4 * kib
    assert speculation_bytes(LinkCosts.from_rate(400, 50)) == SPECULATION_MAX_BYTES
    assert speculation_bytes(None) == SPECULATION_MIN_BYTES
