"""Every collective x dtype x op against a float64 NumPy reference, on the running engine.

Each rank's data is a pure function of (rank, tensor name), so every rank computes the
reference for all ranks locally. Prints one 'OK <check>' line per passed group on rank 0 and
exits non-zero (aborting the job) on the first failure.
"""
import functools
import os
import sys
import warnings

import numpy as np
import torch

import checks
import mpiddp
from mpiddp.collectives.cost_model import SPECULATION_MAX_BYTES
from mpiddp.launcher_env import launcher_local_rank
from mpiddp.runtime import current
from reference_data import as64, data

torch.set_num_threads(1)
if "REVERSE_LOCAL_RANKS" in os.environ:   # a launcher that numbers the node's ranks backwards
    world = [int(os.environ.get(f"PMI_{what}", os.environ.get(f"OMPI_COMM_WORLD_{what}", -1)))
             for what in ("SIZE", "RANK")]
    os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = str(world[0] - 1 - world[1])
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
SIZES = [0, 1, 2, 3, 7, 13, 97, 1000, 4099, 40_000]   # 40k floats > the 64 KiB test threshold
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64]
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 8e-2, torch.float32: 1e-5,
             torch.float64: 1e-12, torch.complex64: 1e-5, torch.complex128: 1e-12}
OPS = [mpiddp.Average, mpiddp.Sum, mpiddp.Min, mpiddp.Max, mpiddp.Product]


def reference(name, shape, dtype, op):
    stacked = np.stack([as64(data(r, name, shape, dtype, op)) for r in range(SIZE)])
    if op == mpiddp.Average:
        if not (dtype.is_floating_point or dtype.is_complex):  # Horovod's rule: truncated
            return np.trunc(stacked.sum(axis=0) * (1.0 / SIZE))
        return stacked.mean(axis=0)
    fn = {mpiddp.Sum: np.sum, mpiddp.Min: np.min, mpiddp.Max: np.max, mpiddp.Product: np.prod}
    return fn[op](stacked, axis=0)


def check_close(name, got, want, dtype):
    got = as64(got)
    tol = TOLERANCE.get(dtype, 0.0)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != reference {want.shape}")
    if not np.allclose(got, want, rtol=tol, atol=tol):
        worst = np.max(np.abs(got - want)) if got.size else 0
        raise AssertionError(f"{name}: differs from float64 reference (max |diff| {worst}, "
                             f"tolerance {tol})")


ok = functools.partial(checks.ok, rank=RANK)


def check_allreduce():
    """Every op x dtype x size, submitted asynchronously all at once (so they fuse)."""
    before = mpiddp.engine_stats()
    pending = []
    for dtype in DTYPES:
        for op in OPS:
            for n in SIZES:
                name = f"ar.{dtype}.{op.name}.{n}"
                tensor = data(RANK, name, (n,), dtype, op)
                pending.append((name, dtype, op, n,
                                mpiddp.allreduce_async(tensor, name=name, op=op)))
    for name, dtype, op, n, handle in pending:
        check_close(name, mpiddp.synchronize(handle), reference(name, (n,), dtype, op), dtype)
    after = mpiddp.engine_stats()
    ok("allreduce every op x dtype x size",
       **{key: after[key] - before[key] for key in ("ring_batches", "halving_doubling_batches",
                                                    "recursive_doubling_batches",
                                                    "native_batches",
                                                    "hierarchical_batches", "fused_batches")})
    for op in (mpiddp.Min, mpiddp.Max):
        name = f"ar.bool.{op.name}"
        got = mpiddp.allreduce(data(RANK, name, (33,), torch.bool), name=name, op=op)
        stacked = np.stack([data(r, name, (33,), torch.bool).numpy() for r in range(SIZE)])
        want = stacked.all(axis=0) if op == mpiddp.Min else stacked.any(axis=0)
        assert np.array_equal(got.numpy(), want), name
    ok("allreduce bool min/max")


