"""The engine's cycle protocol with 2-8 fake ranks in one process (threads), in milliseconds.

The real coordinator, protocol, waiting policy and handles run over an in-memory channel
(``protocol_fakes.py``); only MPI and the data movement are fake. Properties checked under
randomized schedules: every rank executes the same responses in the same order, no name is lost
or run twice, every handle ends (completed, or failed with the agreed error).
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from mpiddp.engine.protocol import CycleProtocol
from mpiddp.engine.request import ALLGATHER, ALLREDUCE, BROADCAST
from mpiddp.errors import (DuplicateNameError, EngineShutdownError, InvalidInputError,
                           MpiddpError, TensorMismatchError)
from protocol_fakes import TEST_SETTINGS, FakeCluster, entry


def run_ranks(cluster: FakeCluster, work, timeout: float = 60.0) -> list:
    """Run ``work(rank, engine)`` on one user thread per fake rank; return their results and
    re-raise the first failure (a thread still running at the timeout fails the test)."""
    results, errors = [None] * cluster.size, []

    def body(rank):
        try:
            results[rank] = work(rank, cluster.engines[rank])
        except BaseException as exc:       # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(cluster.size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [i for i, t in enumerate(threads) if t.is_alive()]
    if errors:
        raise errors[0]
    assert not alive, f"fake ranks {alive} hung (cluster aborted: {cluster.hub.aborted.is_set()})"
    return results


def assert_same_order(cluster: FakeCluster) -> list:
    logs = cluster.logs()
    for rank, log in enumerate(logs):
        assert log == logs[0], f"rank {rank} executed another order than rank 0"
    return logs[0]


def run_cluster(size: int, work, **overrides) -> tuple:
    """``work`` on every rank of a fresh fake cluster, which is shut down afterwards; returns
    the ranks' results and the order every rank executed (checked to be the same)."""
    cluster = FakeCluster(size, **overrides)
    try:
        results = run_ranks(cluster, work)
        order = assert_same_order(cluster)
    finally:
        cluster.shutdown()
    return results, order


def random_schedule(seed: int, size: int, rounds: int, names_per_round: int,
                    new_name_rate: float = 0.3, change_rate: float = 0.05,
                    mismatch_rate: float = 0.05, max_delay: float = 0.0):
    """Per rank, per round: a list of groups (submitted together) of
    (name, shape, kind, expect_error) in that rank's own random order."""
    rng = random.Random(seed)
    known = [f"t{i}" for i in range(names_per_round)]
    shapes = {name: (4,) for name in known}
    fresh = 0
    plan = [[] for _ in range(size)]
    for round_ in range(rounds):
        names = []
        for _ in range(names_per_round):
            if rng.random() < new_name_rate:
                fresh += 1
                name = f"n{fresh}"
                known.append(name)
                shapes[name] = (rng.randint(1, 9),)
            names.append(rng.choice(known))
        names = list(dict.fromkeys(names))          # one in-flight use of a name per round
        items = {}
        for name in names:
            if rng.random() < change_rate:           # every rank changes it: renegotiated
                shapes[name] = (shapes[name][0] + 1,)
            kind = BROADCAST if rng.random() < 0.1 else ALLREDUCE
            mismatch_rank = rng.randrange(size) if rng.random() < mismatch_rate else None
            items[name] = (shapes[name], kind, mismatch_rank)
        for rank in range(size):
            order = list(items)
            rng.shuffle(order)
            groups, i = [], 0
            while i < len(order):
                n = rng.randint(1, 4)
                groups.append([(name, items[name][0] if items[name][2] != rank
                                else (items[name][0][0] + 7,), items[name][1],
                                items[name][2] is not None) for name in order[i:i + n]])
                i += n
            delays = [rng.random() * max_delay for _ in groups]
            plan[rank].append(list(zip(groups, delays)))
    return plan


