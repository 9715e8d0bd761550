"""PowerSGD gradient compression with error feedback (Vogels, Karimireddy and Jaggi, NeurIPS
2019): the ``GradientSync`` of ``DistributedOptimizer(compression=Compression.powersgd(...))``.

Per gradient matrix, each step (from ``start_step`` on; before it, plain averaging)::

    M = grad + error                  (error feedback; grad viewed as shape[0] x the rest)
    P = M Q                           (Q: last step's averaged Q, or drawn from the seed;
                                       orthogonalized first, as torch's hook does)
    P = allreduce_average(P); orthogonalize P (Gram-Schmidt; see orthogonalize_)
    Q = M^T P;  Q = allreduce_average(Q)
    grad = P Q^T;  error = M - P Q^T   (this rank's M, the averaged P and Q)

so every rank ends with the same gradient (it depends on the ranks' M through their average
only). The arithmetic is in float32 (float64 for float64 parameters), whatever the gradient's
dtype. Tensors that do not compress well (``PowerSGDCompressor.matrix_rank`` is 0: 1-D ones,
and those where ``(n + m) r * min_compression_rate >= n m``) take the standard path: fused,
in place, uncompressed.

Pipelining. The gradient hook computes P and queues it like a gradient of the standard path
(the bucket counts the gradient's own bytes, so ``bucket_cap_mb`` keeps its meaning); a flush
submits every queued P with the uncompressed gradients in one ``submit_together``. Later hooks
poll (never wait): every P that has landed is orthogonalized and its Q = M^T P computed, and
all those Q's are submitted together. At the end of backward the round waits for the P's still
out, one by one, submitting the Q's of those that have landed after each, and then waits for
the Q's. No rank ever waits for a request another rank could still be holding back: all P's
are submitted without waiting (the hooks and the start of the round never block), and a rank
waits for every P, submitting their Q's, before it waits for any Q (docs/dev/powersgd.md).

GradScaler: an inf or nan in any rank's gradient of a tensor makes its reduced P (and Q)
non-finite on every rank; its gradient is then non-finite everywhere (the scaler skips the
step) and its error and Q memories are left as they were. A parameter no rank had a
gradient for keeps ``grad=None`` and its memories as they were.

State: ``optimizer.state_dict()`` carries the step count and the Q memories (the same on every
rank); loading one restores them and resets the error buffers to zero, at any rank count (each
rank's error is its own, and only their average matters; see docs/powersgd.md).
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch

from ... import runtime
from ...errors import MpiddpError
from ...reduce_ops import ReduceOp
from ..ops.handles import synchronize as wait_for
from ..compression.powersgd_settings import PowerSGDCompressor
from ..ops.requests import allreduce_request_, submit_together
from .sync import GradientSync, Pending, Round

STATE_KEY = "mpiddp_powersgd"     # the optimizer state_dict's entry


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the factors, the error buffers and their arithmetic."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def orthogonalize_(matrix: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``matrix`` (k x r), in place, as torch's hook does: each
    column, its components along the columns before it removed one by one (modified
    Gram-Schmidt), divided by its norm (plus ``epsilon``).

    Unlike torch's: where removing the components left less than half of a column's length
    (it nearly depended on the earlier ones: a P of rank below r, as from a batch smaller than
    r), they are removed a second time ("twice is enough"). Once leaves such a column pointing
    mostly along the earlier ones after the division, which doubles that part of the
    approximation. Elsewhere the result is torch's. With ``epsilon`` 0 a column of zeros stays
    zeros (torch's would become nan).

    On the host, with ``epsilon`` 0, one Householder QR (``_orthonormalize_by_qr``) gives
    this result at a fraction of the column loops' cost."""
    columns = matrix.shape[1]
    if columns > 1 and not epsilon and matrix.device.type == "cpu":
        return _orthonormalize_by_qr(matrix)
    for i in range(columns):
        column = matrix[:, i:i + 1]
        if i:
            length = torch.linalg.vector_norm(column)
            once = _remove_earlier(matrix, i, column.clone())
            shrunk = torch.linalg.vector_norm(once) < 0.5 * length
            if matrix.device.type == "cpu":     # the test is free here: the second pass
                if bool(shrunk):                # only where it is needed
                    _remove_earlier(matrix, i, once)
                column.copy_(once)
            else:                               # (no wait on a device: both, then choose)
                twice = _remove_earlier(matrix, i, once.clone())
                column.copy_(torch.where(shrunk, twice, once))
        norm = torch.linalg.vector_norm(column)
        if epsilon:
            column.div_(norm + epsilon)
        else:
            column.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
    return matrix