def check_allreduce_variants():
    # In place, multi-dimensional, scalar, non-contiguous, scale factors, grouped.
    name = "inplace.2d"
    t = data(RANK, name, (17, 5), torch.float32)
    same = mpiddp.allreduce_(t, name=name, op=mpiddp.Sum)
    assert same is t
    check_close(name, t, reference(name, (17, 5), torch.float32, mpiddp.Sum), torch.float32)

    name = "scalar"
    got = mpiddp.allreduce(data(RANK, name, (), torch.float64), name=name)
    check_close(name, got, reference(name, (), torch.float64, mpiddp.Average), torch.float64)

    name = "noncontig"
    base = data(RANK, name, (6, 8), torch.float32)
    view = base.t()                     # non-contiguous
    got = mpiddp.allreduce(view, name=name + ".out", op=mpiddp.Sum)
    want = reference(name, (6, 8), torch.float32, mpiddp.Sum).T
    check_close(name, got, want, torch.float32)
    mpiddp.allreduce_(view, name=name + ".inplace", op=mpiddp.Sum)
    check_close(name + " in place", base.t(), want, torch.float32)

    name = "scaled"
    got = mpiddp.allreduce(data(RANK, name, (50,), torch.float32), name=name, op=mpiddp.Sum,
                           prescale_factor=0.5, postscale_factor=3.0)
    check_close(name, got, reference(name, (50,), torch.float32, mpiddp.Sum) * 1.5,
                torch.float32)

    names = [f"grouped.{i}" for i in range(5)]
    tensors = [data(RANK, n, (i * 11 + 1,), torch.float32) for i, n in enumerate(names)]
    outs = mpiddp.grouped_allreduce(tensors, name="grouped", op=mpiddp.Sum)
    for i, (n, out) in enumerate(zip(names, outs)):
        check_close(n, out, reference(n, (i * 11 + 1,), torch.float32, mpiddp.Sum),
                    torch.float32)
    outs = mpiddp.grouped_allreduce_(tensors, name="grouped_inplace", op=mpiddp.Sum)
    assert all(a is b for a, b in zip(outs, tensors))

    # The older average= keyword, and a tensor that needs grad.
    t = torch.ones(4, requires_grad=True)
    got = mpiddp.allreduce(t, average=False, name="average_kw")
    assert torch.equal(got, torch.full((4,), float(SIZE)))
    ok("allreduce variants (in place, scalar, non-contiguous, scaling, grouped)")


def check_speculated_allreduce():
    """Small all-reduces summed beside the negotiation (engine/speculation.py): the same names
    again and again (cached after the first use), every type MPI sums, Sum and Average, scale
    factors, in place, a scalar and a non-contiguous view; new data every time, against the
    reference every time. A buffer above the budget goes the usual way."""
    before = mpiddp.engine_stats()["speculated_tensors"]
    dtypes = [torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
              torch.int64]
    calls = 0
    for step in range(3):
        for dtype in dtypes:
            for op in (mpiddp.Sum, mpiddp.Average):
                for n in (1, 13, 97):
                    name = f"spec.{dtype}.{op.name}.{n}"
                    key = f"{name}#{step}"            # this step's data
                    got = mpiddp.allreduce(data(RANK, key, (n,), dtype, op), name=name, op=op)
                    check_close(key, got, reference(key, (n,), dtype, op), dtype)
                    calls += 1
        key = f"spec.scaled#{step}"
        got = mpiddp.allreduce(data(RANK, key, (5,), torch.float64), name="spec.scaled",
                               op=mpiddp.Sum, prescale_factor=0.5, postscale_factor=3.0)
        check_close(key, got, reference(key, (5,), torch.float64, mpiddp.Sum) * 1.5,
                    torch.float64)
        key = f"spec.inplace#{step}"
        t = data(RANK, key, (3, 4), torch.float32)
        assert mpiddp.allreduce_(t, name="spec.inplace") is t
        check_close(key, t, reference(key, (3, 4), torch.float32, mpiddp.Average),
                    torch.float32)
        key = f"spec.scalar#{step}"
        got = mpiddp.allreduce(data(RANK, key, (), torch.float64), name="spec.scalar")
        check_close(key, got, reference(key, (), torch.float64, mpiddp.Average), torch.float64)
        key = f"spec.view#{step}"
        view = data(RANK, key, (6, 8), torch.float32).t()
        got = mpiddp.allreduce(view, name="spec.view", op=mpiddp.Sum)
        check_close(key, got, reference(key, (6, 8), torch.float32, mpiddp.Sum).T,
                    torch.float32)
        calls += 4
    speculated = mpiddp.engine_stats()["speculated_tensors"] - before
    budget = current.require("check").engine.settings.speculation_bytes
    # Every call after a name's first: cached, and finished in the negotiation, where the
    # budget holds every name (over the engine's TCP connections, or MPIDDP_SPECULATION_BYTES
    # set); a smaller one holds the most recently cached; none, none.
    names_bytes = sum(n * torch.tensor([], dtype=dtype).element_size()
                      for dtype in dtypes for n in (1, 13, 97)) * 2 + 8 * (5 + 1) + 4 * (12 + 48)
    if budget >= names_bytes:
        assert speculated == calls * 2 // 3, (speculated, calls, budget)
    else:
        assert (speculated > 0) == (budget >= 8 * 97), (speculated, calls, budget)
    big = mpiddp.engine_stats()
    # Above any budget (the largest the links can give: a slow measured latency, as Open
    # MPI's over the emulated cluster, gives 64 KiB).
    count = SPECULATION_MAX_BYTES // 4 * 2
    for step in range(2):
        key = f"spec.big#{step}"
        got = mpiddp.allreduce(data(RANK, key, (count,), torch.float32), name="spec.big",
                               op=mpiddp.Sum)
        check_close(key, got, reference(key, (count,), torch.float32, mpiddp.Sum),
                    torch.float32)
    after = mpiddp.engine_stats()
    assert after["speculated_tensors"] == big["speculated_tensors"], after
    assert after["allreduce_batches"] == big["allreduce_batches"] + 2, after
    ok("small all-reduces finished in the negotiation (every summed type, Sum and Average, "
       "scaling, in place, scalar, non-contiguous)", speculated=speculated, budget=budget)


