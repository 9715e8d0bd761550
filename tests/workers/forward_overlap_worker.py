"""Forward overlap (``DistributedOptimizer(overlap_forward=True)``) against the standard path.

Each check trains two copies of the same model from the same start on the same batches, one
with the standard path and one with forward overlap, and requires the parameters (and the
optimizer state) to be bitwise equal after every step, read in the ways a training script
reads them. Run by tests/test_forward_overlap.py at 2, 3 and 4 ranks.
"""
import functools
import gc
import logging
import os
import sys
import warnings
import weakref

import torch

import mpiddp
import checks

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
ok = functools.partial(checks.ok, rank=RANK, barrier=lambda: mpiddp.allreduce(
    torch.zeros(1), name="barrier"))
STEPS = 4


class Net(torch.nn.Module):
    """Layers used in forward order, a parameter used functionally by another module's
    forward, and a weight tied between the input embedding and the output layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.out = torch.nn.Linear(8, 10, bias=False)
        self.out.weight = self.embed.weight           # tied
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, tokens):
        h = self.embed(tokens).mean(1)
        h = torch.relu(self.fc1(h))
        h = torch.relu(torch.nn.functional.linear(h, self.fc2.weight) * self.scale)
        return self.out(self.proj(h))


def batches(seed):
    g = torch.Generator().manual_seed(seed * 100 + RANK)
    return [(torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 10, (4,), generator=g))
            for _ in range(STEPS)]


def make(optimizer_fn, overlap, compression=mpiddp.Compression.none, passes=1, sched=False):
    torch.manual_seed(0)
    model = Net()
    opt = mpiddp.DistributedOptimizer(optimizer_fn(model.parameters()),
                                      named_parameters=model.named_parameters(),
                                      compression=compression, backward_passes_per_step=passes,
                                      overlap_forward=overlap)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if sched else None
    return model, opt, scheduler


def train(model, opt, scheduler, data, passes=1, read=None):
    """The usual loop: zero_grad at the top, ``passes`` backward passes, step."""
    loss_fn = torch.nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        for _ in range(passes):
            (loss_fn(model(x), y) / passes).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if read is not None:
            read(step)


def equal_state(a, b):
    for (name, p), q in zip(a[0].named_parameters(), b[0].parameters()):
        assert torch.equal(p, q), f"{name} differs: max {float((p - q).abs().max())}"
    sa, sb = a[1].state_dict()["state"], b[1].state_dict()["state"]
    for key in sa:
        for field, value in sa[key].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, sb[key][field]), f"optimizer state {key}.{field}"


OPTIMIZERS = {
    "sgd-momentum-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9,
                                                          nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05),
}


def check_bitwise():
    cases = [(name, fn, mpiddp.Compression.none, 1, False) for name, fn in OPTIMIZERS.items()]
    cases += [("sgd+scheduler", OPTIMIZERS["sgd-momentum-nesterov-wd"],
               mpiddp.Compression.none, 1, True),
              ("adam+2-passes", OPTIMIZERS["adam"], mpiddp.Compression.none, 2, False),
              ("adamw+fp16", OPTIMIZERS["adamw"], mpiddp.Compression.fp16, 1, False),
              ("sgd+bf16+scheduler", OPTIMIZERS["sgd-momentum-nesterov-wd"],
               mpiddp.Compression.bf16, 1, True)]
    for seed, (name, fn, compression, passes, sched) in enumerate(cases):
        data = batches(seed)
        standard = make(fn, False, compression, passes, sched)
        overlap = make(fn, True, compression, passes, sched)
        train(*standard, data, passes)
        train(*overlap, data, passes)
        equal_state(standard, overlap)
        lr = overlap[1].param_groups[0]["lr"]
        assert lr == standard[1].param_groups[0]["lr"], "the scheduler's lr differs"
        sync = overlap[1]._mpiddp
        # The pieces are the engine's cycle budget: the setting, or on one node (no links
        # measured) the least, 1 MiB.
        budget = int(os.environ.get("MPIDDP_PRIORITY_CYCLE_BYTES", 1 << 20))
        assert sync.piece_bytes == budget, (sync.piece_bytes, budget)
        ok(f"bitwise {name}", passes=passes, lr=lr,
           deferred_steps=sync.schedule.deferred_steps,
           cut=any(p.numel() * p.element_size() > sync.piece_bytes for p in sync.params))


def check_reads_are_never_stale():
    """After the last step, before any forward, read the parameters the ways scripts do: the
    first read must already see the updated values (the standard path's)."""
    data = batches(7)
    reads = {
        "state_dict": lambda m, o: list(m.state_dict().values()),
        "parameters() norms": lambda m, o: [p.norm().reshape(1) for p in m.parameters()],
        "no_grad eval forward": lambda m, o: [_eval(m)],
        "optimizer.state_dict": lambda m, o: [  # by index: the update order may differ
            v for _, s in sorted(o.state_dict()["state"].items())
            for v in s.values() if torch.is_tensor(v)],
        "synchronize()": lambda m, o: (o.synchronize(), [p.clone() for p in m.parameters()])[1],
        "tied weight through out": lambda m, o: [m.out.weight.sum().reshape(1)],
        "checkpoint round trip": lambda m, o: list(_saved(m).values()),
    }
    for what, read in reads.items():
        standard = make(OPTIMIZERS["adam"], False)
        overlap = make(OPTIMIZERS["adam"], True)
        train(*standard, data[:2])
        train(*overlap, data[:2])
        assert overlap[1]._mpiddp.schedule.deferred is not None, "step() did not defer"
        got = read(overlap[0], overlap[1])
        want = read(standard[0], standard[1])
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), \
            f"stale read: {what}"
        overlap[1].synchronize()
    ok("no stale reads", reads=sorted(reads))