def play(cluster: FakeCluster, plan, prioritized: bool = False, data: bool = False) -> dict:
    """Every rank submits its schedule round by round and waits for its handles; returns the
    number of completed and failed handles per rank. ``prioritized``: all-reduces carry a
    priority derived from their name (the same on every rank), 0 for every fifth. ``data``:
    entries carry inputs (rank + 1) and NaN outputs, and a finished output is either
    untouched (the recording executor moves no data) or the sum over the ranks (summed
    beside the negotiation: engine/speculation.py)."""
    total = cluster.size * (cluster.size + 1) / 2

    def work(rank, engine):
        done = failed = 0
        for round_ in plan[rank]:
            handles = []
            for group, delay in round_:
                if delay:
                    time.sleep(delay)
                entries = [entry(name, kind, shape, root=0 if kind == BROADCAST else -1,
                                 priority=(int(name[1:]) % 5 if prioritized else 0),
                                 input=np.full(shape, rank + 1.0, np.float32) if data else None,
                                 output=np.full(shape, np.nan, np.float32) if data else None)
                           for name, shape, kind, _ in group]
                handles += [(h, err, e.output) for h, (_, _, _, err), e
                            in zip(engine.submit_many(entries), group, entries)]
            for handle, expect_error, output in handles:
                try:
                    handle.wait(timeout=30)
                    assert not expect_error, f"{handle.name}: mismatch not reported"
                    done += 1
                except TensorMismatchError:
                    assert expect_error, f"{handle.name}: unexpected mismatch"
                    failed += 1
                if data:
                    assert np.isnan(output).all() or (output == total).all(), \
                        f"{handle.name} on rank {rank}: {output}"
        return done, failed
    return run_ranks(cluster, work)


def run_schedule(size: int, seed: int, rounds: int, settings: dict, base=TEST_SETTINGS,
                 inspect=None, names_per_round: int = 6, **options):
    """A random schedule on a fresh fake cluster of ``size`` ranks with ``settings`` (set
    explicitly, over ``base``), played with ``options``: every rank executed the same order,
    and every name exactly once. ``inspect(cluster)`` afterwards, if given. Returns (per rank
    (done, failed), the order, how many names)."""
    cluster = FakeCluster(size, base, **settings)
    try:
        plan = random_schedule(seed=seed, size=size, rounds=rounds,
                               names_per_round=names_per_round, max_delay=0.002)
        counts = play(cluster, plan, **options)
        order = assert_same_order(cluster)
        if inspect is not None:
            inspect(cluster)
    finally:
        cluster.shutdown()
    expected = sum(len(group) for round_ in plan[0] for group, _ in round_)
    assert len(order) == expected, "a name was lost or run twice"
    assert all(done + failed == expected for done, failed in counts)
    return counts, order, expected


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_random_schedules_execute_identically_everywhere(size):
    # A tiny cache: constant eviction.
    counts, _, _ = run_schedule(size, seed=size, rounds=40, settings={"cache_capacity": 4})
    assert counts[0][1] > 0, "the schedule should contain mismatches"


@pytest.mark.parametrize("size", [2, 3, 5])
def test_random_schedules_with_a_growing_cache_execute_identically_everywhere(size):
    """Random schedules (new names, changed shapes, mismatches, small sums beside the
    negotiation) with the cache's capacity not set, from 16 places: it grows past a 64-slot
    word of the cycle message (the fake channel checks every cycle's message is as long on
    every rank), the same on every rank; nothing is lost or run twice."""
    capacities = []
    run_schedule(size, seed=40 + size, rounds=40, settings={"speculation_bytes": 64},
                 base=replace(TEST_SETTINGS, cache_capacity=16, explicit=frozenset()),
                 inspect=lambda cluster: capacities.extend(
                     engine.protocol.cache.capacity for engine in cluster.engines),
                 names_per_round=40, data=True)
    assert len(set(capacities)) == 1 and capacities[0] > 64, capacities


@pytest.mark.parametrize("size", [2, 3, 5])
def test_small_allreduces_summed_beside_the_negotiation(size):
    """Random schedules (constant eviction, changed shapes, mismatches on one rank) with a
    speculation budget of 16 floats: the small cached all-reduces ready everywhere finish in
    the negotiation with the right sum, on every rank alike; a mismatched or changed name
    never does (it fails or renegotiates); nothing is lost or run twice."""
    counts, order, expected = run_schedule(
        size, seed=20 + size, rounds=40,
        settings={"cache_capacity": 6, "speculation_bytes": 64}, data=True)
    assert counts[0][1] > 0, "the schedule should contain mismatches"
    assert 0 < sum(1 for _, mark in order if mark == "speculated") < expected


