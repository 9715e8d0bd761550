"""The TCP transport across nodes (mpiddp/transport/sockets.py): exchanges matched by order
on each connection, a broken connection named, only the job's own ranks accepted, and (over
MPI, on this machine's loopback) the ring and halving-doubling through it against a float64
reference, with the choice agreed by every rank."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from mpi_launch import ROOT, assert_ok, run_mpi
from mpiddp.collectives.halving_doubling import partners
from mpiddp.collectives.ring import neighbours
from mpiddp.errors import MpiddpError
from mpiddp.transport.sockets import (PeerConnectionLost, PeerSockets, accept_peers,
                                      interface_addresses)


@pytest.fixture
def pair():
    """Rank 0's and rank 1's ``PeerSockets``, joined by one full-duplex connection (closed
    afterwards)."""
    a, b = socket.socketpair()
    hosts = ["node-a", "node-b"]
    zero, one = PeerSockets(None, {1: a}, hosts), PeerSockets(None, {0: b}, hosts)
    yield zero, one
    zero.close()
    one.close()


def exchange(sockets, peer, send, recv):
    return sockets.start(peer, memoryview(send).cast("B"), peer, memoryview(recv).cast("B"), [])


def test_exchanges_match_by_order_whatever_order_they_are_waited_for(pair):
    zero, one = pair
    # Large enough that the kernel cannot take them at once: the sender thread writes.
    sizes = [3_000_001, 17, 1_000_000]
    sent = {r: [np.arange(n, dtype=np.float32) * (r + 1) + i for i, n in enumerate(sizes)]
            for r in (0, 1)}
    got = {r: [np.empty(n, np.float32) for n in sizes] for r in (0, 1)}
    started = {r: [exchange(s, 1 - r, sent[r][i], got[r][i]) for i in range(len(sizes))]
               for r, s in ((0, zero), (1, one))}
    # Each rank waits on its own thread, as two processes would (a send completes only
    # when the partner reads it).

    def wait_all(r):
        for transfer in reversed(started[r]):
            transfer.wait()

    other = threading.Thread(target=wait_all, args=(1,))
    other.start()
    wait_all(0)
    other.join(timeout=60)
    assert not other.is_alive()
    for r in (0, 1):
        for i in range(len(sizes)):
            np.testing.assert_array_equal(got[r][i], sent[1 - r][i])


def test_an_empty_message_is_not_sent_on_either_side(pair):
    zero, one = pair
    # Were an empty message sent, the receive of 5 bytes would meet its length (0).
    empty, data = np.empty(0, np.uint8), np.arange(5, dtype=np.uint8)
    into = np.empty(5, np.uint8)
    exchange(zero, 1, empty, empty).wait()
    one.start(0, None, 0, memoryview(empty), []).wait()
    exchange(zero, 1, data, empty)
    exchange(one, 0, empty, into).wait()
    np.testing.assert_array_equal(into, data)


def test_finish_spins_only_after_a_run_of_short_waits(pair, monkeypatch):
    from mpiddp.transport import sockets as module

    zero, one = pair
    polls = []
    real_select = module.select.select
    monkeypatch.setattr(module.select, "select", lambda *a: polls.append(1) or real_select(*a))
    # A wider spin than the engine's 200 us, and a late partner well past it: under the
    # suite's load a receive of bytes already in could take longer than 200 us (seen in CI).
    monkeypatch.setattr(module, "SPIN_SECONDS", 0.02)
    message, into = np.arange(4, dtype=np.uint8), np.empty(4, np.uint8)

    def send():
        one.start(0, memoryview(message), 0, None, []).wait()

    def receive():
        polls.clear()
        zero.finish(zero.start(1, None, 1, memoryview(into), []))
        np.testing.assert_array_equal(into, message)

    def receive_late():                 # the partner's bytes come after the spin
        late = threading.Timer(0.2, send)
        late.start()
        receive()
        late.join()

    receive_late()                      # at first it spins; then not for a few waits
    assert polls and zero._short_waits == 0
    for waits in range(1, module.SHORT_WAITS_BEFORE_SPIN + 1):
        send()                          # already in when rank 0 waits
        receive()
        assert zero._short_waits == waits and not polls
    receive_late()                      # after a run of short waits it polls, then blocks
    assert polls and zero._short_waits == 0


def test_a_message_of_another_length_than_expected_is_an_error_naming_both(pair):
    zero, one = pair
    exchange(zero, 1, np.zeros(10, np.uint8), np.empty(0, np.uint8))
    with pytest.raises(MpiddpError, match="rank 0 on node-a sent a message of 10 bytes "
                                          "where rank . expected 12"):
        one.start(0, None, 0, memoryview(np.empty(12, np.uint8)), []).wait()


def test_a_partner_whose_connection_breaks_is_named(pair):
    zero, one = pair
    one.connections[0].close()
    recv = np.empty(1000, np.uint8)
    with pytest.raises(PeerConnectionLost, match="rank 1 on node-b"):   # send or receive
        exchange(zero, 1, np.zeros(10, np.uint8), recv).wait()
    with pytest.raises(PeerConnectionLost, match="rank 1 on node-b"):   # receive only
        zero.start(1, None, 1, memoryview(recv), []).wait()


def test_only_expected_ranks_with_the_jobs_token_are_accepted():
    from mpiddp.transport.sockets import _HELLO
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    token = b"t" * 16

    def dial(hello: bytes):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(hello)
        return sock

    clients = [dial(b"nonsense"), dial(_HELLO.pack(b"x" * 16, 2)), dial(_HELLO.pack(token, 5)),
               dial(_HELLO.pack(token, 2))]
    try:
        accepted = accept_peers(listener, token, {2}, timeout=10)
        assert list(accepted) == [2]
        clients[3].sendall(b"hi")
        assert accepted[2].recv(2, socket.MSG_WAITALL) == b"hi"
        accepted[2].close()
        with pytest.raises(socket.timeout, match=r"ranks \[3\] did not connect"):
            accept_peers(listener, token, {3}, timeout=0.3)
    finally:
        for sock in clients:
            sock.close()
        listener.close()


def test_interface_addresses_put_loopback_last_and_honour_names():
    everything = interface_addresses()
    assert "127.0.0.1" in everything
    assert everything.index("127.0.0.1") == len(everything) - 1 or \
        all(a.startswith("127.") for a in everything[everything.index("127.0.0.1"):])
    assert interface_addresses(["lo"]) == ["127.0.0.1"]
    assert interface_addresses(["no-such-interface0"]) == []


@pytest.mark.parametrize("size", range(2, 34))
def test_exchange_partners_are_mutual(size):
    # Connections are opened for mutual pairs only: a one-sided partner would never connect.
    for relation in (neighbours, partners):
        found = {r: relation(r, size) for r in range(size)}
        assert all(rank in found[peer] for rank in found for peer in found[rank]), size


@pytest.mark.parametrize("nprocs", [2, 3, 5])
def test_ring_and_halving_doubling_over_sockets_match_reference(nprocs):
    result = run_mpi("sockets_worker.py", nprocs, timeout=150)
    assert_ok(result, expect_lines=5)


def test_exchange_patterns_benchmark_runs_on_two_ranks():
    """scripts/bench/exchange_patterns.py (the ring's and halving-doubling's exchange sequences over
    the sockets) over loopback: every pattern timed every repeat."""
    script = str(ROOT / "scripts" / "bench" / "exchange_patterns.py")
    result = run_mpi(script, 2, "--mib", "1", "--repeats", "2", "--ifname", "lo", timeout=120)
    assert_ok(result)
    for pattern in ("ring", "halving-doubling", "halving-doubling, a barrier per step"):
        line = next(l for l in result.output.splitlines() if l.strip().startswith(pattern + ":"))
        assert len([float(s) for s in line.split(":")[1].replace(" s", "").split(",")]) == 2


class _Comm:
    """What ``MPIChannel`` asks of a communicator before any MPI call: its rank and size."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


