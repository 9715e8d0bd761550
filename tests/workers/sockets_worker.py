"""The TCP transport over MPI on one machine (loopback), every rank pretending to be a node
of its own: connections to the ring and halving-doubling partners, both algorithms through
``NetworkComm`` with them against a float64 reference (sizes that need the sender thread,
uneven and empty chunks) and not one message over MPI, then a connection
that cannot be made: agreed by every rank, an error naming the ranks where it was required.

Then recursive doubling over the same connections (its partners are among them): a float32
sum against the reference, and the control channel's byte-wise AND.

Prints 'OK ...' on rank 0 (5 lines).
"""
import numpy as np
from mpi4py import MPI

from mpiddp.collectives.halving_doubling import halving_doubling_allreduce, scratch_elements
from mpiddp.collectives.recursive_doubling import recursive_doubling
from mpiddp.collectives.ring import ring_allreduce
from mpiddp.engine.transport_choice import exchange_partners
from mpiddp.errors import MpiddpError
from mpiddp.transport.network import NetworkComm
from mpiddp.transport.pacing import Pacing
from mpiddp.transport.sockets import PeerSockets

world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()


def say(text):
    if RANK == 0:
        print("OK", text, flush=True)



class NoMessagesOverMpi:
    """The communicator's rank and size; a point-to-point call over MPI fails the test."""

    def Get_rank(self):
        return RANK

    def Get_size(self):
        return SIZE

    def __getattr__(self, name):
        raise AssertionError(f"MPI.{name} called: a message went over MPI, not the sockets")


sockets = PeerSockets.connect(world, exchange_partners(RANK, SIZE), (), required=True)
assert set(sockets.connections) == exchange_partners(RANK, SIZE), sockets.connections
comm = NetworkComm(NoMessagesOverMpi(), Pacing(), sockets)
say(f"connected to {sorted(sockets.connections)} on rank 0")

for name, algorithm, scratch_for in (
        ("ring", ring_allreduce, lambda n: n // SIZE + 1),
        ("halving-doubling", halving_doubling_allreduce, lambda n: scratch_elements(n, SIZE))):
    for count in (0, 1, SIZE + 1, 5_000_003):
        rng = np.random.default_rng(count + RANK)
        mine = rng.standard_normal(count).astype(np.float32)
        everyone = world.allgather(mine)
        expected = np.sum(np.stack([a.astype(np.float64) for a in everyone]), axis=0) \
            if count else np.zeros(0)
        buf = mine.copy()
        scratch = np.empty(max(1, scratch_for(count)), np.float32)
        algorithm(comm, buf, scratch, lambda dst, src: np.add(dst, src, out=dst))
        np.testing.assert_allclose(buf, expected, rtol=1e-5, atol=1e-4)
        same = world.allgather(buf.tobytes())
        assert all(b == same[0] for b in same), f"{name} {count}: ranks differ"
    say(f"{name} over sockets matches the float64 reference on every rank")


for count in (0, 1, 1000, 300_001):
    rng = np.random.default_rng(count + RANK)
    mine = rng.standard_normal(count).astype(np.float32)
    expected = np.sum(np.stack([a.astype(np.float64) for a in world.allgather(mine)]), axis=0)
    buf = mine.copy()
    recursive_doubling(sockets.exchange, RANK, SIZE, buf, np.empty_like(buf),
                       lambda dst, src: np.add(dst, src, out=dst))
    np.testing.assert_allclose(buf, expected.astype(np.float32), rtol=1e-5, atol=1e-4)
    same = world.allgather(buf.tobytes())
    assert all(b == same[0] for b in same), f"recursive doubling {count}: ranks differ"
bits = np.frombuffer(np.random.default_rng(RANK).bytes(403), np.uint8).copy()
expected_bits = np.bitwise_and.reduce(np.stack(world.allgather(bits)), axis=0)
recursive_doubling(sockets.exchange, RANK, SIZE, bits, np.empty_like(bits),
                   lambda dst, src: np.bitwise_and(dst, src, out=dst))
assert (bits == expected_bits).all()
say("recursive doubling over sockets: sums match the reference, bytes AND exactly")
over_sockets, over_mpi = sockets.probe_seconds(1 << 16, repeats=2)
assert 0 < over_sockets < 10 and 0 < over_mpi < 10, (over_sockets, over_mpi)
sockets.close()

# An interface that does not exist: nothing to connect with, on every rank.
assert PeerSockets.connect(world, exchange_partners(RANK, SIZE), ["no-such-if0"]) is None
try:
    PeerSockets.connect(world, exchange_partners(RANK, SIZE), ["no-such-if0"], required=True)
except MpiddpError as error:
    assert "rank 0: no IPv4 address on no-such-if0" in str(error), error
    assert f"rank {SIZE - 1}:" in str(error), error
else:
    raise AssertionError("required sockets without an address did not raise")
say("a failed connection is agreed: None everywhere, or an error naming every rank")
