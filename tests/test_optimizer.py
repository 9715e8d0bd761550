"""DistributedOptimizer, compression and the state-sync functions on 2 and 4 ranks.

Two launches (module-scoped fixtures) run every check of ``workers/optimizer_worker.py``;
each test below asserts on the lines its checks printed. See the worker for what each check
compares (the reference is one plain-torch process training on the concatenated batch).
"""
import pytest

from mpi_launch import assert_ok, reported, run_mpi

ALL = ("equivalence,unused,clip,compression,two_optimizers,mismatch,state,misuse,scheduler,"
       "closure,amp,join,unfreeze")


@pytest.fixture(scope="module")
def two_ranks():
    result = run_mpi("optimizer_worker.py", 2, ALL + ",overlap,compiled", timeout=300)
    assert_ok(result)
    return result


@pytest.fixture(scope="module")
def four_ranks():
    # 4 ranks on a small machine: oversubscribed; the overlap check (timing) runs on 2 only.
    result = run_mpi("optimizer_worker.py", 4, ALL, timeout=300)
    assert_ok(result)
    return result


def expect(result, *fragments, count=1):
    lines = [line for line in result.output.splitlines()
             if line.startswith("OK ") and all(f in line for f in fragments)]
    assert len(lines) == count, (f"expected {count} OK line(s) with {fragments}, got "
                                 f"{lines}\n{result.output}")
    return lines


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def launch(request):
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[request.param])


# Distributed against one process, float32. Adam divides by sqrt(second moment): for
# elements whose gradient is close to zero it turns float32 rounding differences (another
# summation order) into visible differences. float64 agrees to rounding.
TOLERANCES = {("float32", "sgd"): 2e-5, ("float32", "adam"): 1e-3,
              ("float64", "sgd"): 1e-12, ("float64", "adam"): 1e-12}


def test_same_parameters_as_one_process_on_the_concatenated_batch(launch):
    runs = {(r["dtype"], r["optimizer"], r["passes"]): r
            for r in reported(launch, "equivalence", "bitwise-identical-across-ranks")}
    assert set(runs) == {(d, o, p) for d, o in TOLERANCES for p in (1, 2)}, runs
    for (dtype, opt, passes), run in runs.items():
        assert run["max_diff"] <= TOLERANCES[dtype, opt], run


def test_bucket_sizes_do_not_change_the_result(launch):
    run, = reported(launch, "bucket_cap_mb 0 / 0.001 / 100 give the same result")
    assert len(run["max_diffs"]) == 3 and max(run["max_diffs"]) <= 2e-5, run


def test_sum_op_predivide_factor_and_generated_names(launch):
    expect(launch, "op=Sum and gradient_predivide_factor")
    expect(launch, "no named_parameters (generated names)")


def test_unused_and_frozen_parameters(launch):
    expect(launch, "unused parameters (NoneCompressor): no deadlock")
    expect(launch, "unused parameters (FP16Compressor): no deadlock")


def test_clipping_between_synchronize_and_step(launch):
    expect(launch, "clipping via synchronize()+skip_synchronize() matches one process",
           "backward() returns with gradients averaged on every rank")


def test_fp16_and_bf16_compression(launch):
    expect(launch, "compression FP16Compressor: close to the float32 run")
    expect(launch, "compression BF16Compressor: close to the float32 run")
    expect(launch, "compression fp16 with gradient_predivide_factor")


def test_two_optimizers_with_the_same_parameter_names(launch):
    expect(launch, "two DistributedOptimizers (GAN-style")


def test_models_differing_across_ranks_fail_on_every_rank(launch):
    line = expect(launch, "different shapes: TensorMismatchError on every rank")[0]
    assert "first difference at parameter 0: rank 0 has '0.weight' [32, 12] float32, " \
           "rank 1 has '0.weight' [33, 12] float32" in line
    expect(launch, "different parameter counts")
    expect(launch, "different settings across ranks")
    expect(launch, "a gradient shape that differs at run time: backward() raises on every rank")
    expect(launch, "bad arguments")


def test_optimizer_state_and_object_broadcast(launch):
    for name in ("Adam", "SGD", "CountingOptimizer"):
        expect(launch, f"broadcast_optimizer_state {name} from rank")
    expect(launch, "empty state on the root")
    expect(launch, "state loaded on one rank and broadcast")
    expect(launch, "broadcast_parameters(state_dict) includes buffers")
    expect(launch, "broadcast_object / allgather_object")


def test_extra_backward_passes_accumulate_and_zero_grad_never_races(launch):
    for passes in (1, 2):
        expect(launch, f"backward_passes_per_step={passes} with {passes + 1} backward passes "
                       "before step(): gradients accumulate as in one process")
    expect(launch, "zero_grad() right after backward leaves no late writes")


def test_amp_grad_scaler_recipes_step_with_averaged_unscaled_gradients(launch):
    for recipe in ("plain", "clip"):
        for compression in ("NoneCompressor", "FP16Compressor"):
            expect(launch, f"AMP {recipe} recipe, {compression}:", "replicas bitwise identical")


def test_uneven_data_with_join_after_step(launch):
    expect(launch, "uneven data: 12 epochs of step() then join() on every rank, no error")


def test_gradual_unfreezing(launch):
    expect(launch, "gradual unfreezing: frozen at construction, unfrozen at step 4")


def test_schedulers_hooks_and_add_param_group(launch):
    expect(launch, "LR schedulers built before and after wrapping both apply")
    expect(launch, "step pre-hooks run once, and see averaged gradients")
    expect(launch, "add_param_group after wrapping")


def test_lbfgs_closure_stays_in_lockstep(launch):
    expect(launch, "step(closure) with LBFGS")


def test_last_layer_is_reduced_while_backward_runs(two_ranks):
    run, = reported(two_ranks, "overlap: reduction of")
    # Every step but the first (new names negotiate through rank 0); a noisy machine may
    # miss one more.
    assert all(n >= run["steps"] - 2 for n in run["overlapped"]), run


def test_torch_compiled_model_and_training_step_match_one_process(two_ranks):
    expect(two_ranks, "torch.compile'd model: matches one process")
    expect(two_ranks, "torch.compile'd step: matches one process")
