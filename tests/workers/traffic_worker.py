"""The traffic counters of engine_stats() against hand-computed bytes, at 2 ranks with the
ring (the test sets MPIDDP_ALLREDUCE_ALGORITHM=ring and MPIDDP_TRAFFIC_SUMMARY=1).

At N = 2 ranks the ring all-reduce of B bytes sends and receives 2 (N-1)/N B = B: one chunk
of B/2 in its reduce-scatter step, the other in its all-gather step. Each check resets the
counters, runs, and reports what it read (tests/test_traffic.py compares them with the
numbers written there).
"""
import time

import torch
import torch.nn.functional as F

import mpiddp
from checks import expect, ok

TRAFFIC = ("collectives", "tensor_bytes", "sent_bytes", "received_bytes")

torch.set_num_threads(1)
mpiddp.init()
rank, size = mpiddp.rank(), mpiddp.size()
assert size == 2


def traffic(process_set=None) -> dict:
    stats = mpiddp.engine_stats(process_set)
    return {key: stats[key] for key in TRAFFIC}


def report(check: str, **extra) -> None:
    ok(check, rank, every_rank=True, **traffic(), **extra)


# A float32 all-reduce of 1000 elements (4000 bytes) by the ring.
mpiddp.reset_engine_stats()
mpiddp.allreduce(torch.ones(1000), name="ring.f32")
report("ring float32", ring_batches=mpiddp.engine_stats()["ring_batches"])

# The same by MPI's own all-reduce: its payload, the buffer each way.
mpiddp.set_allreduce_algorithm("native")
mpiddp.reset_engine_stats()
mpiddp.allreduce(torch.ones(1000), name="native.f32")
report("native float32", native_batches=mpiddp.engine_stats()["native_batches"])
mpiddp.set_allreduce_algorithm("ring")

# Compression: fp16 and bf16 carry 2 bytes per element.
for label, compression in (("fp16", mpiddp.Compression.fp16),
                           ("bf16", mpiddp.Compression.bf16)):
    mpiddp.reset_engine_stats()
    out = mpiddp.allreduce(torch.ones(1000), name=f"ring.{label}", compression=compression)
    assert out.dtype == torch.float32 and float(out[0]) == 1.0
    report(f"ring {label}")

# Reduce-scatter of 1000 float32 (rank r keeps 500 of them) and all-gather of uneven rows.
mpiddp.reset_engine_stats()
mpiddp.reducescatter(torch.ones(1000), name="rs")
report("reducescatter", reducescatter_bytes=mpiddp.engine_stats()["reducescatter_bytes"])
mpiddp.reset_engine_stats()
gathered = mpiddp.allgather(torch.ones(3 + 2 * rank, 10), name="ag")     # 3 and 5 rows
assert gathered.shape == (8, 10)
report("allgather")
mpiddp.reset_engine_stats()
mpiddp.broadcast(torch.ones(1000), root_rank=0, name="bc")
report("broadcast")


def model() -> torch.nn.Module:
    """Linear(64, 32) + Linear(32, 4): 2080 + 132 = 2212 float32, 8848 bytes of gradients."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def steps(label: str, **options) -> None:
    """Three training steps; the counters of the third (the first ones agree on names and
    layouts once)."""
    net = model()
    optimizer = mpiddp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                            named_parameters=net.named_parameters(),
                                            **options)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        mpiddp.reset_engine_stats()
        optimizer.zero_grad()
        F.mse_loss(net(torch.randn(8, 64, generator=generator)), torch.zeros(8, 4)).backward()
        optimizer.step()
    stats = mpiddp.engine_stats()
    report(f"step {label}", reducescatter_bytes=stats["reducescatter_bytes"],
           allreduce_bytes=stats["allreduce_bytes"])


steps("plain")
steps("fp16", compression=mpiddp.Compression.fp16)
steps("powersgd", compression=mpiddp.Compression.powersgd(rank=2, start_step=0))
steps("zero2", zero_stage=2)

# A process set of rank 0 alone: its engine counts its own collectives, none on the wire;
# the global set's counters see none of them.
alone = mpiddp.add_process_set([0])
mpiddp.reset_engine_stats()
if rank == 0:
    mpiddp.reset_engine_stats(alone)
    mpiddp.allreduce(torch.ones(1000), name="alone", process_set=alone)
    ok("process set", rank, every_rank=True, **traffic(alone))
else:
    expect(ValueError, lambda: mpiddp.engine_stats(alone), "is not in")
assert traffic(mpiddp.global_process_set) == traffic()
report("global beside the set")       # the set stays: rank 0's summary has its line too

# Waiting: rank 1 submits 0.5 s late; rank 0's wait for the result counts at least that
# much of it (the handle's wait, in the blocking call).
mpiddp.reset_engine_stats()
if rank == 1:
    time.sleep(0.5)
mpiddp.allreduce(torch.ones(10), name="late")
ok("wait", rank, every_rank=True, wait_seconds=mpiddp.engine_stats()["wait_seconds"])

# Reset zeroes the traffic; what is left goes into the summary line at shutdown.
mpiddp.reset_engine_stats()
assert all(mpiddp.engine_stats()[key] == 0 for key in TRAFFIC + ("wait_seconds",)), \
    mpiddp.engine_stats()
mpiddp.allreduce(torch.ones(250), name="last")
report("before shutdown")
mpiddp.shutdown()
