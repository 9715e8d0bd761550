"""Stage 3: the model owns its shards (docs/sharding.md, "Stage 3"). Run with
``MPIDDP_ALLREDUCE_ALGORITHM=ring`` at 2 ranks (bitwise against ``zero_stage=0``) and 3
(within rounding).

Every use of a stage-3 model whose optimizer is gone (returned from a function, ``del``) works
as the same use of a stage-0 model trained alike: ``state_dict()``, forward, evaluation,
backward, ``load_state_dict()``, parameters kept without their model, and a new
``DistributedOptimizer`` (stage 3 again, or stage 2) on the same model. What cannot work
raises a clear error and changes nothing: new memory for a sharded parameter (``model.to()``
to another dtype), a gather that fails, any gather after ``mpiddp.shutdown()``. Saves
(``Checkpoint.save``, ``elastic.State.commit``) leave ``state_dict()`` as they found it on
every rank. The process ends normally with a stage-3 model alive after ``shutdown()``.
"""
import io
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F

import checks
import mpiddp
from mpiddp.torch.sharding import param_gathers
from zero_model import batch, pair, same, step_once

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()


def all_same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def trained(stage, steps=2, kind="adam"):
    """A model trained ``steps`` steps by an optimizer that is gone when this returns."""
    model, opt = pair(stage, kind)
    for step in range(steps):
        step_once(model, opt, step)
    return model


def check_the_model_outlives_its_optimizer():
    plain, model = trained(0), trained(3)
    assert all_same(model.state_dict(), plain.state_dict()), "state_dict"
    total = sum(float(v.sum()) for v in model.state_dict().values())    # (read: no crash)
    assert total == total
    tokens, labels = batch(7, RANK)
    alias, view = model.l1.weight.detach(), model.l2.weight.t()     # share their memory
    with torch.no_grad():
        assert same(model(tokens, 0), plain(tokens, 0)), "evaluation"
    # (an evaluation releases every bucket: the aliases' reads gather them again)
    assert same(alias * 1, plain.l1.weight.detach()) and same(view + 0, plain.l2.weight.t())
    for net in (plain, model):
        net.zero_grad()
        F.cross_entropy(net(tokens, 1), labels).backward()
    assert all(same(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters())
               if a.grad is not None), "backward"
    # A graph built while the optimizer lived runs its backward after it is gone.
    model, opt = pair(3)
    loss = F.cross_entropy(model(tokens, 0), labels)
    del opt
    loss.backward()
    # Parameters kept without their model (or optimizer).
    params = list(trained(3).parameters())
    assert all(same(a, b) for a, b in zip(params, plain.parameters())), "parameters alone"
    # load_state_dict, then the same forward.
    fresh = trained(3, steps=1)
    fresh.load_state_dict(plain.state_dict())
    assert all_same(fresh.state_dict(), plain.state_dict()), "load_state_dict"
    checks.ok("a stage-3 model outlives its optimizer: state_dict, evaluation, backward, "
              "parameters alone, aliases kept across a release and load_state_dict as stage "
              "0's", RANK, bitwise=SIZE == 2)


def check_a_new_optimizer_takes_the_model():
    plain, model = trained(0), trained(3)
    for stage in (3, 2, 3):     # stage 3 again, then stage 2, then 3 once more
        opt0 = mpiddp.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1))
        opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          zero_stage=stage,
                                          model=model if stage == 3 else None)
        for step in (10, 11):
            step_once(plain, opt0, step)
            step_once(model, opt, step)
        assert all_same(model.state_dict(), plain.state_dict()), f"stage {stage}"
        if stage == 3:       # while it lives, a second one is refused
            checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=3, model=model),
                "another live DistributedOptimizer")
        del opt, opt0
    checks.ok("a new DistributedOptimizer (stage 3, 2, 3) takes over a stage-3 model whose "
              "optimizer is gone and trains as stage 0", RANK, bitwise=SIZE == 2)