def test_speculated_sums_take_zeros_from_a_joined_rank():
    """Rank 2 joins at once; the others' small all-reduces finish beside the negotiation
    with rank 2 contributing zeros (the sum's identity), as the executor's joined ranks do."""
    def work(rank, engine):
        outputs = []
        if rank != 2:
            for i in range(6):
                out = np.full(3, np.nan, np.float32)
                engine.submit_many([entry(f"s{i % 2}", shape=(3,), output=out,
                                          input=np.full(3, rank + 1.0, np.float32))])[0] \
                    .wait(timeout=10)
                outputs.append(out)
        engine.join().wait(timeout=20)
        return outputs
    results, order = run_cluster(3, work, speculation_bytes=64)
    finished = [out for out in results[0] + results[1] if not np.isnan(out).any()]
    assert finished and all((out == 3.0).all() for out in finished), results
    assert any(mark == "speculated" for _, mark in order), order


@pytest.mark.parametrize("size", [2, 3])
def test_prioritized_schedules_with_a_tiny_cycle_budget_lose_nothing(size):
    """Prioritized all-reduces cut by a budget of one tensor per cycle, under constant cache
    eviction: the cut ones wait and are evicted and renegotiated, yet every name runs once,
    in the same order on every rank."""
    run_schedule(size, seed=10 + size, rounds=30,
                 settings={"cache_capacity": 4, "priority_cycle_bytes": 1}, prioritized=True)


def _rounds_of(names: list, rounds: int):
    """``work`` for ``run_ranks``: every round, all ``names`` submitted together and waited
    for; returns the slow cycles of each round."""
    def work(rank, engine):
        slow = []
        for _ in range(rounds):
            before = engine.stats.slow_cycles
            for handle in engine.submit_many([entry(name) for name in names]):
                handle.wait(timeout=20)
            slow.append(engine.stats.slow_cycles - before)
        return slow
    return work


def test_the_response_cache_grows_while_evicted_names_keep_coming_back():
    """100 names a round against 48 places, the capacity not set: rank 0 sees names come back
    after being evicted for room and the cache doubles (48 -> 96 -> 192) in plans every rank
    applies in the same cycle, its message growing past a 64-slot word alike everywhere; then
    a round needs no slow cycle. The same order everywhere."""
    cluster = FakeCluster(3, replace(TEST_SETTINGS, cache_capacity=48, explicit=frozenset()))
    before = cluster.engines[0].protocol.message_bytes
    try:
        slow = run_ranks(cluster, _rounds_of([f"g{i}" for i in range(100)], rounds=6))
        assert_same_order(cluster)
        protocols = [engine.protocol for engine in cluster.engines]
        assert [p.cache.capacity for p in protocols] == [192] * 3
        assert len({p.message_bytes for p in protocols}) == 1
        assert protocols[0].message_bytes > before
        assert all(len(p.cache) == 100 for p in protocols)
    finally:
        cluster.shutdown()
    assert slow[0][0] > 0 and all(s[-1] == 0 for s in slow), slow


def test_names_coming_back_rarely_do_not_grow_the_response_cache():
    """Names used once (as ``name=f"loss{step}"``) push the rest out; a name used every 20
    steps comes back each time, evicted, but is a small share of what the cache takes in: it
    keeps its 16 places (a slow cycle now and then costs less than a larger message every
    cycle)."""
    def work(rank, engine):
        for step in range(120):
            names = [f"loss{step}"] + (["eval"] if step % 20 == 0 else [])
            for handle in engine.submit_many([entry(name) for name in names]):
                handle.wait(timeout=20)
    cluster = FakeCluster(2, replace(TEST_SETTINGS, cache_capacity=16, explicit=frozenset()))
    returns = []
    watch = cluster.engines[0].protocol._capacity_watch
    real_admit = watch.admit

    def admit(name):                # count the returns: the test must see some
        returned = watch.returned
        real_admit(name)
        returns.append(watch.returned - returned)
    watch.admit = admit
    try:
        run_ranks(cluster, work)
        assert [engine.protocol.cache.capacity for engine in cluster.engines] == [16, 16]
        assert sum(returns) >= 4, "the eval name should have been evicted and come back"
    finally:
        cluster.shutdown()


def test_names_used_once_do_not_grow_the_response_cache():
    """A fresh name every time (as ``name=f"loss{step}"``) evicts, but nothing evicted comes
    back: the cache keeps its size."""
    def work(rank, engine):
        for step in range(60):
            engine.submit_many([entry(f"loss{step}")])[0].wait(timeout=20)
    cluster = FakeCluster(2, replace(TEST_SETTINGS, explicit=frozenset()))
    try:
        run_ranks(cluster, work)
        assert [engine.protocol.cache.capacity for engine in cluster.engines] == [8, 8]
    finally:
        cluster.shutdown()


