"""The links' probe (``cost_model.measure_link_costs``) where the ranks' pairs differ in size:
ranks 0 and 1 measure between themselves, rank 2 is alone in its pairs (a node with a local
rank that no other node has). Every rank must leave the probe (its exchanges start together
across the whole communicator, so a rank with nothing to measure still joins every start)
with the same values.

Prints 'OK ...' on rank 0.
"""
from mpi4py import MPI

from mpiddp.collectives.cost_model import measure_link_costs

world = MPI.COMM_WORLD
rank = world.Get_rank()
pairs = world.Split(0 if rank < 2 else 1, rank)
for _ in range(3):
    link = measure_link_costs(pairs, world)
    everyone = world.allgather((link.latency_s, link.seconds_per_byte))
    assert len(set(everyone)) == 1, everyone
    assert link.latency_s > 0 and link.seconds_per_byte > 0, link
pairs.Free()
if rank == 0:
    print(f"OK link probe on uneven pairs: {link.describe()}", flush=True)