def check_what_cannot_work_is_refused():
    model, opt = pair(3)
    step_once(model, opt, 0)
    before = model.state_dict()
    text = checks.expect(RuntimeError, lambda: model.to(torch.float64), "other memory",
                         "zero_stage=3", "before building the optimizer")
    assert "emb.weight" in text or "l1.weight" in text, text
    checks.expect(RuntimeError, lambda: setattr(model.l1.weight, "data", torch.zeros(17, 13)),
                  "l1.weight", "other memory")
    model.to("cpu")                  # where it is: nothing moves
    assert all_same(model.state_dict(), before), "after the refusals"
    # A gather that fails leaves its bucket released (not gathered with undefined values);
    # the next use gathers it.
    gathers = opt._mpiddp.gathers
    with gathers.internal():
        for bucket in gathers.all_buckets():
            gathers.release(bucket)
    submit = param_gathers.submit_together

    def failing(*args, **kwargs):
        raise RuntimeError("injected submit failure")
    param_gathers.submit_together = failing
    try:
        checks.expect(RuntimeError, lambda: model(*batch(0, RANK)[:1], 0), "injected")
    finally:
        param_gathers.submit_together = submit
    assert not gathers.arriving and all(not b.gathered for b in gathers.all_buckets())
    step_once(model, opt, 1)
    plain, opt0 = pair(0)
    for step in (0, 1):
        step_once(plain, opt0, step)
    assert all_same(model.state_dict(), plain.state_dict()), "after a failed gather"
    checks.ok("stage 3 refuses new memory for its parameters (model.to(float64)) by name; a "
              "failed gather leaves nothing undefined", RANK, bitwise=SIZE == 2)


def check_saves_leave_the_state_dicts_alone():
    directory = mpiddp.broadcast_object(tempfile.mkdtemp(prefix="zero3-own-") if RANK == 0
                                        else None)
    model, opt = pair(3)
    step_once(model, opt, 0)
    want = model.state_dict()
    mpiddp.Checkpoint(os.path.join(directory, "ckpt.pt"), model=model, optimizer=opt).save(0)
    assert all_same(model.state_dict(), want), "model.state_dict() after Checkpoint.save"
    checks.expect(RuntimeError, opt.state_dict, "consolidate_state_dict")
    # Consolidated onto every rank before the save: still so after it.
    opt.consolidate_state_dict(to=None)
    whole = opt.state_dict()
    mpiddp.Checkpoint(os.path.join(directory, "ckpt.pt"), model=model, optimizer=opt).save(0)
    assert opt.state_dict() is whole
    state = mpiddp.elastic.State(model, opt, directory=directory)
    step_once(model, opt, 1)
    # The commit gathers the whole state onto the writers only (each node's first rank).
    held, consolidate = [], opt._consolidate

    def recorded(to, keep=None):
        consolidate(to, keep=keep)
        sync = opt._mpiddp
        held.append((sync.consolidated[1] is not None, sync.gathers.consolidated is not None))
    opt._consolidate = recorded
    state.commit()
    state.wait()
    del opt._consolidate
    assert held == [(state.writer, state.writer)] and state.writer == (RANK == 0), held
    want = model.state_dict()
    assert all_same(model.state_dict(), want)
    checks.expect(RuntimeError, opt.state_dict, "consolidate_state_dict")
    # A whole model pickled (torch.save(model)): at stage 0 it saves and loads (the copy
    # belongs to no optimizer: a new one takes it); at stage 3 a clear refusal.
    plain, plain_opt = pair(0)
    step_once(plain, plain_opt, 0)
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    assert all_same(copy.state_dict(), plain.state_dict())
    mpiddp.DistributedOptimizer(torch.optim.SGD(copy.parameters(), lr=0.1))
    checks.expect(TypeError, lambda: torch.save(model, io.BytesIO()), "zero_stage=3",
                  "model.state_dict()")
    # Stage 2 too: the optimizer's state_dict() after a save is what it was before.
    model2, opt2 = pair(2)
    step_once(model2, opt2, 0)
    mpiddp.Checkpoint(os.path.join(directory, "ckpt2.pt"), model=model2, optimizer=opt2).save(0)
    checks.expect(RuntimeError, opt2.state_dict, "consolidate_state_dict")
    mpiddp.barrier()
    if RANK == 0:
        shutil.rmtree(directory)
    checks.ok("Checkpoint.save and elastic.State.commit leave model.state_dict() and "
              "optimizer.state_dict() as they found them, on every rank (the commit's whole "
              "state held by the writer alone); torch.save(model) works at stage 0 and is "
              "refused by name at stage 3", RANK)


def check_shutdown_with_the_model_alive():
    """Last: gathers after shutdown() are refused by name; the process ends normally with the
    model (and a parameter of it) alive."""
    global KEPT
    model, opt = pair(3)
    step_once(model, opt, 0)
    mpiddp.shutdown()
    tokens, _ = batch(0, RANK)
    checks.expect(RuntimeError, lambda: model(tokens, 0), "shutdown()", "zero_stage=3")
    checks.expect(RuntimeError, model.state_dict, "shutdown()")
    KEPT = (model, opt, next(model.parameters()))
    print(f"OK {RANK} shutdown with a stage-3 model alive", flush=True)


check_the_model_outlives_its_optimizer()
check_a_new_optimizer_takes_the_model()
check_what_cannot_work_is_refused()
check_saves_leave_the_state_dicts_alone()
check_shutdown_with_the_model_alive()