def test_the_cycle_message_over_sockets_ands_the_bits_and_sums_the_arrays(pair):
    # The channel keeps its buffers while the layout stays and makes new ones when it changes
    # (the sums' sizes or types, the bit vector's length): every cycle's result must be
    # exact either way, with nothing left over from the cycle before.
    from mpiddp.engine.channel import MPIChannel

    channels = [MPIChannel(_Comm(rank, 2)) for rank in (0, 1)]
    for channel, sockets in zip(channels, pair):
        channel.use_sockets(sockets)
    rng = np.random.default_rng(7)
    layouts = [(24, [(5, np.float32), (3, np.float64)]), (24, [(5, np.float32), (3, np.float64)]),
               (24, [(7, np.int32)]), (40, []), (40, [(5, np.float32), (3, np.float64)])]
    for bits, shapes in layouts:
        messages = [rng.integers(0, 256, bits, dtype=np.uint8).tobytes() for _ in range(2)]
        sums = [[rng.integers(-50, 50, n).astype(dtype) for n, dtype in shapes]
                for _ in range(2)]
        want_bits = np.bitwise_and(*[np.frombuffer(m, np.uint8) for m in messages])
        want_sums = [a + b for a, b in zip(*sums)]
        results = [None, None]

        def run(rank):
            results[rank] = bytes(channels[rank].and_reduce(messages[rank], None, True,
                                                            sums[rank]))
        threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        for rank in (0, 1):
            assert results[rank] == want_bits.tobytes()
            for got, want in zip(sums[rank], want_sums):
                assert got.dtype == want.dtype and np.array_equal(got, want)