def check_allgather():
    for dtype in DTYPES + [torch.bool]:
        name = f"ag.{dtype}"
        rows = lambda r: (r * 3) % 5        # noqa: E731  (some ranks send zero rows)
        got = mpiddp.allgather(data(RANK, name, (rows(RANK), 3), dtype), name=name)
        want = np.concatenate([as64(data(r, name, (rows(r), 3), dtype)) for r in range(SIZE)])
        check_close(name, got, want, None)
    ok("allgather every dtype, uneven first dimension")


def check_broadcast():
    for dtype in DTYPES + [torch.bool]:
        for root in sorted({0, SIZE - 1, SIZE // 2}):
            name = f"bc.{dtype}.{root}"
            t = data(RANK, name, (31,), dtype)
            got = mpiddp.broadcast(t, root_rank=root, name=name)
            check_close(name, got, as64(data(root, name, (31,), dtype)), None)
            mpiddp.broadcast_(t, root_rank=root, name=name + "_")
            check_close(name + "_", t, as64(data(root, name, (31,), dtype)), None)
    ok("broadcast every dtype and several roots")


def check_reducescatter():
    for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32]:
        for rows in (0, 1, SIZE, 2 * SIZE + 1, 37):
            for op in (mpiddp.Sum, mpiddp.Average, mpiddp.Max):
                name = f"rs.{dtype}.{rows}.{op.name}"
                got = mpiddp.reducescatter(data(RANK, name, (rows, 2), dtype, op), name=name,
                                           op=op)
                full = reference(name, (rows, 2), dtype, op)
                base, extra = divmod(rows, SIZE)
                start = RANK * base + min(RANK, extra)
                mine = full[start:start + base + (1 if RANK < extra else 0)]
                check_close(name, got, mine, dtype)
    ok("reducescatter (uneven rows, several ops and dtypes)")


def check_alltoall():
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        name = f"a2a.{dtype}"
        splits = [(RANK + d) % 3 for d in range(SIZE)]
        t = data(RANK, name, (sum(splits), 2), dtype)
        out, received = mpiddp.alltoall(t, splits=splits, name=name)
        pieces = []
        for src in range(SIZE):
            src_splits = [(src + d) % 3 for d in range(SIZE)]
            src_data = as64(data(src, name, (sum(src_splits), 2), dtype))
            offset = sum(src_splits[:RANK])
            pieces.append(src_data[offset:offset + src_splits[RANK]])
        check_close(name, out, np.concatenate(pieces), None)
        assert received.tolist() == [(s + RANK) % 3 for s in range(SIZE)], received
    even = mpiddp.alltoall(torch.arange(SIZE * 2) + 100 * RANK, name="a2a.even")
    want = torch.tensor([100 * s + 2 * RANK + j for s in range(SIZE) for j in range(2)])
    assert torch.equal(even, want), (even, want)
    ok("alltoall with explicit and default splits")


def check_fusion_and_cache():
    mpiddp.reset_engine_stats()
    for step in range(3):
        handles = [mpiddp.allreduce_async(torch.full((100,), float(RANK + i)), name=f"fuse.{i}",
                                          op=mpiddp.Sum) for i in range(64)]
        for i, h in enumerate(handles):
            out = mpiddp.synchronize(h)
            want = sum(r + i for r in range(SIZE))
            assert torch.all(out == want), (i, out[:3], want)
    stats = mpiddp.engine_stats()
    assert stats["fused_batches"] >= 1 and stats["max_batch_tensors"] > 1, stats
    assert stats["allreduce_batches"] < 3 * 64, stats
    assert stats["cache_hits"] >= 64, stats      # steps 2 and 3 come from the response cache
    assert stats["cached_cycles"] >= 1, stats
    if RANK == 0:
        print(f"STATS {stats}", flush=True)
    ok("fusion and response cache (64 tensors in flight, 3 steps)")


def check_out_of_order():
    names = [f"order.{i}" for i in range(20)]
    mine = names if RANK % 2 == 0 else list(reversed(names))
    handles = {n: mpiddp.allreduce_async(torch.full((7,), float(RANK)), name=n, op=mpiddp.Sum)
               for n in mine}
    for n in names:
        assert torch.all(mpiddp.synchronize(handles[n]) == sum(range(SIZE)))
    # Reusing a cached name with a new shape renegotiates instead of hanging or corrupting.
    for shape in ((7,), (3, 2), (7,)):
        out = mpiddp.allreduce(torch.ones(shape), name="order.0", op=mpiddp.Sum)
        assert out.shape == shape and torch.all(out == SIZE)
    mpiddp.barrier()
    ok("ranks submitting in different orders; a cached name with a new shape")


def check_cache_grows():
    """More names a step than the response cache holds (1,500 against 1,024 places, the
    capacity not set): the cache doubles, on every rank alike, and from then on a step needs
    no negotiation through rank 0; every sum right. Seven steps: the growth is decided within
    about three (when a step's cycles happen to evict fewer names it can take one more),
    names evicted before it need one slow cycle each to come back, and the last is not judged
    (see below)."""
    engine = current.require("check").engine
    assert engine.protocol.cache.capacity == 1024
    names = 1500
    slow, hits = [], []
    for step in range(7):
        before = mpiddp.engine_stats()
        handles = [mpiddp.allreduce_async(torch.full((4,), float(RANK + i + step)),
                                          name=f"many.{i}", op=mpiddp.Sum)
                   for i in range(names)]
        for i, handle in enumerate(handles):
            want = sum(r + i + step for r in range(SIZE))
            assert torch.all(mpiddp.synchronize(handle) == want), i
        after = mpiddp.engine_stats()
        slow.append(after["slow_cycles"] - before["slow_cycles"])
        hits.append(after["cache_hits"] - before["cache_hits"])
    capacities = mpiddp.allgather_object(engine.protocol.cache.capacity, name="capacities")
    assert capacities == [2048] * SIZE, capacities
    # The last step is not judged: a rank that has finished it goes on to a new name
    # (allgather_object below, or shutdown), and the slow cycle that costs every rank lands
    # in the step's count on a rank that reads its stats later (the stray slow cycle seen in
    # the last step about 1 run in 3). After the growth every name of a step is found in the
    # cache (none evicted, none negotiated again) and steps run without rank 0.
    slow, hits = slow[:-1], hits[:-1]
    assert slow[0] > 0 and hits[0] < names, (slow, hits)
    assert slow[3:] == [0] * 3 and hits[3:] == [names] * 3, (slow, hits)
    ok("more names than the response cache holds: it grows", slow_cycles=slow, hits=hits)


def check_autograd():
    """Differentiable collectives: Horovod's gradients, and gradcheck where it applies (the
    ranks run it in lockstep, so every rank perturbs the same element at once)."""
    def grad_of(fn, x, upstream=None):
        x = x.detach().clone().requires_grad_()
        y = fn(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(torch.ones_like(y) if upstream is None else upstream)
        return x.grad

    x = torch.randn(5, 3, dtype=torch.float64)
    assert torch.all(grad_of(lambda t: mpiddp.allreduce(t, op=mpiddp.Sum), x) == SIZE)
    assert torch.allclose(grad_of(lambda t: mpiddp.allreduce(t), x), torch.ones_like(x))
    assert torch.allclose(grad_of(lambda t: mpiddp.allreduce(t, op=mpiddp.Sum,
                                                             prescale_factor=2.0), x),
                          torch.full_like(x, 2.0 * SIZE))
    for op in (mpiddp.Sum, mpiddp.Average):
        assert torch.autograd.gradcheck(lambda t: mpiddp.allreduce(t, op=op), (x.clone()
                                                                              .requires_grad_(),))
    pair = [x.clone().requires_grad_(), (2 * x).requires_grad_()]
    outs = mpiddp.grouped_allreduce(pair, op=mpiddp.Sum)
    (outs[0].sum() + 3 * outs[1].sum()).backward()
    assert torch.all(pair[0].grad == SIZE) and torch.all(pair[1].grad == 3 * SIZE)
    ok("autograd: allreduce (gradcheck for Sum and Average), grouped_allreduce")

    rows = torch.randn(RANK + 1, 3, dtype=torch.float64)      # uneven first dimensions
    assert torch.allclose(grad_of(lambda t: mpiddp.allgather(t), rows), torch.ones_like(rows))
    root = SIZE - 1
    want = torch.ones_like(x) if RANK == root else torch.zeros_like(x)
    assert torch.allclose(grad_of(lambda t: mpiddp.broadcast(t, root), x), want)
    even = torch.randn(2 * SIZE, 3, dtype=torch.float64)
    assert torch.allclose(grad_of(lambda t: mpiddp.alltoall(t), even), torch.ones_like(even))
    assert torch.allclose(grad_of(lambda t: mpiddp.reducescatter(t, op=mpiddp.Sum), even),
                          torch.full_like(even, float(SIZE)))
    assert torch.allclose(grad_of(lambda t: mpiddp.reducescatter(t, op=mpiddp.Average), even),
                          torch.ones_like(even))
    with torch.no_grad():                       # no graph: the plain path
        assert not mpiddp.allreduce(x.clone().requires_grad_()).requires_grad
    ok("autograd: allgather, broadcast, alltoall, reducescatter (Horovod's conventions)")


def check_process_sets():
    """Even and odd ranks as two process sets: every collective within a set, against the
    reference over the set's ranks only; roots are global ranks; the sets run at once."""
    if SIZE == 1:       # the only possible set is the global one: a duplicate
        try:
            mpiddp.add_process_set([0])
        except ValueError as exc:
            assert "duplicate process set" in str(exc)
            ok("process sets: a set equal to the global one is refused (one rank)")
            return
        raise AssertionError("adding the global set again was not refused")
    even = mpiddp.add_process_set([r for r in range(SIZE) if r % 2 == 0])
    odd = mpiddp.add_process_set([r for r in range(SIZE) if r % 2 == 1])
    mine = even if RANK % 2 == 0 else odd
    assert mine.included() and mine.rank() == mine.ranks.index(RANK)
    members = mine.ranks
    for dtype in (torch.float32, torch.int32):
        for op in (mpiddp.Sum, mpiddp.Average, mpiddp.Max):
            name = f"ps.ar.{dtype}.{op.name}"
            got = mpiddp.allreduce(data(RANK, name, (37,), dtype, op), name=name, op=op,
                                   process_set=mine)
            stacked = np.stack([as64(data(r, name, (37,), dtype, op)) for r in members])
            want = {mpiddp.Sum: stacked.sum(0), mpiddp.Max: stacked.max(0),
                    mpiddp.Average: stacked.mean(0) if dtype.is_floating_point
                    else np.trunc(stacked.sum(0) * (1.0 / len(members)))}[op]
            check_close(name, got, want, dtype)
    root = members[-1]
    got = mpiddp.broadcast(data(RANK, "ps.b", (5,), torch.float64), root, name="ps.b",
                           process_set=mine)
    check_close("ps.b", got, as64(data(root, "ps.b", (5,), torch.float64)), None)
    got = mpiddp.allgather(torch.full((RANK + 1, 2), float(RANK)), process_set=mine)
    assert got[:, 0].tolist() == [float(r) for r in members for _ in range(r + 1)], got
    shares = mpiddp.reducescatter(torch.ones(2 * len(members), 3), op=mpiddp.Sum,
                                  process_set=mine)
    assert shares.shape == (2, 3) and torch.all(shares == len(members))
    assert mpiddp.allgather_object(RANK, process_set=mine) == members
    assert mpiddp.broadcast_object("hi" if RANK == root else None, root,
                                   process_set=mine) == "hi"
    model = torch.nn.Linear(3, 1)
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=root, process_set=mine)
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      process_set=mine)
    model(torch.full((4, 3), float(RANK))).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = mpiddp.allgather(flat.reshape(1, -1), process_set=mine)
    assert all(torch.equal(row, gathered[0]) for row in gathered), "replicas differ in a set"
    refused = False
    try:
        mpiddp.allreduce(torch.ones(1), process_set=odd if mine is even else even)
    except ValueError as exc:
        refused = f"rank {RANK} is not in" in str(exc)
    assert refused, "a rank outside a set ran its collective"
    # A DistributedOptimizer on a set this rank is not in: a plain local optimizer here. The
    # set's unnamed barrier does not shift the names of the global one (per-set counters).
    local = torch.nn.Linear(3, 1)
    lopt = mpiddp.DistributedOptimizer(torch.optim.SGD(local.parameters(), lr=0.1),
                                       named_parameters=local.named_parameters(),
                                       process_set=even)
    local(torch.ones(2, 3)).sum().backward()
    lopt.step()
    if even.included():
        mpiddp.barrier(even)
    mpiddp.barrier()
    assert mpiddp.remove_process_set(even) and mpiddp.remove_process_set(odd)
    assert not mpiddp.remove_process_set(even) and not mpiddp.remove_process_set(
        mpiddp.global_process_set)
    ok("process sets: every collective, objects, parameters and DistributedOptimizer within "
       "even/odd sets; roots are global ranks; outside ranks refused; removal")


