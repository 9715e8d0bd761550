"""DataLoader workers in a training job, with each of multiprocessing's start methods
(``workers/data_loader_worker.py``). 'spawn' and 'forkserver' (Python 3.14's default on Linux)
start workers that import the training script again, and with it mpiddp: before, that import
initialised MPI in the worker, and MPICH aborted the whole job ("PMI_Init returned -1")."""
from mpi_launch import assert_ok, reported, run_mpi


def test_data_loader_workers():
    result = run_mpi("data_loader_worker.py", 2, timeout=150)
    assert_ok(result)
    for context in ("fork", "spawn", "forkserver"):
        assert reported(result, f"training with {context} workers"), result.output
    assert reported(result, "init() in a worker"), result.output
    # The worker that imported a module calling init() said why, on every rank.
    assert result.output.count("was called while process") == 2, result.output
    assert "Put the script's code under `if __name__ == \"__main__\":`" in result.output