def test_a_set_cache_capacity_stays_and_rank_0_says_why_once(caplog):
    """``MPIDDP_CACHE_CAPACITY`` set: the cache keeps its size however many evicted names
    come back, and rank 0 warns once, naming the setting."""
    cluster = FakeCluster(2)         # TEST_SETTINGS: 8 places, set explicitly
    try:
        with caplog.at_level("WARNING", logger="mpiddp"):
            run_ranks(cluster, _rounds_of([f"g{i}" for i in range(20)], rounds=4))
        assert [engine.protocol.cache.capacity for engine in cluster.engines] == [8, 8]
    finally:
        cluster.shutdown()
    warnings = [r.getMessage() for r in caplog.records if "evicted from it for room" in
                r.getMessage()]
    assert len(warnings) == 1 and "Raise MPIDDP_CACHE_CAPACITY" in warnings[0], warnings


def test_soak_ten_thousand_cycles(soak_cycles):
    """A long seeded run: many rounds of random schedules until rank 0 has run at least
    ``soak_cycles`` cycles (10,000 by default; ``pytest --soak-cycles N`` for more)."""
    cluster = FakeCluster(4, cache_capacity=16)
    seed = 0
    executed = 0
    try:
        while cluster.engines[0].stats.cycles < soak_cycles:
            seed += 1
            plan = random_schedule(seed=seed, size=4, rounds=50, names_per_round=8)
            play(cluster, plan)
            executed += sum(len(group) for round_ in plan[0] for group, _ in round_)
        order = assert_same_order(cluster)
        cycles = cluster.engines[0].stats.cycles
    finally:
        cluster.shutdown()
    assert len(order) == executed
    assert cycles >= soak_cycles


def test_ranks_submitting_in_opposite_orders_agree():
    names = [f"g{i}" for i in range(30)]

    def work(rank, engine):
        order = names if rank % 2 == 0 else names[::-1]
        handles = [engine.submit_many([entry(n)])[0] for n in order]
        for h in handles:
            h.wait(timeout=10)
    _, order = run_cluster(3, work)
    assert sorted(name for name, _ in order) == sorted(names)


def test_mismatch_fails_that_name_on_every_rank_and_the_engine_goes_on():
    def work(rank, engine):
        bad = engine.submit_many([entry("w", shape=(4, 3) if rank < 2 else (3, 4))])[0]
        good = engine.submit_many([entry("ok")])[0]
        with pytest.raises(TensorMismatchError) as info:
            bad.wait(timeout=10)
        good.wait(timeout=10)
        return str(info.value)
    messages, _ = run_cluster(3, work)
    assert all("Mismatched allreduce shapes for 'w': ranks 0, 1 sent [4, 3], rank 2 sent [3, 4]"
               in m for m in messages)


def test_duplicate_in_flight_name_is_refused_locally():
    cluster = FakeCluster(2)
    try:
        engine = cluster.engines[0]
        handle = engine.submit_many([entry("dup")])[0]
        with pytest.raises(DuplicateNameError, match="already in flight on rank 0"):
            engine.submit_many([entry("dup")])
        with pytest.raises(DuplicateNameError, match="appears twice"):
            cluster.engines[1].submit_many([entry("x"), entry("x")])
        cluster.engines[1].submit_many([entry("dup")])[0].wait(timeout=10)
        handle.wait(timeout=10)
    finally:
        cluster.shutdown()


def test_join_with_uneven_work():
    """Rank r has 5 + 3r allreduces; ranks out of work join and answer the others; join
    returns the last rank to join on every rank; non-allreduce while joined is an error."""
    def work(rank, engine):
        for i in range(5 + 3 * rank):
            engine.submit_many([entry(f"step{i}")])[0].wait(timeout=10)
        if rank == 3:
            with pytest.raises(Exception, match="have called join"):
                engine.submit_many([entry("gather", kind=ALLGATHER)])[0].wait(timeout=10)
        return engine.join().wait(timeout=20)
    last, order = run_cluster(4, work)
    assert last == [3, 3, 3, 3]
    assert [name for name, _ in order if name.startswith("step")] == \
        [f"step{i}" for i in range(14)]