def check_grouped_and_sparse():
    gathered = mpiddp.grouped_allgather([torch.full((RANK + 1, 2), float(RANK)),
                                         torch.full((1,), float(RANK))])
    assert gathered[0].shape == (SIZE * (SIZE + 1) // 2, 2)
    assert gathered[1].tolist() == [float(r) for r in range(SIZE)]
    shares = mpiddp.grouped_reducescatter([torch.ones(2 * SIZE, 3), torch.ones(SIZE)],
                                          op=mpiddp.Sum)
    assert torch.all(shares[0] == SIZE) and shares[0].shape == (2, 3) and \
        shares[1].shape == (1,)
    dense = torch.zeros(10, 3, dtype=torch.float64)
    dense[RANK % 10] = RANK + 1.0
    dense[9] = 1.0                               # a row every rank touches
    for op in (mpiddp.Average, mpiddp.Sum):
        with warnings.catch_warnings():
            warnings.simplefilter("error")      # a warning on every job would be noise
            got = mpiddp.sparse_allreduce_async(dense.to_sparse(), name=f"sp.{op.name}",
                                                op=op)()
        assert got.is_sparse and torch.allclose(got.to_dense(), mpiddp.allreduce(dense, op=op))
    # DistributedOptimizer: sparse embedding gradients, reduced sparse (default) or dense.
    for as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = mpiddp.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                          named_parameters=emb.named_parameters(),
                                          sparse_as_dense=as_dense)
        emb(torch.tensor([RANK % 10, 9])).sum().backward()
        opt.step()
        flat = emb.weight.detach().reshape(1, -1)
        rows = mpiddp.allgather(flat)
        assert all(torch.equal(row, rows[0]) for row in rows), "embedding replicas differ"
    # sparse_as_dense gives the optimizer its sparse gradient back (SparseAdam needs it).
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = mpiddp.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                      sparse_as_dense=True)
    emb(torch.tensor([1, RANK % 10])).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse and len(opt._parameter_names) == 1
    # Autograd through the grouped forms (Horovod's conventions, as the single ones).
    xs = [torch.ones(RANK + 1, 2, dtype=torch.float64, requires_grad=True),
          torch.ones(1, dtype=torch.float64, requires_grad=True)]
    sum(out.sum() for out in mpiddp.grouped_allgather(xs)).backward()
    assert all(torch.allclose(x.grad, torch.ones_like(x)) for x in xs)
    ys = [torch.ones(2 * SIZE, 3, requires_grad=True)]
    mpiddp.grouped_reducescatter(ys, op=mpiddp.Sum)[0].sum().backward()
    assert torch.all(ys[0].grad == SIZE)
    ok("grouped_allgather, grouped_reducescatter, sparse_allreduce_async, sparse embedding "
       "gradients in DistributedOptimizer (sparse and as dense), grouped autograd")