def _orthonormalize_by_qr(matrix: torch.Tensor) -> torch.Tensor:
    """``orthogonalize_``'s result, in place, from the Q of a QR factorization: Gram-Schmidt's
    columns up to rounding where the projections left a column some length (|R_ii| is that
    length; its sign is Gram-Schmidt's), zero where they left none (a zero column), and where
    they left only rounding (a P of rank below r) an orthonormal direction as arbitrary as
    the one twice Gram-Schmidt makes of that rounding: either way P P^T M projects onto
    orthonormal directions and counts nothing twice. Non-finite entries give non-finite
    columns, as Gram-Schmidt's do."""
    q, r = torch.linalg.qr(matrix)
    kept = r.diagonal()
    return matrix.copy_(q * torch.sign(kept))


def _remove_earlier(matrix: torch.Tensor, i: int, vector: torch.Tensor) -> torch.Tensor:
    """``vector`` minus its components along columns 0..i-1 of ``matrix``, one by one."""
    for k in range(i):
        earlier = matrix[:, k:k + 1]
        vector.sub_(torch.sum(earlier * vector, dim=0, keepdim=True) * earlier)
    return vector


def transposed_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``(left @ right).t()``: a factor (k x r) held as the transpose of a contiguous r x k
    tensor. The reductions send that storage whole, its columns are contiguous for
    Gram-Schmidt, and CPU BLAS computes these thin products 4-9 times faster this way round
    than into a k x r tensor (docs/dev/powersgd.md); devices do not mind."""
    return torch.mm(left, right).t()


def initial_q(seed: int, key: str, step: int, m: int, r: int, dtype: torch.dtype,
              device) -> torch.Tensor:
    """A random m x r start for the power iteration: standard normal, drawn in float64 from a
    generator seeded by (``seed``, the parameter's name, the step), the same on every rank."""
    mixed = (seed * 0x9E3779B1 + zlib.crc32(key.encode()) * 1_000_003 + step) % (2 ** 63)
    generator = torch.Generator().manual_seed(mixed)
    return torch.randn(m, r, generator=generator, dtype=torch.float64).to(dtype=dtype,
                                                                          device=device)


class Memory:
    """What one parameter keeps from step to step: the averaged Q (warm start) and this
    rank's error (error feedback), both in the compute dtype."""

    __slots__ = ("q", "error")

    def __init__(self, q: Optional[torch.Tensor] = None):
        self.q = q
        self.error: Optional[torch.Tensor] = None


class Factors(Pending):
    """One compressed gradient in flight: its P, then its Q, reductions."""

    __slots__ = ("param", "key", "matrix", "in_grad", "p", "q", "p_handle", "q_handle",
                 "failure")

    def __init__(self, param: torch.Tensor, key: str, matrix: torch.Tensor, in_grad: bool,
                 p: torch.Tensor, local_zeros: bool):
        super().__init__(None, None, None, local_zeros)
        self.param = param
        self.key = key              # the parameter's name (memories, request names)
        self.matrix = matrix        # M (n x m, compute dtype); may be param.grad's storage
        self.in_grad = in_grad      # ... it is: the result is written into it
        self.p, self.q = p, None    # the factors (reduced in place)
        self.p_handle = self.q_handle = None
        self.failure: Optional[BaseException] = None   # P's reduction failed


class PowerSGDSync(GradientSync):
    """``GradientSync`` for ``Compression.powersgd`` (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings: PowerSGDCompressor = self.compression
        self.steps = 0                             # rounds started: the step index
        self.memories: dict[str, Memory] = {}      # parameter name -> its memories
        self.awaiting_q: list[Factors] = []        # P submitted, Q not yet

    @property
    def compression_settings(self) -> tuple:
        """What every rank must agree on (``_check_same_everywhere``)."""
        return self.settings.settings()

    def _key(self, param: torch.Tensor) -> str:
        return self.names[param][len(self.prefix) + len(".grad."):]

    # ---- the hooks: P out, Q out as P's land --------------------------------------------
    def on_gradient(self, param: torch.Tensor) -> None:
        super().on_gradient(param)
        if self.awaiting_q:
            with self.lock:
                self.advance()

    def _queue(self, param: torch.Tensor, zeros: bool = False) -> None:
        r = self.settings.matrix_rank(param.shape)
        if not r or self.steps < self.settings.start_step \
                or not param.dtype.is_floating_point:
            super()._queue(param, zeros)
            return
        grad = None if zeros else param.grad
        if grad is not None and grad.is_sparse:
            grad = grad.to_dense()
        n = param.shape[0]
        m = param.numel() // n
        dtype = compute_dtype(param.dtype)
        key = self._key(param)
        memory = self.memories.get(key)
        if memory is None:
            memory = self.memories[key] = Memory()
        with torch.no_grad():
            in_grad = grad is not None and grad is param.grad and grad.dtype == dtype \
                and grad.is_contiguous()
            if grad is None:
                matrix = None
            elif in_grad:       # M is built in the gradient's own storage
                matrix = grad.view(n, m)
            else:
                matrix = grad.reshape(n, m).to(dtype=dtype, copy=True)
            if self.settings.error_feedback:
                error = memory.error
                if error is None or error.shape != (n, m) or error.dtype != dtype \
                        or error.device != param.device:
                    error = memory.error = torch.zeros(n, m, dtype=dtype, device=param.device)
                if matrix is None:
                    matrix = error  # M = the error: updated in place, only where finite
                else:
                    matrix.add_(error)
            elif matrix is None:
                matrix = torch.zeros(n, m, dtype=dtype, device=param.device)
            q = self._start_q(memory, key, m, r, dtype, param.device)
            p = transposed_product(q.t(), matrix.t())
        self.pending[param] = Factors(param, key, matrix, in_grad, p, local_zeros=grad is None)
        self.bucket.append(param)
        self.bucket_bytes += param.numel() * param.element_size()

    def _start_q(self, memory: Memory, key: str, m: int, r: int, dtype, device):
        """This step's Q: the last averaged one (warm start) or a draw, orthogonalized."""
        q = memory.q if self.settings.warm_start else None
        if q is None or q.shape != (m, r) or q.dtype != dtype:
            q = initial_q(self.settings.seed, key, self.steps, m, r, dtype, device)
        else:
            q = q.to(device=device, copy=True)      # (loaded ones are on the CPU)
        return orthogonalize_(q, self.settings.orthogonalization_epsilon)

    def _flush(self, extra: tuple = ()) -> list:
        """The queued P's go out with the queued uncompressed gradients, in one submission."""
        factors = [param for param in self.bucket if isinstance(self.pending[param], Factors)]
        entries = []
        if factors:
            chosen = set(factors)
            self.bucket = [param for param in self.bucket if param not in chosen]
            entries = [self._factor_request(param, self.pending[param].p, "P")
                       for param in factors]
        handles = super()._flush(tuple(entries) + tuple(extra))
        for param, handle in zip(factors, handles):
            item = self.pending[param]
            item.p_handle = item.handle = handle
            self.awaiting_q.append(item)
        return handles[len(factors):]

    def _factor_request(self, param: torch.Tensor, factor: torch.Tensor, which: str):
        """The all-reduce of one factor (``which``: "P" or "Q"), with the parameter's priority
        under forward overlap (the next forward needs the first layers' first)."""
        return allreduce_request_(factor.t(),    # (the contiguous r x k storage)
                                  f"{self.prefix}.powersgd.{which}.{self._key(param)}",
                                  ReduceOp.AVERAGE, priority=self.priorities.get(param, 0),
                                  cycle_bytes=self.cycle_bytes)

    def advance(self) -> None:
        """Without waiting: orthogonalize the P's that have landed, compute their Q's and
        submit those together."""
        ready = [item for item in self.awaiting_q if item.p_handle.done()]
        if not ready:
            return
        done = {id(item) for item in ready}
        self.awaiting_q = [item for item in self.awaiting_q if id(item) not in done]
        entries, items = [], []
        with torch.no_grad():
            for item in ready:
                try:
                    wait_for(item.p_handle)         # done: raises its error, if any
                except BaseException as exc:
                    item.failure = exc              # on every rank: no Q for it anywhere
                    continue
                orthogonalize_(item.p, self.settings.orthogonalization_epsilon)
                item.q = transposed_product(item.p.t(), item.matrix)
                entries.append(self._factor_request(item.param, item.q, "Q"))
                items.append(item)
        if entries:
            for item, handle in zip(items, submit_together(entries, self.process_set)):
                item.q_handle = item.handle = handle

    def complete_factors(self) -> None:
        """End of the step: wait for the P's still out, in submission order, submitting the
        Q's of all that have landed after each (see the module docstring)."""
        while self.awaiting_q:
            try:
                wait_for(self.awaiting_q[0].p_handle)
            except BaseException:
                pass                                # advance() records it
            self.advance()

    # ---- the end of the step ------------------------------------------------------------
    def start_round(self) -> Optional[Round]:
        round_ = super().start_round()
        if round_ is not None:
            self.steps += 1
        return round_

    def _new_round(self, usage, usage_handle, position: dict) -> Round:
        return PowerRound(self, self.pending, usage, usage_handle, position)

    def _write_back(self, param: torch.Tensor, item: Pending, used, error):
        if not isinstance(item, Factors):
            return super()._write_back(param, item, used, error)
        if item.q_handle is None:
            return error or item.failure or MpiddpError(
                f"the PowerSGD factors of '{self.names[param]}' were never submitted for "
                "reduction because of an earlier error")
        try:
            wait_for(item.q_handle)
        except BaseException as exc:
            return error or exc
        if item.local_zeros and not used:
            return error        # no rank had a gradient: grad stays None, memories unchanged
        p, q = item.p, item.q
        approx = p @ q.t()
        memory = self.memories.get(item.key)     # (gone if a state was loaded meanwhile)
        if memory is not None and bool(torch.isfinite(p).all()) \
                and bool(torch.isfinite(q).all()):
            if self.settings.warm_start:
                memory.q = q
            if self.settings.error_feedback and memory.error is not None:
                torch.sub(item.matrix, approx, out=memory.error)
        if self.op == ReduceOp.SUM:
            approx.mul_(runtime.set_size(self.process_set))
        if item.in_grad:
            item.matrix.copy_(approx)
        elif item.local_zeros or param.grad.is_sparse:
            param.grad = approx.view(param.shape).to(param.dtype)
        else:
            param.grad.copy_(approx.view(param.shape))
        item.param = item.matrix = item.p = item.q = None
        return error

    # ---- state ----------------------------------------------------------------------------
    def state(self) -> dict:
        """The step count and the Q memories (the same on every rank), for state_dict()."""
        return {"steps": self.steps, "settings": dict(self.settings.settings()),
                "q": {key: memory.q.detach().to("cpu", copy=True,
                                                memory_format=torch.contiguous_format)
                      for key, memory in self.memories.items() if memory.q is not None}}

    def load_state(self, saved: dict) -> None:
        """Restore ``state()``'s output: step count and Q memories; errors start at zero."""
        self.steps = int(saved["steps"])
        self.memories = {key: Memory(q.detach().to("cpu", copy=True))
                         for key, q in saved.get("q", {}).items()}


class PowerRound(Round):
    """A round whose compressed gradients first complete their P -> Q chain.

    Under forward overlap the round is finished piece by piece, as the next forward first
    uses each parameter: ``ready`` advances the chains without waiting (Q's of landed P's go
    out), and ``finish`` of any part first waits for every P still out, submitting the Q's,
    before it waits for a Q. So a rank waits for a Q only once it has submitted all of its
    own, whatever order its forward uses the parameters in, and no rank waits for a Q another
    rank still holds back."""

    def ready(self, param) -> bool:
        item = self.items[param]
        if not isinstance(item, Factors):
            return super().ready(param)
        sync = self._sync()
        if sync.awaiting_q and item.q_handle is None:
            with sync.lock:
                sync.advance()
        if item.q_handle is None:
            return item.failure is not None or item.p_handle is None
        return item.q_handle.done() and (not item.local_zeros or self.usage_handle.done())

    def finish(self, params=None) -> None:
        sync = self._sync()
        if self.error is None:
            try:
                sync.complete_factors()
            except BaseException as exc:
                self.error = exc
        super().finish(params)


def _save_state(optimizer, state_dict: dict) -> dict:
    sync = optimizer.__dict__.get("_mpiddp")
    if isinstance(sync, PowerSGDSync):
        state_dict[STATE_KEY] = sync.state()
    return state_dict


def _load_state(optimizer, state_dict: dict) -> dict:
    sync = optimizer.__dict__.get("_mpiddp")
    if STATE_KEY not in state_dict:
        return state_dict       # e.g. broadcast_optimizer_state: the memories stay
    state_dict = dict(state_dict)
    saved = state_dict.pop(STATE_KEY)
    if isinstance(sync, PowerSGDSync):
        sync.load_state(saved)
    return state_dict


def attach_state(optimizer) -> None:
    """Make ``optimizer.state_dict()`` carry the PowerSGD memories and ``load_state_dict``
    restore them (torch's optimizer state-dict hooks)."""
    optimizer.register_state_dict_post_hook(_save_state)
    optimizer.register_load_state_dict_pre_hook(_load_state)


def check_powersgd(compression: PowerSGDCompressor, named: list, op: ReduceOp,
                   zero_stage: int) -> None:
    """Refuse what PowerSGD does not combine with, on every rank before any collective."""
    if op == ReduceOp.ADASUM:
        raise ValueError(
            "DistributedOptimizer(op=Adasum) cannot use Compression.powersgd: Adasum combines "
            "each rank's whole parameter deltas by their directions, and a low-rank average "
            "of gradients is not one. Use op=Average with PowerSGD, or Adasum without it")
    if zero_stage:
        raise ValueError(
            f"DistributedOptimizer(zero_stage={zero_stage}) cannot use Compression.powersgd: "
            "PowerSGD reduces low-rank factors of whole gradient matrices, which a "
            "reduce-scatter of flat shards cannot carry. Use zero_stage=0 with PowerSGD")
    for name, param in named:
        # (Integer and bool parameters never have a gradient.)
        if compression.matrix_rank(param.shape) and (param.is_complex() or (
                param.dtype.is_floating_point and param.dtype.itemsize < 2)):
            raise ValueError(
                f"Compression.powersgd cannot compress parameter '{name}' of dtype "
                f"{str(param.dtype).replace('torch.', '')}: PowerSGD orthogonalizes real "
                "floating-point factors (float16, bfloat16, float32, float64)")