def test_stall_is_reported_and_shuts_every_rank_down():
    def work(rank, engine):
        if rank == 2:
            time.sleep(1.0)         # never submits 'lonely'
            return None
        handle = engine.submit_many([entry("lonely")])[0]
        with pytest.raises(EngineShutdownError) as info:
            handle.wait(timeout=10)
        return str(info.value)
    messages, _ = run_cluster(3, work, stall_check_time=0.05, stall_shutdown_time=0.3)
    for text in messages[:2]:
        assert "stalled for more than 0.3 s" in text
        assert "rank 2 has not submitted: 'lonely'" in text


def test_a_call_every_rank_must_make_made_on_one_rank_fails_everywhere_naming_it():
    # Rank 0 alone makes the call (under `if rank == 0:`); the others go on to the next
    # step's collective. Once the call has waited its deadline every rank stops, each
    # handle failing with one error naming the call, who made it and who did not.
    def work(rank, engine):
        handle = engine.barrier("lib.save", deadline=0.2) if rank == 0 else \
            engine.submit_many([entry("grad.0")])[0]
        with pytest.raises(EngineShutdownError) as info:
            handle.wait(timeout=30)
        return str(info.value)
    results, _ = run_cluster(3, work)
    for text in results:
        assert ("'lib.save' was called on rank 0 but not on ranks 1, 2, which went on to "
                "other collectives ('grad.0'); it is a collective call") in text, text


def test_a_call_every_rank_must_make_waits_for_a_rank_not_in_a_collective():
    # A rank that is busy elsewhere (evaluating on its own, say) and has nothing in flight
    # is not past the call: the stall rules apply, and the call completes when it comes.
    def work(rank, engine):
        if rank == 1:
            time.sleep(0.6)
        engine.barrier("lib.save", deadline=0.1).wait(timeout=10)
        return "done"
    results, _ = run_cluster(2, work)
    assert results == ["done", "done"]


def test_a_shutdown_names_what_it_left_waiting():
    cluster = FakeCluster(2)
    handle = cluster.engines[0].barrier("lib.save", deadline=30.0)
    deadline = time.monotonic() + 10
    while "lib.save" not in cluster.engines[0].protocol.pending:    # taken up by a cycle
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cluster.engines[1].shutdown("shutdown() was called")
    with pytest.raises(EngineShutdownError) as info:
        handle.wait(timeout=10)
    assert ("rank 1: shutdown() was called; in flight on some ranks only: 'lib.save' "
            "submitted on rank 0 but not on rank 1") in str(info.value), info.value
    cluster.shutdown()


@pytest.mark.parametrize("who", [0, 2])
def test_shutdown_from_any_rank_fails_pending_handles_everywhere(who):
    cluster = FakeCluster(3)
    handles = [cluster.engines[r].submit_many([entry(f"only.{r}")])[0] for r in range(3)]
    cluster.engines[who].shutdown(f"rank {who} is done")
    for rank, handle in enumerate(handles):
        with pytest.raises(EngineShutdownError, match=f"rank {who} is done"):
            handle.wait(timeout=10)
        assert not cluster.engines[rank].running
    with pytest.raises(EngineShutdownError):
        cluster.engines[1].submit_many([entry("late")])
    cluster.shutdown()


def cycle_by_hand(ranks: list) -> tuple:
    """One cycle of protocol objects driven by hand, no threads: (every rank's result, the
    reduced bits)."""
    messages = [p.encode(shutdown_requested=False) for p in ranks]
    reduced = -1                    # every bit set: the identity of AND
    for message in messages:
        reduced &= int.from_bytes(message, "little")
    bits = [p.decode(reduced.to_bytes(len(messages[0]), "little")) for p in ranks]
    plan = None
    if bits[0].slow:
        plan = ranks[0].make_plan([p.slow_message(b, None) for p, b in zip(ranks, bits)])
    return [p.conclude(b, plan) for p, b in zip(ranks, bits)], bits[0]


def test_protocol_alone_encodes_and_agrees_without_threads():
    """Two protocol objects driven by hand: first use goes through rank 0's plan, the second
    is a cache hit (ready bit, no slow path)."""
    ranks = [CycleProtocol(r, 2, TEST_SETTINGS) for r in range(2)]

    def cycle():
        return cycle_by_hand(ranks)

    for p in ranks:
        p.add([entry("a"), entry("b")])
    results, bits = cycle()
    assert bits.slow and [r.name for r in results[0].ready] == ["a", "b"]
    assert [r.name for r in results[1].ready] == ["a", "b"]
    for p in ranks:
        p.add([entry("b"), entry("a")])
    results, bits = cycle()
    assert not bits.slow and {r.name for r in results[0].ready} == {"a", "b"}
    assert [r.name for r in results[0].ready] == [r.name for r in results[1].ready]