def check_sync_batch_norm():
    """SyncBatchNorm on each rank's slice equals BatchNorm on the concatenated batch: outputs,
    running statistics, and the gradients (Horovod's test, on the CPU and uneven batches)."""
    for shape, reference in (((4,), torch.nn.BatchNorm1d), ((4, 3, 2), torch.nn.BatchNorm2d)):
        rows = [r + 2 for r in range(SIZE)]                 # uneven batches
        full = torch.cat([data(r, f"sbn.{len(shape)}", (rows[r],) + shape, torch.float64)
                          for r in range(SIZE)])
        start = sum(rows[:RANK])
        sync = mpiddp.SyncBatchNorm(4).double()
        plain = reference(4).double()
        x1 = full.clone().requires_grad_()
        x2 = full.clone().requires_grad_()
        out = sync(x1[start:start + rows[RANK]])
        ref = plain(x2)
        assert torch.allclose(out, ref[start:start + rows[RANK]], atol=1e-10)
        assert torch.allclose(sync.running_mean, plain.running_mean, atol=1e-12)
        assert torch.allclose(sync.running_var, plain.running_var, atol=1e-12)
        # Horovod's convention: the loss is the average over ranks of each rank's sum.
        out.sum().backward()
        ref.sum().div(SIZE).backward()
        assert torch.allclose(mpiddp.allreduce(sync.weight.grad), plain.weight.grad, atol=1e-9)
        assert torch.allclose(mpiddp.allreduce(sync.bias.grad), plain.bias.grad, atol=1e-9)
        # each rank holds the gradient of its own rows; averaged, they are the whole one
        assert torch.allclose(mpiddp.allreduce(x1.grad), x2.grad, atol=1e-9)
        sync.eval()
        plain.eval()
        assert torch.allclose(sync(full), plain(full), atol=1e-10)
    ok("SyncBatchNorm (1-D and 2-D, uneven batches) equals BatchNorm on the whole batch: "
       "outputs, running statistics, gradients")


