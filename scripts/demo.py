"""A small tour of the mpiddp tensor API: mpiexec -n 8 python scripts/demo.py

Every rank contributes its own data; rank 0 prints what came back and checks it.
"""
import torch

import mpiddp


def main():
    torch.set_num_threads(1)
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"mpiddp demo on {size} ranks ({mpiddp.local_size()} per node)")

    grad = torch.full((5,), float(rank))
    avg = mpiddp.allreduce(grad, name="grad")                    # Average by default
    assert torch.allclose(avg, torch.full((5,), (size - 1) / 2))
    say(f"allreduce (average of ranks 0..{size - 1}): {avg.tolist()}")

    handles = [mpiddp.allreduce_async(torch.full((1000,), float(i)), name=f"layer{i}",
                                      op=mpiddp.Sum) for i in range(32)]
    sums = [mpiddp.synchronize(h)[0].item() for h in handles]
    assert sums == [float(i * size) for i in range(32)]
    say(f"32 asynchronous allreduces fused into {mpiddp.engine_stats()['allreduce_batches'] - 1}"
        f" buffer reduction(s) on rank 0")

    gathered = mpiddp.allgather(torch.full((rank + 1, 2), rank), name="rows")
    say(f"allgather of 1..{size} rows per rank: {tuple(gathered.shape)} rows x cols")

    weights = mpiddp.broadcast(torch.randn(3) if rank == 0 else torch.zeros(3), root_rank=0,
                               name="weights")
    say(f"broadcast from rank 0: {weights.tolist()}")

    shard = mpiddp.reducescatter(torch.ones(2 * size, 3), name="shard", op=mpiddp.Sum)
    say(f"reducescatter: rank 0 keeps {tuple(shard.shape)} of the sum, values {shard[0].tolist()}")

    mpiddp.barrier()
    say(f"engine statistics on rank 0: {mpiddp.engine_stats()}")
    mpiddp.shutdown()


if __name__ == "__main__":
    main()
