"""The exchange sequences of one all-reduce, without the reductions' engine around them: the
ring's 2 (N-1) steps (send right, receive from the left, 1/N of the buffer each) against
halving-doubling's 2 log2 N (the same partner both ways, halving then doubling sizes), over
mpiddp's own TCP connections (transport/sockets.py), optionally with a barrier before every
step (all ranks start each step together). Run on the emulated cluster as root:

    scripts/cluster/local_cluster.sh run 16x1 -- -genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1 \\
        python scripts/bench/exchange_patterns.py --mib 16

Prints seconds per sequence (the slowest rank's, between barriers), alternating the patterns.
docs/dev/scaling-model.md ("What the model leaves out") has what it showed.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

from mpiddp.engine.transport_choice import exchange_partners
from mpiddp.transport.sockets import PeerSockets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16.0, help="the all-reduce's buffer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ifname", default="eth0", help="the interface between the nodes")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size & (size - 1) or size < 2:
        raise SystemExit("a power of two of ranks, one per node")
    sockets = PeerSockets.connect(comm, exchange_partners(rank, size), [args.ifname],
                                  required=True)
    buf = np.ones(int(args.mib * (1 << 20)) // 4, np.float32)
    scratch = np.empty_like(buf)

    def exchange(dest: int, source: int, count: int, reduce: bool, barrier: bool) -> None:
        if barrier:
            comm.Barrier()
        sent, got = buf[:count], scratch[:count]
        sockets.start_exchange(comm, sent, memoryview(sent).cast("B"), dest, 5,
                               got, memoryview(got).cast("B"), source, 5).wait()
        if reduce:
            np.add(sent, got, out=sent)

    def ring(barrier: bool) -> None:
        right, left, count = (rank + 1) % size, (rank - 1) % size, len(buf) // size
        for step in range(2 * (size - 1)):
            exchange(right, left, count, step < size - 1, barrier)

    def halving_doubling(barrier: bool) -> None:
        count, distances = len(buf), [size >> k for k in range(1, size.bit_length())]
        for distance in distances:
            count //= 2
            exchange(rank ^ distance, rank ^ distance, count, True, barrier)
        for distance in reversed(distances):
            exchange(rank ^ distance, rank ^ distance, count, False, barrier)
            count *= 2

    patterns = {"ring": lambda: ring(False), "halving-doubling": lambda: halving_doubling(False),
                "halving-doubling, a barrier per step": lambda: halving_doubling(True)}
    times = {name: [] for name in patterns}
    for _ in range(args.repeats):
        for name, run in patterns.items():
            comm.Barrier()
            start = time.perf_counter()
            run()
            comm.Barrier()
            times[name].append(time.perf_counter() - start)
    sockets.close()
    if rank == 0:
        print(f"{size} ranks, {args.mib:g} MiB, over the engine's TCP connections:")
        for name, seconds in times.items():
            print(f"  {name}: " + ", ".join(f"{s:.3f}" for s in seconds) + " s")


if __name__ == "__main__":
    main()