def check_topology():
    # One node: every rank is local; the cross-node communicator has one member per node.
    # The local ranks follow the launcher's where it numbers them (Open MPI's need not be in
    # rank order; test_collectives also reverses them), else the ranks.
    launcher = launcher_local_rank()
    assert (mpiddp.local_rank(), mpiddp.local_size()) == \
        (launcher[0] if launcher else RANK, SIZE)
    assert (mpiddp.cross_rank(), mpiddp.cross_size()) == (0, 1)
    assert mpiddp.is_initialized() and mpiddp.mpi_threads_supported()
    ok("topology (local and cross ranks on one node)")


class Spectral(torch.nn.Module):
    """A Fourier layer (complex weights on the lowest modes, as a neural operator's), a
    complex linear map through ``W.mH`` (autograd hands its gradient over as a conjugate
    view) and a linear head."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(3, 3, 4, dtype=torch.complex64) * 0.3)
        self.mix = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64) * 0.3)
        self.head = torch.nn.Linear(3 * 16, 1)

    def forward(self, x):
        modes = torch.fft.rfft(x)[..., :4]
        mixed = torch.einsum("bim,iom->bom", modes, self.weights) @ self.mix.mH
        return self.head(torch.fft.irfft(mixed, n=x.shape[-1]).flatten(1))


def check_complex():
    """complex64 and complex128: Sum and Average (fused and alone, scale factors, in place,
    grouped, conjugate views), broadcast, allgather, alltoall, reducescatter against a
    complex128 NumPy reference; other ops refused; a model with complex weights trains as one
    process on the concatenated batch."""
    pending = []
    for dtype in (torch.complex64, torch.complex128):
        for n in (0, 1, 7, 1000, 20_000):    # 20k complex64: 160 KiB, over the threshold
            for op in (mpiddp.Sum, mpiddp.Average):
                name = f"cx.{dtype}.{n}.{op.name}"
                pending.append((name, dtype, n, op, mpiddp.allreduce_async(
                    data(RANK, name, (n,), dtype), name=name, op=op)))
    for name, dtype, n, op, handle in pending:
        check_close(name, mpiddp.synchronize(handle), reference(name, (n,), dtype, op), dtype)
    t = data(RANK, "cx.inplace", (33, 2), torch.complex64)
    mpiddp.allreduce_(t, op=mpiddp.Sum, name="cx.inplace", prescale_factor=0.5,
                      postscale_factor=3.0)
    check_close("cx.inplace", t,
                1.5 * reference("cx.inplace", (33, 2), torch.complex64, mpiddp.Sum),
                torch.complex64)
    grouped = mpiddp.grouped_allreduce(
        [data(RANK, f"cx.group.{i}", (5 + i,), torch.complex128) for i in range(3)],
        name="cx.group")
    for i, got in enumerate(grouped):
        check_close(f"cx.group.{i}", got, reference(
            f"cx.group.{i}", (5 + i,), torch.complex128, mpiddp.Average), torch.complex128)

    root = SIZE - 1
    got = mpiddp.broadcast(data(RANK, "cx.bc", (9,), torch.complex64), root, name="cx.bc")
    assert torch.equal(got, data(root, "cx.bc", (9,), torch.complex64))
    rows = lambda r: (r * 3) % 5        # noqa: E731  (some ranks send zero rows)
    got = mpiddp.allgather(data(RANK, "cx.ag", (rows(RANK), 2), torch.complex128),
                           name="cx.ag")
    assert torch.equal(got, torch.cat([data(r, "cx.ag", (rows(r), 2), torch.complex128)
                                       for r in range(SIZE)]))
    out = mpiddp.alltoall(data(RANK, "cx.a2a", (2 * SIZE,), torch.complex64),
                          name="cx.a2a")
    assert torch.equal(out, torch.cat([data(r, "cx.a2a", (2 * SIZE,), torch.complex64)
                                       [2 * RANK:2 * RANK + 2] for r in range(SIZE)]))
    for op in (mpiddp.Sum, mpiddp.Average):
        name = f"cx.rs.{op.name}"
        got = mpiddp.reducescatter(data(RANK, name, (2 * SIZE + 1, 3), torch.complex64),
                                   op=op, name=name)
        full = reference(name, (2 * SIZE + 1, 3), torch.complex64, op)
        start = RANK * 2 + min(RANK, 1)
        check_close(name, got, full[start:start + 2 + (RANK < 1)], torch.complex64)

    checks.expect(ValueError, lambda: mpiddp.allreduce(torch.ones(2, dtype=torch.complex64),
                                                       op=mpiddp.Max, name="cx.max"),
                  "cx.max", "complex tensors reduce with op=Sum or op=Average")
    # Conjugate views (lazy: the memory holds the values unconjugated) reduce as they read,
    # out of place and in place; autograd's gradients through .conj() too.
    base = data(RANK, "cx.conj", (6,), torch.complex64)
    want = reference("cx.conj", (6,), torch.complex64, mpiddp.Sum).conj()
    check_close("cx.conj", mpiddp.allreduce(base.conj(), op=mpiddp.Sum, name="cx.conj"),
                want, torch.complex64)
    view = base.clone().conj()
    mpiddp.allreduce_(view, op=mpiddp.Sum, name="cx.conj_")
    check_close("cx.conj_", view.resolve_conj(), want, torch.complex64)
    view = base.clone().conj()
    mpiddp.broadcast_(view, root_rank=0, name="cx.conj.bc")
    assert torch.equal(view, data(0, "cx.conj", (6,), torch.complex64).conj())
    x = base.clone().requires_grad_()
    weights = torch.tensor([1 - 2j, 0.5j, 3, -1, 1j, 2 + 2j], dtype=torch.complex64)
    (mpiddp.allreduce(x, op=mpiddp.Sum, name="cx.grad").conj() * weights).real.sum().backward()
    # d Re(sum(w * conj(y)))/dy = w (torch's convention), summed over the ranks' losses
    assert torch.allclose(x.grad, SIZE * weights), x.grad

    # Training: every rank trains on its part of a batch; one process on the whole batch is
    # the reference (each rank runs it locally: the data depend on the step only).
    torch.manual_seed(5)
    reference_model, model = Spectral(), Spectral()
    model.load_state_dict(reference_model.state_dict())
    # SGD with momentum: torch's Adam refuses conjugate-view gradients itself.
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=0.05, momentum=0.9)
    opt = mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters())
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * SIZE, 3, 16, generator=g), torch.randn(4 * SIZE, 1, generator=g)
        reference_opt.zero_grad()
        torch.nn.functional.mse_loss(reference_model(x), y).backward()
        reference_opt.step()
        mine = slice(4 * RANK, 4 * RANK + 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        conjugate_gradient = model.mix.grad.is_conj()
        opt.step()
    assert conjugate_gradient          # what the model is for: autograd's conjugate view
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        assert p.dtype == q.dtype and torch.allclose(p, q, rtol=1e-5, atol=1e-6), \
            (name, (p - q).abs().max())
    ok("complex64 and complex128: every collective, and training with complex weights",
       barrier=mpiddp.barrier)


CHECKS = [check_topology, check_allreduce, check_allreduce_variants,
          check_speculated_allreduce, check_allgather,
          check_broadcast,
          check_reducescatter, check_alltoall, check_fusion_and_cache, check_out_of_order,
          check_autograd, check_process_sets, check_grouped_and_sparse,
          check_sync_batch_norm, check_complex]
ON_REQUEST = [check_cache_grows]     # run only when named

if __name__ == "__main__":
    selected = sys.argv[1:] or [c.__name__ for c in CHECKS]
    for check in CHECKS + ON_REQUEST:
        if check.__name__ in selected:
            check()
    mpiddp.shutdown()
    if RANK == 0:
        print("DONE", flush=True)
