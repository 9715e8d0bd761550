"""TCP connections to the exchange partners on other nodes: the collectives' steps without MPI.

Over TCP an MPI library moves a message only while it is called (``pacing.py``), and each
call costs user-space CPU on top of the kernel's copies: measured on the emulated cluster
(1 Gbit/s), the ring over MPICH/UCX spent 0.44-0.51 ms of user CPU per 1 MiB all-reduce at
2 nodes where the same ring over plain sockets spent 0.17-0.18, and at 16 nodes 20-25% more
CPU in all (docs/dev/benchmark-record.md "A TCP transport across nodes"). A socket moves bytes
inside the kernel whether or not anyone calls: the receiving thread blocks in ``recv`` (the GIL
released, no CPU while the wire works, woken when the chunk is in: ``MSG_WAITALL``), and the
caller (where the socket's buffer takes the whole chunk at once) or a sender thread hands
the outgoing chunk to the kernel. No polling, no pacing, nothing to tune.

``PeerSockets`` holds, for one communicator, one full-duplex connection to each partner the
caller names (the engine: the ring's neighbours and the halving-doubling partners) that sits
on another node (within a node MPI's shared memory is faster than any socket): a few per
rank, ``log2 N + 2``, not a mesh. It carries the exchanges with those partners; everything
else stays on MPI. A TCP stream is ordered, so messages are matched by position, as MPI
matches by (source, tag) in posting order: every rank makes the same sequence of calls (the
engine executes the same plan everywhere), so the k-th message a rank sends a partner is
the k-th that partner receives from it. Receives from one partner therefore complete in the
order they were started, whatever order they are waited for.

Connections are opened once per communicator when the engine starts (``connect``,
collective): every rank listens on an ephemeral port, the ranks exchange their addresses
over MPI, each connects to its partners of higher rank, trying each one's addresses in turn
(``MPIDDP_SOCKET_IFNAME`` limits them to named interfaces, as ``GLOO_SOCKET_IFNAME`` does
for gloo), proves who it is with the job's random token and its rank, and accepts its
partners of lower rank. A failure anywhere is agreed on by all ranks, so either every rank
uses the sockets or none does.

A peer that dies closes its sockets (the kernel does that for a killed process): the
waiting rank's ``recv`` ends and the exchange raises ``PeerConnectionLost`` naming the rank
and its host. A node that vanishes without closing anything leaves the ``recv`` waiting,
as an MPI call would; the lost-peer watchdog (``engine/liveness.py``) ends that job.
"""
from __future__ import annotations

import fcntl
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from typing import Iterable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..errors import MpiddpError, PeerLostError

log = logging.getLogger("mpiddp")

CONNECT_TIMEOUT_SECONDS = 5.0   # per address tried; a firewall that drops SYNs costs this
ACCEPT_TIMEOUT_SECONDS = 30.0   # a partner may try several addresses first
_SIOCGIFADDR = 0x8915           # Linux ioctl: an interface's IPv4 address
_HELLO = struct.Struct("!16si")  # the job's token, the connecting rank
# Every message starts with its length: a receive that expects another length (which only a
# bug in an algorithm could cause) is an error naming both, not a stream silently out of step.
_LENGTH = struct.Struct("!Q")
SPIN_SECONDS = 200e-6           # ``finish``: how long to poll before blocking
SHORT_WAITS_BEFORE_SPIN = 4


class PeerConnectionLost(PeerLostError):
    """A partner's connection broke during an exchange (it died, or its node)."""


def interface_addresses(names: Optional[Sequence[str]] = None) -> list[str]:
    """This host's IPv4 addresses (of the interfaces ``names``, in that order; else of all,
    loopback last: it serves a neighbour on the same host only)."""
    wanted = list(names) if names else [name for _, name in socket.if_nameindex()]
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for name in wanted:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue        # down, or no IPv4 address
            found.append(socket.inet_ntoa(packed[20:24]))
    finally:
        probe.close()
    return sorted(found, key=lambda address: address.startswith("127."))


def _connect(addresses: Sequence[str], port: int) -> socket.socket:
    """A connection to the first of ``addresses`` that answers on ``port``."""
    errors = []
    for address in addresses:
        try:
            sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_SECONDS)
        except OSError as error:
            errors.append(f"{address}:{port}: {error}")
            continue
        sock.settimeout(None)
        return sock
    raise ConnectionError("; ".join(errors) or "the partner has no IPv4 address")


