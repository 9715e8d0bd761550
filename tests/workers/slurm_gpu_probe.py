"""A rank of scripts/cluster/slurm_gpu.sbatch on the local Slurm's fake GPUs (tests/test_slurm.py).

The GPUs Slurm gave the task (``CUDA_VISIBLE_DEVICES``) become fake CUDA devices
(tests/workers/fake_cuda.py) whose identity is the physical GPU's number, so that mpiddp's own
choice at import (GPU <local rank> among the visible ones) and its shared-GPU check at init()
run as on a GPU node. Prints ``PROBE {json}``: the rank, its local rank, what Slurm made
visible, the device mpiddp made current and the physical GPU behind it.
"""
import json
import os
import socket
import types

import fake_cuda

VISIBLE = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
GPU = fake_cuda.FakeGPU(len(VISIBLE))
fake_cuda.install(GPU)                # before mpiddp: it picks the device at import

import torch  # noqa: E402


def device_properties(device=None):
    """One node: visible device k is physical GPU VISIBLE[k] in every process."""
    index = torch.cuda.current_device() if device is None else int(getattr(device, "index",
                                                                           device))
    physical = int(VISIBLE[index])
    return types.SimpleNamespace(name=f"Fake GPU {physical}",
                                 uuid=fake_cuda.FakeUUID(f"GPU-fake-{physical:012x}"))


torch.cuda.get_device_properties = device_properties

import mpiddp  # noqa: E402

mpiddp.init()
device = torch.cuda.current_device()
total = mpiddp.allreduce(torch.ones(1), op=mpiddp.Sum, name="probe")
print("PROBE " + json.dumps({
    "rank": mpiddp.rank(), "size": mpiddp.size(), "local_rank": mpiddp.local_rank(),
    "host": socket.gethostname(), "visible": VISIBLE, "device": device,
    "physical": int(VISIBLE[device]), "sum": int(total.item())}), flush=True)
mpiddp.shutdown()
