"""Errors end cleanly on every rank with messages that name the tensor, ranks and values;
stalls, shutdowns and crashed ranks never leave the others hanging."""
import time

from mpi_launch import assert_ok, run_mpi


def test_mismatches_and_bad_input_fail_on_every_rank():
    result = run_mpi("errors_worker.py", 3, "mismatches", timeout=90)
    assert_ok(result, expect_lines=3 * 11)
    assert "Mismatched allreduce shapes for 'layer1.weight': ranks 0, 1 sent [4, 3], " \
           "rank 2 sent [3, 4]" in result.output


def test_stall_warns_then_shuts_down_with_reason():
    env = {"MPIDDP_STALL_CHECK_TIME": "1", "MPIDDP_STALL_SHUTDOWN_TIME": "3"}
    start = time.monotonic()
    result = run_mpi("errors_worker.py", 3, "stall", timeout=60, env=env)
    assert_ok(result, expect_lines=3)
    assert "stall warning" in result.output
    assert "rank 2 has not submitted: 'lonely'" in result.output
    assert time.monotonic() - start < 45


def test_shutdown_on_one_rank_fails_pending_requests_elsewhere():
    result = run_mpi("errors_worker.py", 3, "shutdown_with_pending", timeout=60)
    assert_ok(result, expect_lines=3)


def test_uncaught_exception_on_one_rank_ends_the_job():
    # Plain python (not -m mpi4py): mpiddp's own excepthook must abort the job.
    start = time.monotonic()
    result = run_mpi("errors_worker.py", 3, "uncaught_exception", timeout=60, mpi4py_run=False)
    assert not result.timed_out, result.output
    assert result.returncode != 0
    assert "boom on rank 1" in result.output
    assert "aborting the MPI job" in result.output
    assert "UNREACHABLE" not in result.output
    assert time.monotonic() - start < 30


def test_uncaught_exception_in_a_thread_ends_the_job():
    # The dying thread is not the main one: threading.excepthook must abort the job too.
    start = time.monotonic()
    result = run_mpi("errors_worker.py", 3, "uncaught_exception_in_thread", timeout=60,
                     mpi4py_run=False)
    assert not result.timed_out, result.output
    assert result.returncode != 0
    assert "loader thread lost its file on rank 1" in result.output
    assert "lost its thread 'data-loader' to an uncaught OSError" in result.output
    assert "UNREACHABLE" not in result.output
    assert time.monotonic() - start < 30


def test_join_lets_ranks_with_less_data_finish():
    result = run_mpi("errors_worker.py", 4, "join_uneven", timeout=60)
    assert_ok(result, expect_lines=5)


def test_settings_that_differ_between_ranks_are_an_error_everywhere():
    result = run_mpi("errors_worker.py", 2, "settings_differ", timeout=60)
    assert_ok(result, expect_lines=2)


def test_switching_algorithm_with_requests_in_flight():
    result = run_mpi("errors_worker.py", 3, "algorithm_switch_in_flight", timeout=60)
    assert_ok(result, expect_lines=3)