def _prepare(sock: socket.socket) -> socket.socket:
    # Ring steps are request-sized writes: send each at once rather than wait for an ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def accept_peers(listener: socket.socket, token: bytes, peers: set[int],
                 timeout: float = ACCEPT_TIMEOUT_SECONDS) -> dict[int, socket.socket]:
    """The connections from ranks ``peers``, each proven by the job's ``token`` and its rank
    (strangers, and ranks not expected, are closed). Raises ``socket.timeout`` naming the
    ranks still missing after ``timeout`` seconds."""
    accepted: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    while len(accepted) < len(peers):
        listener.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            missing = sorted(peers - set(accepted))
            raise socket.timeout(f"ranks {missing} did not connect") from None
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            hello = sock.recv(_HELLO.size, socket.MSG_WAITALL)
        except OSError:
            hello = b""
        if len(hello) == _HELLO.size:
            their_token, rank = _HELLO.unpack(hello)
            if their_token == token and rank in peers and rank not in accepted:
                sock.settimeout(None)
                accepted[rank] = sock
                continue
        sock.close()
    return accepted


def _fill(sock: socket.socket, view: memoryview, got: int) -> None:
    """Receive into ``view`` from ``got`` bytes on until it is full (blocking, the GIL
    released); a connection closed before then raises ``ConnectionResetError``."""
    while got < len(view):
        more = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if more == 0:
            raise ConnectionResetError("the connection was closed")
        got += more


class _Sender(threading.Thread):
    """Writes queued chunks to their sockets in order, so the caller need not wait for the
    kernel to take them (the GIL is released while it writes)."""

    def __init__(self):
        super().__init__(name="mpiddp-socket-sender", daemon=True)
        self.chunks: "queue.SimpleQueue" = queue.SimpleQueue()
        self.errors: dict[int, BaseException] = {}      # peer -> what broke its connection

    def run(self) -> None:
        while True:
            item = self.chunks.get()
            if item is None:
                return
            peer, sock, views, done = item
            if peer not in self.errors:
                try:
                    for view in views:
                        sock.sendall(view)
                except OSError as error:
                    self.errors[peer] = error
            done.set()


class SocketTransfer:
    """One exchange started on ``PeerSockets``; ``wait`` completes it."""

    __slots__ = ("sockets", "source", "recv_view", "dest", "sent", "mpi_requests", "received")

    def __init__(self, sockets: "PeerSockets", dest: int, sent, source: int, recv_view,
                 mpi_requests: list):
        self.sockets = sockets
        self.dest, self.sent = dest, sent           # sent: None if the kernel took it all
        self.source, self.recv_view = source, recv_view   # recv_view: None, nothing to receive
        self.mpi_requests = mpi_requests            # the halves that stayed on MPI
        self.received = recv_view is None

    def wait(self) -> None:
        if self.mpi_requests:
            MPI.Request.Waitall(self.mpi_requests)
        while not self.received:
            self.sockets._receive_next(self.source)
        if self.sent is not None:
            self.sent.wait()
            self.sockets._check_sent(self.dest)


