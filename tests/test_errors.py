"""Errors end cleanly on every rank with messages that name the tensor, ranks and values;
stalls, shutdowns and crashed ranks never leave the others hanging."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from mpi_launch import (ROOT, Job, assert_ok, mpi_command, process_gone, reported, run_mpi,
                        wait_for_files)


def test_mismatches_and_bad_input_fail_on_every_rank():
    result = run_mpi("errors_worker.py", 3, "mismatches", timeout=90)
    assert_ok(result, expect_lines=3 * 11)
    assert "Mismatched allreduce shapes for 'layer1.weight': ranks 0, 1 sent [4, 3], " \
           "rank 2 sent [3, 4]" in result.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_input_rejected_on_some_ranks_fails_on_every_rank(ranks):
    # Horovod's type-error tests hung here: the rejecting rank raised alone, without
    # submitting, and the others waited forever (here: the launch's timeout).
    result = run_mpi("errors_worker.py", ranks, "rejected_on_some_ranks", timeout=60)
    assert_ok(result, expect_lines=5 * ranks)


def test_stall_warns_then_shuts_down_with_reason():
    env = {"MPIDDP_STALL_CHECK_TIME": "1", "MPIDDP_STALL_SHUTDOWN_TIME": "3"}
    result = run_mpi("errors_worker.py", 3, "stall", timeout=60, env=env)
    assert_ok(result, expect_lines=3)
    assert "stall warning" in result.output
    assert "rank 2 has not submitted: 'lonely'" in result.output
    # After the 3 s asked for (the default, 600 s, would outlast the launch's timeout).
    assert "stalled for more than 3 s (MPIDDP_STALL_SHUTDOWN_TIME)" in result.output


def test_shutdown_on_one_rank_fails_pending_requests_elsewhere():
    result = run_mpi("errors_worker.py", 3, "shutdown_with_pending", timeout=60)
    assert_ok(result, expect_lines=3)


@pytest.mark.alone      # asserts that the error comes within 30 s of the call
def test_checkpoint_save_on_rank_0_alone_ends_every_rank_naming_it():
    # Under `if rank == 0:` (getting-started.md warns against it): at stage 0 it used to
    # write the file silently, at stage 2 to stall for 600 s. Now, at every stage, one error
    # on both ranks names the call and the rank that skipped it, within its 10 s deadline
    # (2 s in the stage-3 case, MPIDDP_STALL_CHECK_TIME=2); at once where rank 1 shuts down.
    result = run_mpi("checkpoint_misuse_worker.py", 2, timeout=240)
    assert_ok(result)
    skipped = "'mpiddp.Checkpoint.save' was called on rank 0 but not on rank 1, which went " \
              "on to other collectives"
    for case in ("stage 0, rank 1 trains", "stage 2, rank 1 trains",
                 "stage 3, rank 1 trains", "stage 2, rank 1 shuts down"):
        for rank in (0, 1):
            [report] = reported(result, f"{rank} {case}")
            if case.endswith("shuts down"):
                assert report["error"] == "" if rank == 1 else \
                    "rank 1: shutdown() was called; in flight on some ranks only: " \
                    "'mpiddp.Checkpoint.save' submitted on rank 0 but not on rank 1" \
                    in report["error"], report
            else:
                assert skipped in report["error"], report
                assert "it is a collective call: every rank must make it" in report["error"]
            assert report["seconds"] < 30, report
    consolidating = "consolidate_state_dict' was called on rank 0 but not on rank 1"
    for rank in (0, 1):
        [report] = reported(result, f"{rank} stage 2, rank 1 goes on (consolidation)")
        assert consolidating in report["error"] and report["seconds"] < 30, report
    assert "Exception ignored" not in result.output, result.output


def assert_job_aborted(case: str, *messages: str) -> None:
    """Run ``case`` under plain python (not -m mpi4py: mpiddp's own hooks must abort the
    job); it must end (within the launch's timeout), unsuccessfully, printing ``messages``
    and nothing after."""
    result = run_mpi("errors_worker.py", 3, case, timeout=60, mpi4py_run=False)
    assert not result.timed_out, result.output
    assert result.returncode != 0
    for message in messages:
        assert message in result.output, result.output
    assert "UNREACHABLE" not in result.output


def test_uncaught_exception_on_one_rank_ends_the_job():
    assert_job_aborted("uncaught_exception", "boom on rank 1", "aborting the MPI job")


def test_uncaught_exception_in_a_thread_ends_the_job():
    # The dying thread is not the main one: threading.excepthook must abort the job too.
    assert_job_aborted("uncaught_exception_in_thread", "loader thread lost its file on rank 1",
                       "lost its thread 'data-loader' to an uncaught OSError")


def test_join_lets_ranks_with_less_data_finish():
    result = run_mpi("errors_worker.py", 4, "join_uneven", timeout=60)
    assert_ok(result, expect_lines=5)


def test_settings_that_differ_between_ranks_are_an_error_everywhere():
    result = run_mpi("errors_worker.py", 2, "settings_differ", timeout=60)
    assert_ok(result, expect_lines=2)


def test_switching_algorithm_with_requests_in_flight():
    result = run_mpi("errors_worker.py", 3, "algorithm_switch_in_flight", timeout=60)
    assert_ok(result, expect_lines=3)


def test_unknown_settings_warn_once_and_script_variables_pass(tmp_path):
    script = tmp_path / "init_only.py"
    script.write_text("import torch, mpiddp\nmpiddp.init()\nrank = mpiddp.rank()\n"
                      "mpiddp.allreduce(torch.ones(3), name='t')\nmpiddp.shutdown()\n"
                      "print('OK rank', rank, flush=True)\n")
    timeline = tmp_path / "horovod_timeline.json"
    env = {"MPIDDP_VENV": "/somewhere/venv", "MPIDDP_SYSTEM_TESTS": "0",
           "MPIDDP_STALL_SHUTDOWN_TIM": "5", "MPIDDP_LAUNCH_HOSTS": "a,a",
           "MPIDDP_LOG_LEVEL": "info",
           # A Horovod job's variables: one honoured, one another meaning, one unknown.
           "HOROVOD_TIMELINE": str(timeline), "HOROVOD_CYCLE_TIME": "5",
           "HOROVOD_NO_SUCH_THING": "1"}
    result = run_mpi(str(script), 2, timeout=60, env=env)
    assert_ok(result, expect_lines=2)
    warning = ("unknown setting MPIDDP_STALL_SHUTDOWN_TIM (ignored); "
               "did you mean MPIDDP_STALL_SHUTDOWN_TIME?")
    assert result.output.count(warning) == 1, result.output      # rank 0 only
    for name in ("MPIDDP_VENV", "MPIDDP_SYSTEM_TESTS", "MPIDDP_LAUNCH_HOSTS"):
        assert name not in result.output
    assert result.output.count(f"HOROVOD_TIMELINE={timeline} read as MPIDDP_TIMELINE=") == 1
    assert result.output.count("HOROVOD_CYCLE_TIME ignored: Horovod waits") == 1
    assert result.output.count("HOROVOD_NO_SUCH_THING ignored: mpiddp has no such") == 1
    # The Horovod variable took effect: every rank wrote its trace.
    for rank in (0, 1):
        trace = tmp_path / f"horovod_timeline.rank{rank}.json"
        assert trace.exists() and '"t"' in trace.read_text(), rank


def test_tasks_that_each_see_a_world_of_one_fail_at_init():
    # What each task of `srun -n 2 --mpi=none` sees (tests/test_slurm.py runs the real srun).
    env = dict(os.environ, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1")
    for name in ("PMI_SIZE", "PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_SIZE", "SLURM_MPI_TYPE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", "import mpiddp; mpiddp.init(); print('TRAINS')"],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "TRAINS" not in proc.stdout, proc.stdout + proc.stderr
    assert "mpiddp.errors.LaunchError: srun started 2 tasks but MPI sees 1 process per task: " \
           "each would train alone" in proc.stderr


@pytest.mark.alone      # ended within the check time + 10 s + 15 s of margin
def test_a_frozen_rank_ends_the_job_naming_it(tmp_path):
    # A rank that stops answering (frozen here; a dead node or a cut link in
    # test_multinode.py) leaves the others inside an MPI call that never completes. The
    # watchdog's roll call must name it and end the job: check time + 10 s answer window.
    cmd, env = mpi_command("fault_worker.py", 3, tmp_path, mpi4py_run=False,
                           env={"MPIDDP_PEER_CHECK_TIME": "2"})
    job = Job(cmd, env)
    frozen = None
    try:
        wait_for_files(tmp_path / "checkpoint.pt", tmp_path / "pid.2", job=job)
        frozen = int((tmp_path / "pid.2").read_text())
        os.kill(frozen, signal.SIGSTOP)
        step_before = torch.load(tmp_path / "checkpoint.pt")["step"]
        start = time.monotonic()
        result = job.wait(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if frozen is not None and not process_gone(frozen):
            os.kill(frozen, signal.SIGKILL)
    assert not result.timed_out, result.output
    assert result.returncode != 0
    assert f"rank 2 on {socket.gethostname()} did not answer" in result.output, result.output
    assert elapsed < 2 + 10 + 15, (elapsed, result.output)
    time.sleep(1)
    assert process_gone(frozen), "the frozen rank was left behind"
    assert torch.load(tmp_path / "checkpoint.pt")["step"] >= step_before


def test_roll_calls_among_healthy_ranks_find_no_rank_missing():
    # The watchdog's roll calls, held by every rank at once as in a real stall, must hear
    # every healthy rank (across nodes: tests/test_multinode.py).
    assert_ok(run_mpi("watchdog_worker.py", 3, "roll-calls", timeout=90), expect_lines=1)


def test_a_coordinator_that_stops_cycling_is_named_and_ends_the_job():
    # Every rank answers the roll calls, so none is lost; but rank 1's coordinator does not
    # begin the cycle the others wait in (it stopped collecting with a collective pending).
    # Rank 0 names it once, with its pending work and process id, and ends the job after
    # MPIDDP_STALL_SHUTDOWN_TIME (recorded by the worker instead); nothing hangs silently.
    result = run_mpi("watchdog_worker.py", 3, "frozen-coordinator", timeout=90,
                     env={"MPIDDP_PEER_CHECK_TIME": "1", "MPIDDP_STALL_SHUTDOWN_TIME": "4"})
    assert_ok(result, expect_lines=1)
    warnings = [line for line in result.output.splitlines()
                if "wait for work instead of beginning cycle" in line]
    assert len(warnings) == 1, result.output
    assert "rank 1 on" in warnings[0] and "The job ends if this lasts 4 s" in warnings[0], \
        warnings[0]


def test_a_hung_test_job_prints_where_every_rank_was(tmp_path):
    # The harness's own promise: a job killed at its timeout first prints every thread's
    # stack on every rank, so a hang found in CI says where it hung.
    script = tmp_path / "hang.py"
    script.write_text("import threading\nfrom mpi4py import MPI\n\n"
                      "def wait_forever_in_here():\n    threading.Event().wait()\n\n"
                      "MPI.COMM_WORLD.Barrier()\nprint('STARTED', flush=True)\n"
                      "wait_forever_in_here()\n")
    result = Job(*mpi_command(str(script), 2, mpi4py_run=False)).wait(timeout=6)
    assert result.timed_out, result.output
    assert result.output.count("in wait_forever_in_here") == 2, result.output