def ready_names(ranks) -> list:
    """One cycle by hand: the names every rank runs (the same on each)."""
    results, _ = cycle_by_hand(ranks)
    assert [r.name for r in results[0].ready] == [r.name for r in results[1].ready]
    return [r.name for r in results[0].ready]


def test_urgent_allreduces_overtake_less_urgent_ones_within_the_cycle_budget():
    """Three prioritized 1 KiB all-reduces and a budget of 1 KiB: one runs per cycle, most
    urgent first; one submitted later with a higher urgency overtakes those still waiting.
    Unprioritized names are never held back."""
    settings = replace(TEST_SETTINGS, priority_cycle_bytes=1024)
    ranks = [CycleProtocol(r, 2, settings) for r in range(2)]

    for p in ranks:
        p.add([entry(f"layer{i}", shape=(256,), priority=i) for i in (3, 2, 1)]
              + [entry("plain", shape=(1024,))])
    assert ready_names(ranks) == ["plain", "layer1"]
    for p in ranks:
        p.add([entry("layer0", shape=(256,), priority=1)])
    assert ready_names(ranks) == ["layer0"]
    assert ready_names(ranks) == ["layer2"]
    assert ready_names(ranks) == ["layer3"]
    assert all(not p.pending for p in ranks)


def test_prioritized_requests_carry_their_cycles_budget():
    """Requests that carry a cycle budget (forward overlap's sized pieces) cut cycles there
    instead of at the engine's setting: the largest among the ready ones, the agreed
    request's (rank 0's here: rank 1 asks for more), the same cut on every rank."""
    settings = replace(TEST_SETTINGS, priority_cycle_bytes=4096)
    ranks = [CycleProtocol(r, 2, settings) for r in range(2)]

    for p in ranks:
        asked = 1024 if p.rank == 0 else 8192
        p.add([entry(f"piece{i}", shape=(256,), priority=i, cycle_bytes=asked)
               for i in (1, 2, 3, 4)])
    assert ready_names(ranks) == ["piece1"]        # 1 KiB a cycle, not the setting's 4 KiB
    for p in ranks:
        p.add([entry("big", shape=(512,), priority=9, cycle_bytes=2048)])
    assert ready_names(ranks) == ["piece2", "piece3"]      # 2 KiB: the largest ready budget
    assert ready_names(ranks) == ["piece4", "big"]
    assert all(not p.pending for p in ranks)


def test_input_rejected_on_one_rank_fails_on_every_rank():
    """Rank 0 rejects its input (it submits the request marked invalid instead of raising
    alone); every rank gets the agreed error naming rank 0 and its reason, nobody waits."""
    def work(rank, engine):
        why = "op=Average is not defined for integer tensor 'x' (int32)" if rank == 0 else None
        handle = engine.submit_many([entry("x", invalid=why)])[0]
        with pytest.raises(InvalidInputError) as info:
            handle.wait(timeout=10)
        engine.submit_many([entry("after")])[0].wait(timeout=10)   # the engine goes on
        return str(info.value)
    messages, order = run_cluster(3, work)
    for text in messages:
        assert text == ("Invalid input for allreduce 'x' on 1 of 3 ranks: rank 0: op=Average "
                        "is not defined for integer tensor 'x' (int32)")
    assert [name for name, _ in order] == ["x", "after"]


def test_non_allreduce_while_joined_fails_at_once_even_under_drifted_names():
    """Rank 2 joins; ranks 0 and 1 call an unnamed allgather after different numbers of
    earlier calls, so their generated names differ: each still gets its error at once."""
    def work(rank, engine):
        if rank == 2:
            return engine.join().wait(timeout=20)
        with pytest.raises(MpiddpError, match="have called join"):
            engine.submit_many([entry(f"allgather.noname.{rank}", kind=ALLGATHER)])[0] \
                .wait(timeout=10)
        return engine.join().wait(timeout=20)
    last, _ = run_cluster(3, work)
    assert len(set(last)) == 1 and last[0] in (0, 1)
