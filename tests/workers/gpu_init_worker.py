"""init() on a machine without a GPU: the CUDA-aware decision, no device chosen, no CuPy
import, and a CPU/GPU device mismatch of one name reported by negotiation on every rank.

argv[1]: the expected mpiddp.mpi_cuda_aware() ("0" or "1"). Prints 'OK rank <r>' per rank.

The mismatch is produced with requests labelled device="cuda" over host arrays: negotiation
compares only the labels and fails the name before any buffer is touched, so this checks the
real engine path without a GPU.
"""
import sys

import numpy as np
import torch

import mpiddp
from mpiddp import runtime
from mpiddp import gpu
from mpiddp.engine.handle import Handle
from mpiddp.engine.request import ALLREDUCE, Entry, Request

expected = sys.argv[1] == "1"
mpiddp.init()
rank, size = mpiddp.rank(), mpiddp.size()
assert mpiddp.mpi_cuda_aware() is expected, mpiddp.mpi_cuda_aware()
if not torch.cuda.is_available():
    assert gpu.engine_device() is None

# rank 0 has the tensor on the CPU, the others on a GPU
device = "cpu" if rank == 0 else "cuda"
array = np.full(4, rank, np.float32)
entry = Entry(Request("layer.weight", ALLREDUCE, "float32", (4,), device=device), array, array,
              Handle("layer.weight"))
[handle] = runtime.require_engine("test").submit_many([entry])
try:
    handle.wait()
except mpiddp.TensorMismatchError as exc:
    text = str(exc)
    assert "Mismatched allreduce devices for 'layer.weight'" in text, text
    assert "rank 0 sent cpu" in text and "sent cuda" in text, text
else:
    raise AssertionError("a CPU/GPU mismatch was not reported")

# the engine goes on: an ordinary CPU allreduce
out = mpiddp.allreduce(torch.ones(5), name="after", op=mpiddp.Sum)
assert out.tolist() == [float(size)] * 5
assert "cupy" not in sys.modules, "the CPU path imported CuPy"
mpiddp.shutdown()
print(f"OK rank {rank}", flush=True)
