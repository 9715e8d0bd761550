"""Forward overlap (``DistributedOptimizer(overlap_forward=True)``) at 2, 3 and 4 ranks.

Each launch runs checks of ``workers/forward_overlap_worker.py``: the parameters and
optimizer state bitwise equal to the standard path's after every kind of step (SGD with
momentum, nesterov and weight decay, Adam, AdamW, an LR scheduler, two backward passes per
step, fp16/bf16 compression), no stale read of a parameter before the next forward, the
fallback for a gradient read before ``step()``, refusals, the setting, the cycle budget for
device memory (measured, agreed, raised on every rank), a torch.compile'd forward (the
standard path from then on), ``join()``, and a stall surfacing from the next forward.
"""
import pytest

from mpi_launch import assert_ok, reported, run_mpi

STEPS = 4      # the worker's steps per run
BITWISE = {"sgd-momentum-nesterov-wd", "adam", "adamw", "sgd+scheduler", "adam+2-passes",
           "adamw+fp16", "sgd+bf16+scheduler"}


@pytest.fixture(scope="module")
def two_ranks():
    result = run_mpi("forward_overlap_worker.py", 2,
                     "bitwise,stale,fallback,refusals,setting,device_budget,host_budget,compiled,"
                     "inference,dropped,join",
                     timeout=180)
    assert_ok(result)
    return result


@pytest.fixture(scope="module")
def three_ranks():
    result = run_mpi("forward_overlap_worker.py", 3, "bitwise,setting,auto", timeout=180,
                     env={"MPIDDP_OVERLAP_FORWARD": "1"})
    assert_ok(result)
    return result


@pytest.fixture(scope="module")
def four_ranks():
    # Gradients cut into pieces of at most 256 bytes, reduced apart, most urgent first.
    result = run_mpi("forward_overlap_worker.py", 4, "bitwise,join", timeout=200,
                     env={"MPIDDP_PRIORITY_CYCLE_BYTES": "256"})
    assert_ok(result)
    return result


@pytest.mark.parametrize("launch", ["two_ranks", "three_ranks", "four_ranks"])
def test_parameters_bitwise_equal_to_the_standard_path(launch, request):
    runs = reported(request.getfixturevalue(launch), "bitwise")
    assert {run["check"].split(" ", 1)[1] for run in runs} == BITWISE
    for run in runs:       # every step really returned before its update ran
        assert run["deferred_steps"] == STEPS, run
        assert run["cut"] == (launch == "four_ranks"), run


def test_no_read_sees_a_stale_parameter(two_ranks):
    run, = reported(two_ranks, "no stale reads")
    assert len(run["reads"]) == 7


def test_gradient_read_before_step_falls_back_once_and_matches(two_ranks):
    run, = reported(two_ranks, "clipping falls back and matches")
    assert run["logged"] == 1


def test_lbfgs_and_closures_are_refused(two_ranks):
    assert reported(two_ranks, "LBFGS and closures refused")


def test_the_setting_turns_it_on_for_an_unchanged_script(two_ranks, three_ranks):
    assert [r["on"] for r in reported(two_ranks, "setting")] == [False]
    assert [r["on"] for r in reported(three_ranks, "setting")] == [True]


def test_device_memorys_budget_is_measured_agreed_and_carried_on_every_rank(two_ranks):
    # Host memory poses as the device (no GPU here): the measured budget is above the
    # host's 1 MiB on one node, and the pieces' requests carry it on every engine.
    run, = reported(two_ranks, "device budget")
    assert run["pieces"] > run["before"] == 1 << 20, run


def test_host_memorys_cycles_are_sized_for_the_gradients_on_every_rank(two_ranks):
    # The links' rule stood in for (one node measures none): pieces of a quarter of the
    # gradients' bytes, their requests carrying that as their cycles' budget.
    run, = reported(two_ranks, "host budget")
    assert run["pieces"] == run["wire"] // 4 < run["before"] == 1 << 20, run


def test_a_compiled_forward_ends_overlap_and_stays_equal(two_ranks):
    # torch.compile (backend aot_eager: no C compiler needed) after 3 overlapped steps.
    run, = reported(two_ranks, "compiled")
    assert run["deferred_steps"] == 3, run


def test_validation_in_inference_mode_between_steps(two_ranks):
    run, = reported(two_ranks, "inference mode between steps")
    assert run["deferred_steps"] == STEPS, run


def test_a_dropped_optimizers_deferred_update_lands_and_it_is_released(two_ranks):
    run, = reported(two_ranks, "a dropped optimizer's update lands")
    assert run["released"] == [True, True, True], run


@pytest.mark.parametrize("launch", ["two_ranks", "four_ranks"])
def test_join_completes_the_deferred_update(launch, request):
    assert reported(request.getfixturevalue(launch), "join completes deferred updates")


def test_a_stall_surfaces_as_an_error_in_the_next_forward():
    result = run_mpi("forward_overlap_worker.py", 2, "stall", timeout=90,
                     env={"MPIDDP_STALL_CHECK_TIME": "1", "MPIDDP_STALL_SHUTDOWN_TIME": "2"})
    assert_ok(result)
    assert reported(result, "stall surfaces in the next forward")


def test_auto_tries_both_in_step_on_every_rank_and_keeps_one(three_ranks):
    run, = reported(three_ranks, "auto")
    assert run["switches"] >= 3, run          # on, off, on, off, then the decision
    assert run["deferred_steps"] >= 6, run    # the 'on' phases really overlapped