def _eval(model):
    model.eval()
    with torch.no_grad():
        out = model(torch.arange(6).reshape(2, 3))
    model.train()
    return out


def _saved(model):
    import io
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


def check_fallback_for_clipping_and_amp():
    """Global-norm clipping between backward and step needs every averaged gradient: the
    step falls back to the full synchronization (logged once) and matches the standard path."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mpiddp").addHandler(handler)
    data = batches(11)
    runs = []
    for overlap in (False, True):
        model, opt, _ = make(OPTIMIZERS["sgd-momentum-nesterov-wd"], overlap)
        loss_fn = torch.nn.CrossEntropyLoss()
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        runs.append((model, opt))
    equal_state(*runs)
    fallbacks = [r for r in records if "forward overlap" in r.getMessage()]
    assert len(fallbacks) == 1, [r.getMessage() for r in records]
    logging.getLogger("mpiddp").removeHandler(handler)
    ok("clipping falls back and matches", logged=len(fallbacks))


def check_refusals():
    model = Net()
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.LBFGS(model.parameters()), named_parameters=model.named_parameters(),
        overlap_forward=True), "LBFGS", "overlap_forward")
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      overlap_forward=True)
    x = torch.randint(0, 10, (2, 3))
    model(x).sum().backward()
    checks.expect(RuntimeError, lambda: opt.step(lambda: model(x).sum()), "closure")
    opt.synchronize()
    opt.step()
    ok("LBFGS and closures refused")


def check_setting_turns_it_on():
    """MPIDDP_OVERLAP_FORWARD=1 (the launch sets it for this check's run) turns it on for a
    script that does not pass the argument."""
    model, opt, _ = make(OPTIMIZERS["sgd-momentum-nesterov-wd"], None)
    on = type(opt._mpiddp.schedule).__name__ == "ForwardOverlap"
    assert on == (os.environ.get("MPIDDP_OVERLAP_FORWARD") == "1")
    ok("setting", on=on)


def check_join_and_shutdown_complete_deferred_updates():
    data = batches(13)
    standard = make(OPTIMIZERS["adam"], False)
    overlap = make(OPTIMIZERS["adam"], True)
    train(*standard, data)
    train(*overlap, data)
    mpiddp.join()                          # completes the deferred update first
    assert overlap[1]._mpiddp.schedule.deferred is None
    equal_state(standard, overlap)
    ok("join completes deferred updates")


def check_stall_surfaces_in_the_next_forward():
    """Rank 1 skips a backward: rank 0's deferred update waits for a reduction that never
    comes; the stall shutdown (a few seconds in this launch) surfaces as an error from the
    next forward on rank 0, naming the stall, as on the standard path at backward()."""
    model, opt, _ = make(OPTIMIZERS["sgd-momentum-nesterov-wd"], True)
    x, y = batches(17)[0]
    if RANK == 0:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        text = checks.expect(mpiddp.EngineShutdownError, lambda: model(x), "stall")
        print(f"OK stall surfaces in the next forward | {{\"chars\": {len(text)}}}",
              flush=True)
    else:
        import time
        time.sleep(8)


def check_auto_switches_in_step_and_stays_bitwise_equal():
    """overlap_forward='auto' alternates overlap on and off in its first steps (3 per phase
    here), every rank at the same step, then keeps one; parameters stay bitwise equal to the
    standard path's throughout."""
    from mpiddp.torch.gradients import overlap_trial
    overlap_trial.PHASE_STEPS, overlap_trial.UNTIMED_STEPS = 3, 1
    data = batches(19) * 4                    # 16 steps: 12 of trial, 4 after it
    standard = make(OPTIMIZERS["adam"], False)
    auto = make(OPTIMIZERS["adam"], "auto")
    schedule = auto[1]._mpiddp.schedule
    modes = []
    train(*standard, data)
    train(*auto, data, read=lambda step: modes.append(schedule.enabled))
    equal_state(standard, auto)
    everyone = mpiddp.allgather_object(modes, name="auto_modes")
    assert all(m == everyone[0] for m in everyone), f"ranks switched apart: {everyone}"
    assert schedule.trial.decision is not None
    switches = sum(a != b for a, b in zip(modes, modes[1:]))
    ok("auto", switches=switches, decision=schedule.trial.decision,
       deferred_steps=schedule.deferred_steps)


def agreed_cycle_bytes(engine, sync) -> set:
    """The cycle budgets the engine's agreed (cached) requests for ``sync``'s gradients
    carry (``Request.cycle_bytes``), whole or as pieces."""
    cache, found = engine.protocol.cache, set()
    for name in sync.names.values():
        for candidate in (name, f"{name}#0"):
            slot = cache.slot_of(candidate)
            if slot is not None:
                found.add(cache.response(slot).request.cycle_bytes)
    return found


def check_device_budget():
    """Forward overlap's cycle budget for device memory (torch/cycle_budget.py), with host
    memory posing as the device: the ranks measure the all-reduce and agree, the pieces are
    cut to that size on every rank (or the ranks would cut different pieces and stall) and
    their requests carry it as their cycles' budget, on a new engine (shutdown, init) too,
    the engine's own budget untouched; training stays bitwise equal to the standard path."""
    from mpiddp import runtime
    from mpiddp.collectives.cost_model import device_priority_cycle_bytes
    from mpiddp.torch.gradients import cycle_budget

    engine = runtime.engine_for(None, "check_device_budget")[0]
    before = engine.settings.priority_cycle_bytes
    fixed, per_byte = cycle_budget.measure_allreduce(torch.device("cpu"), "probe", None)
    everyone = mpiddp.allgather_object((fixed, per_byte), name="budget_probe")
    assert all(e == everyone[0] for e in everyone) and fixed > 0 and per_byte > 0, everyone
    real_device_of = cycle_budget.device_of
    cycle_budget.device_of = lambda params: torch.device("cpu")
    try:
        standard = make(OPTIMIZERS["adam"], False)
        overlap = make(OPTIMIZERS["adam"], True)
    finally:
        cycle_budget.device_of = real_device_of
    sync = overlap[1]._mpiddp
    pieces = sync.piece_bytes
    assert sync.cycle_bytes == pieces > before, (sync.cycle_bytes, pieces, before)
    assert mpiddp.allgather_object(pieces, name="pieces") == [pieces] * SIZE
    for seed in (23, 24):
        if seed == 24:
            mpiddp.shutdown()
            mpiddp.init()
            engine = runtime.engine_for(None, "check_device_budget")[0]
        data = batches(seed)
        train(*standard, data)
        train(*overlap, data)
        equal_state(standard, overlap)
        assert agreed_cycle_bytes(engine, sync) == {pieces}, agreed_cycle_bytes(engine, sync)
        assert engine.settings.priority_cycle_bytes == before
    ok("device budget", before=before, pieces=pieces, fixed_us=round(fixed * 1e6),
       ns_per_byte=round(per_byte * 1e9, 3),
       expected=max(before, device_priority_cycle_bytes(fixed, per_byte)))


def check_host_budget():
    """Forward overlap's cycles sized for its gradients in host memory (torch/cycle_budget.py,
    ``cost_model.gradient_cycle_bytes``), the links' rule stood in for (one node measures no
    links): at its first submission on an engine each optimizer asks for its gradients'
    bytes on the wire (halved by fp16 compression), cuts pieces of the size given and its
    requests carry it as their cycles' budget, the same on every rank; a new engine
    (shutdown, init) sizes again, and so do parameters added by ``add_param_group``; training
    stays bitwise equal."""
    from mpiddp import runtime
    from mpiddp.engine.coordinator import Engine

    asked = []

    def sized(engine, gradient_bytes):
        asked.append(gradient_bytes)
        return max(16, gradient_bytes // 4)        # Net's largest tensors are cut
    real = Engine.gradient_cycle_bytes
    Engine.gradient_cycle_bytes = sized
    try:
        engine = runtime.engine_for(None, "check_host_budget")[0]
        before = engine.settings.priority_cycle_bytes
        half = (make(OPTIMIZERS["adamw"], False, mpiddp.Compression.fp16),
                make(OPTIMIZERS["adamw"], True, mpiddp.Compression.fp16))
        full = make(OPTIMIZERS["adam"], False), make(OPTIMIZERS["adam"], True)
        assert asked == [], asked
        wire = sum(p.numel() * 4 for p in full[1][0].parameters())
        syncs = half[1][1]._mpiddp, full[1][1]._mpiddp
        for seed in (25, 26):
            if seed == 26:
                mpiddp.shutdown()
                mpiddp.init()
                engine = runtime.engine_for(None, "check_host_budget")[0]
            for standard, overlap in (half, full):
                data = batches(seed)
                train(*standard, data)
                train(*overlap, data)
                equal_state(standard, overlap)
            assert [(s.piece_bytes, s.cycle_bytes) for s in syncs] == \
                [(wire // 8, wire // 8), (wire // 4, wire // 4)], wire
            assert [agreed_cycle_bytes(engine, s) for s in syncs] == [{wire // 8}, {wire // 4}]
            assert engine.settings.priority_cycle_bytes == before == 1 << 20
        assert asked == [wire // 2, wire] * 2, (asked, wire)
        pieces = syncs[1].piece_bytes
        assert mpiddp.allgather_object(pieces, name="host_pieces") == [pieces] * SIZE
        # Parameters joining the reduction (add_param_group) size the pieces again, for the
        # larger gradients, at the next step's first submission.
        grown = wire + 16 * 4
        for standard, overlap in (half, full):
            for model, opt, _ in (standard, overlap):
                model.register_parameter("late", torch.nn.Parameter(torch.ones(16)))
                opt.add_param_group({"params": [model.late]})
                model.register_forward_hook(lambda m, args, out: out + m.late.sum() * 0.01)
            data = batches(28)
            train(*standard, data)
            train(*overlap, data)
            equal_state(standard, overlap)
        assert asked[4:] == [grown // 2, grown], (asked, grown)
        assert [(s.piece_bytes, s.cycle_bytes) for s in syncs] == \
            [(grown // 8, grown // 8), (grown // 4, grown // 4)], grown
        assert [agreed_cycle_bytes(engine, s) for s in syncs] == [{grown // 8}, {grown // 4}]
    finally:
        Engine.gradient_cycle_bytes = real
    mpiddp.shutdown()           # the checks after this one: engines sized as they would be
    mpiddp.init()
    ok("host budget", before=before, wire=wire, pieces=pieces)


def check_sized_across_nodes():
    """Across nodes (the links measured at start): forward overlap's pieces are sized for the
    optimizer's gradients by the links' rule, for this many nodes, and carried as the
    cycles' budget, the same on every rank; training stays bitwise equal
    (tests/test_multinode.py)."""
    from mpiddp import runtime
    from mpiddp.collectives.cost_model import GRADIENT_CYCLE_MIN_BYTES, gradient_cycle_bytes

    engine = runtime.engine_for(None, "check_sized_across_nodes")[0]
    link, nodes = engine.executor.link, engine.executor.topology.cross_size
    assert link is not None and nodes == SIZE, "one rank per node expected"
    links_only = engine.settings.priority_cycle_bytes
    # The engine's rule for a large model (above the least): this many nodes, these links.
    large = 1 << 30
    assert engine.gradient_cycle_bytes(large) == gradient_cycle_bytes(SIZE, link, large) > \
        GRADIENT_CYCLE_MIN_BYTES
    standard, overlap = make(OPTIMIZERS["adam"], False), make(OPTIMIZERS["adam"], True)
    sync = overlap[1]._mpiddp
    data = batches(27)
    train(*standard, data)
    train(*overlap, data)
    equal_state(standard, overlap)
    pieces = gradient_cycle_bytes(nodes, link, sync.wire_bytes())
    assert sync.piece_bytes == sync.cycle_bytes == pieces, (sync.piece_bytes, pieces)
    assert agreed_cycle_bytes(engine, sync) == {pieces}
    assert mpiddp.allgather_object(pieces, name="sized_pieces") == [pieces] * SIZE
    ok("sized across nodes", nodes=nodes, pieces=pieces, links_only=links_only,
       wire=sync.wire_bytes())


def check_compiled_forward_ends_overlap():
    """torch.compile traces the guard's torch function mode into its graphs, where no update
    can be made just before a parameter's use (the crash this replaces: Dynamo failing
    inside the traced update). Three overlapped steps, then the same model compiled: the
    deferred update completes before the compiled region's first call, the optimizer keeps
    to the standard path from then on, the parameters and state stay bitwise equal to the
    standard path's, and once switched no step breaks a graph or compiles again."""
    from torch._dynamo.utils import counters

    data = batches(29) * 2                     # 8 steps: 3 eager, 5 compiled
    runs = []
    for overlap in (True, False):
        model, opt, _ = make(OPTIMIZERS["adam"], overlap)
        compiled = torch.compile(model, backend="aot_eager")
        train(model, opt, None, data[:3])
        train(compiled, opt, None, data[3:4])
        settled = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
        train(compiled, opt, None, data[4:])
        after = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
        runs.append((model, opt, settled, after))
    (model, opt, settled, after), standard = runs[0], runs[1]
    equal_state(standard[:2], (model, opt))
    # Each rank trained on its own batches: equal parameters everywhere mean the compiled
    # steps were averaged (the gradient hooks fired outside the compiled graphs).
    flat = torch.cat([p.detach().reshape(-1) for p in standard[0].parameters()])
    everyone = mpiddp.allgather(flat[None], name="compiled_replicas")
    assert all(torch.equal(row, everyone[0]) for row in everyone), "replicas differ"
    schedule = opt._mpiddp.schedule
    assert not schedule.enabled and schedule.deferred is None and schedule.deferred_steps == 3
    assert all(guard.inert for guard in schedule.guards.values())
    assert settled == after, f"graph breaks, graphs after the switch: {settled} -> {after}"
    ok("compiled", deferred_steps=schedule.deferred_steps, graph_breaks=after[0],
       graphs=after[1])


def check_inference_mode_between_steps():
    """Validation under torch.inference_mode() after every step: the deferred update runs in
    that forward, but as step() would have, outside inference mode (Adam's state, created at
    its first step, must not be inference tensors that the next step cannot update)."""
    data = batches(31)
    runs = []
    for overlap in (False, True):
        model, opt, _ = make(OPTIMIZERS["adam"], overlap)

        def validate(step, model=model):
            with torch.inference_mode():
                model(data[0][0])
        train(model, opt, None, data, read=validate)
        runs.append((model, opt))
    equal_state(*runs)
    state = runs[1][1].state_dict()["state"]
    assert not any(v.is_inference() for st in state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))
    ok("inference mode between steps", deferred_steps=runs[1][1]._mpiddp.schedule.deferred_steps)


def check_a_dropped_optimizer_still_updates():
    """A script drops its optimizer right after step() and builds another for the next
    phase (Adam, then SGD): the dropped one's deferred update lands before the new one
    takes the parameters over (it vanished with the optimizer, or failed on it), and the
    dropped optimizer is released then, without the garbage collector (whose timing differs
    between ranks), so its gradient hooks are gone on every rank at the same point."""
    data = batches(37)
    finals, released = [], []
    gc.disable()
    try:
        for overlap in (False, True):
            model, opt, _ = make(OPTIMIZERS["adam"], overlap)
            train(model, opt, None, data[:2])
            old = weakref.ref(opt._mpiddp)
            del opt
            opt = mpiddp.DistributedOptimizer(OPTIMIZERS["sgd-momentum-nesterov-wd"](
                model.parameters()), named_parameters=model.named_parameters(),
                overlap_forward=overlap)
            released.append(old() is None)
            train(model, opt, None, data[2:])
            finals.append((model, opt))
        # Dropped after a backward, before its step (reductions in flight): released too.
        model, opt = finals[1]
        x, y = data[0]
        torch.nn.CrossEntropyLoss()(model(x), y).backward()
        assert opt._mpiddp.schedule.round is not None, "no round in flight"
        old = weakref.ref(opt._mpiddp)
        finals[1] = (model, None)
        del opt
        released.append(old() is None)
    finally:
        gc.enable()
    for (name, p), q in zip(finals[0][0].named_parameters(), finals[1][0].parameters()):
        assert torch.equal(p, q), f"{name} differs: max {float((p - q).abs().max())}"
    assert released == [True, True, True], released
    ok("a dropped optimizer's update lands", released=released)


CHECKS = {"device_budget": check_device_budget, "host_budget": check_host_budget,
          "sized": check_sized_across_nodes,
          "compiled": check_compiled_forward_ends_overlap,
          "inference": check_inference_mode_between_steps,
          "dropped": check_a_dropped_optimizer_still_updates,
          "auto": check_auto_switches_in_step_and_stays_bitwise_equal,
          "stall": check_stall_surfaces_in_the_next_forward, "bitwise": check_bitwise,
          "stale": check_reads_are_never_stale, "fallback": check_fallback_for_clipping_and_amp,
          "refusals": check_refusals, "setting": check_setting_turns_it_on,
          "join": check_join_and_shutdown_complete_deferred_updates}

for name in sys.argv[1].split(","):
    CHECKS[name]()
mpiddp.shutdown()