class PeerSockets:
    """Connections to a communicator's exchange partners on other nodes (``connect``)."""

    def __init__(self, comm, connections: dict[int, socket.socket], hosts: Sequence[str]):
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else "?"
        self.connections = connections
        self.hosts = list(hosts)
        self.sender = _Sender()
        self.sender.start()
        self._last_queued: Optional[threading.Event] = None
        # Per partner, the receives started and not yet done, in starting order.
        self._receives: dict[int, list] = {peer: [] for peer in connections}
        self._short_waits = SHORT_WAITS_BEFORE_SPIN    # ``finish``'s waits in a row

    @classmethod
    def connect(cls, comm, peers: Iterable[int], interfaces: Sequence[str] = (),
                required: bool = False) -> Optional["PeerSockets"]:
        """Open a connection to each of ``peers`` (collective on ``comm``; the relation must
        be symmetric: a rank that names ``p`` is named by ``p``). None where no rank names
        a peer, or where any rank failed (every rank then gets None; with ``required``
        every rank raises, naming the ranks that failed and why)."""
        rank = comm.Get_rank()
        peers = set(peers) - {rank}
        if not comm.allreduce(len(peers), op=MPI.MAX):
            return None
        token = comm.bcast(os.urandom(16) if rank == 0 else None, root=0)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        connections: dict[int, socket.socket] = {}
        problem = ""
        try:
            listener.bind(("0.0.0.0", 0))
            listener.listen(len(peers) + 8)
            mine = interface_addresses(interfaces)
            if not mine:
                problem = ("no IPv4 address on " + (", ".join(interfaces) if interfaces
                                                     else "any interface"))
            table = comm.allgather((mine, listener.getsockname()[1], MPI.Get_processor_name()))
            # Connect upwards first: a connection completes in the listener's backlog before
            # its owner accepts, so no rank waits on another's order.
            for peer in sorted(p for p in peers if p > rank):
                if problem:
                    break
                try:
                    sock = _prepare(_connect(table[peer][0], table[peer][1]))
                    sock.sendall(_HELLO.pack(token, rank))
                    connections[peer] = sock
                except OSError as error:
                    problem = f"cannot connect to rank {peer} on {table[peer][2]}: {error}"
            lower = {p for p in peers if p < rank}
            if not problem and lower:
                try:
                    for peer, sock in accept_peers(listener, token, lower).items():
                        connections[peer] = _prepare(sock)
                except OSError as error:
                    problem = (f"no connection within {ACCEPT_TIMEOUT_SECONDS:.0f} s from "
                               f"partners on other nodes ({error})")
        finally:
            listener.close()
        problems = comm.allgather(problem)
        failed = [(r, text) for r, text in enumerate(problems) if text]
        if failed:
            for sock in connections.values():
                sock.close()
            message = "; ".join(f"rank {r}: {text}" for r, text in failed)
            if required:
                raise MpiddpError(f"mpiddp: MPIDDP_SOCKET_TRANSPORT=1 but the TCP "
                                  f"connections across nodes failed ({message})")
            if rank == 0:
                log.warning("mpiddp: transfers across nodes stay on MPI: the TCP "
                            "connections across nodes failed (%s)", message)
            return None
        return cls(comm, connections, [row[2] for row in table])

    def describe(self, rank: int) -> str:
        return f"rank {rank} on {self.hosts[rank]}"

    def start_exchange(self, comm, sendbuf, send: memoryview, dest: int, sendtag: int,
                       recvbuf, recv: memoryview, source: int,
                       recvtag: int) -> Optional[SocketTransfer]:
        """Start an exchange (``comm.Sendrecv``'s arguments, with ``send`` and ``recv`` the
        buffers' bytes): each half with a connected partner goes over its socket, the other
        over ``comm`` (Isend / Irecv), both completed by the returned transfer's ``wait``.
        None where neither partner is connected (the caller keeps MPI for all). Both ends
        decide alike: a rank connected to ``p`` is connected from ``p``."""
        out, into = dest in self.connections, source in self.connections
        if not (out or into):
            return None
        requests = [] if into else [comm.Irecv(recvbuf, source, recvtag)]
        if not out:
            requests.append(comm.Isend(sendbuf, dest, sendtag))
        return self.start(dest, send if out else None, source, recv if into else None,
                          requests)

    def start(self, dest: int, send_view: Optional[memoryview], source: int,
              recv_view: Optional[memoryview], mpi_requests: list) -> SocketTransfer:
        """Start sending ``send_view`` to ``dest`` and receiving ``recv_view`` from
        ``source`` (either may be None: that half went over MPI, ``mpi_requests``; empty
        messages are not sent at all, on either side)."""
        sent = self._send(dest, send_view) if send_view is not None and len(send_view) \
            else None
        transfer = SocketTransfer(self, dest, sent, source,
                                  recv_view if recv_view is not None and len(recv_view)
                                  else None, mpi_requests)
        if not transfer.received:
            self._receives[source].append(transfer)
        return transfer

    def _send(self, peer: int, view: memoryview) -> Optional[threading.Event]:
        """Hand the length and ``view`` to the kernel now if its buffer takes them all and
        nothing is queued before them (no thread switch); the rest goes to the sender
        thread."""
        sock, length = self.connections[peer], _LENGTH.pack(len(view))
        written = 0
        if self._last_queued is None or self._last_queued.is_set():
            try:
                written = sock.sendmsg([length, view], [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                written = 0
            except OSError as error:
                raise self._lost(peer, error) from error
            if written == len(length) + len(view):
                return None
        rest = [length[written:], view] if written < len(length) \
            else [view[written - len(length):]]
        done = threading.Event()
        self.sender.chunks.put((peer, sock, rest, done))
        self._last_queued = done
        return done

    def exchange(self, dest: int, send, source: int, recv, spin: bool = True) -> None:
        """Send the array ``send`` to ``dest`` and receive ``recv`` from ``source``, both done
        when it returns (``finish``'s waiting; an empty array: nothing moves that way). The
        ``Exchange`` of ``collectives/recursive_doubling.py``."""
        self.finish(self.start(dest, memoryview(send).cast("B"), source,
                               memoryview(recv).cast("B"), []), spin)

    def finish(self, transfer: SocketTransfer, spin: bool = True) -> None:
        """``transfer.wait()``, after a spin of up to ``SPIN_SECONDS`` for the partner's bytes
        where the last ``SHORT_WAITS_BEFORE_SPIN`` waits all ended within it (and ``spin``:
        the caller expects its partners soon; an idle heartbeat does not). For latency-
        bound exchanges in a row (recursive doubling): a thread woken from its blocking
        receive comes tens of microseconds later than one that polls (2 emulated nodes, the
        cycle's bit vector: 80 us blocking at once, 32 us with the spin); but a spin that
        fails takes a core from the partners it waits for (16 ranks on 2 cores: 0.55 -> 0.73
        ms of CPU per 4 KiB all-reduce when each short wait allowed the next spin), hence
        the run of short waits before spinning again."""
        start = time.perf_counter()
        if spin and not transfer.received and self._short_waits >= SHORT_WAITS_BEFORE_SPIN:
            ready = (self.connections[transfer.source],)
            while time.perf_counter() - start < SPIN_SECONDS and \
                    not select.select(ready, (), (), 0)[0]:
                pass
        transfer.wait()                 # at once where the bytes are in
        if time.perf_counter() - start < SPIN_SECONDS:
            self._short_waits += 1
        else:
            self._short_waits = 0

    def _receive_next(self, peer: int) -> None:
        """Receive the oldest started message from ``peer`` (blocking, the GIL released):
        its length, checked, and its bytes (in one call where they have arrived)."""
        transfer = self._receives[peer].pop(0)
        view, sock = transfer.recv_view, self.connections[peer]
        length = bytearray(_LENGTH.size)
        try:
            # Without MSG_WAITALL: a shorter message than expected must not wait for the
            # next one's bytes before its length can be checked.
            got = sock.recvmsg_into([length, view])[0]
            if got == 0:
                raise ConnectionResetError("the connection was closed")
            _fill(sock, memoryview(length), min(got, len(length)))
            sent, = _LENGTH.unpack(length)
            if sent != len(view):
                raise MpiddpError(
                    f"mpiddp: {self.describe(peer)} sent a message of {sent} bytes where rank "
                    f"{self.rank} expected {len(view)}: the ranks' exchanges are out of "
                    "step (a bug in mpiddp; please report it with MPIDDP_LOG_LEVEL=DEBUG)")
            _fill(sock, view, max(0, got - len(length)))
        except OSError as error:
            raise self._lost(peer, error) from error
        transfer.received = True

    def _check_sent(self, peer: int) -> None:
        error = self.sender.errors.get(peer)
        if error is not None:
            raise self._lost(peer, error)

    def _lost(self, rank: int, error: BaseException) -> PeerConnectionLost:
        return PeerConnectionLost(f"mpiddp: lost the connection to {self.describe(rank)} "
                                  f"during a transfer ({error}); that rank or its node has "
                                  "probably failed")

    def probe_seconds(self, nbytes: int, repeats: int = 5) -> tuple[float, float]:
        """(sockets, MPI): the best of ``repeats`` exchanges of ``nbytes`` with the ring
        neighbours (sent right, received from the left) over each, alternating, so that
        both meet the same moments of a noisy machine (collective; a half with no
        connection goes over MPI in both)."""
        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        right, left = (rank + 1) % size, (rank - 1) % size
        send, recv = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for which, sockets in enumerate((True, False)):
                self.comm.Barrier()
                start = time.perf_counter()
                transfer = self.start_exchange(self.comm, send, memoryview(send), right, 78,
                                               recv, memoryview(recv), left, 78) \
                    if sockets else None
                if transfer is not None:
                    transfer.wait()
                else:
                    self.comm.Sendrecv(send, right, 78, recv, left, 78)
                best[which] = min(best[which], time.perf_counter() - start)
        return best[0], best[1]

    def close(self) -> None:
        """Stop the sender thread and close the connections."""
        self.sender.chunks.put(None)
        self.sender.join(timeout=5)
        for sock in self.connections.values():
            sock.close()
        self.connections = {}
