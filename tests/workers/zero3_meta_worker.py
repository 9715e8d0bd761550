"""Stage 3 from a model built on the meta device (docs/sharding.md, "A model too large to build
whole"; mpiddp/torch/sharding/meta_init.py). Run with ``MPIDDP_ALLREDUCE_ALGORITHM=ring``.

Every rank ends with the same values, each module's own initialisation (a tied weight its
first module's), buffers included; training then goes on as ``zero_stage=0`` started from
those values (bitwise at 2 ranks); ``param_init_fn`` initialises modules without
``reset_parameters()``, whose absence is refused by name; stages 0-2 refuse a meta model.
"""
import math
import os
import shutil
import tempfile

import torch
import torch.nn as nn

import checks
import mpiddp
from zero_model import OPTIMIZERS, Net, same, step_once

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()


def check_a_meta_model_trains_as_stage_0():
    torch.manual_seed(100 + RANK)            # each rank's own random stream
    with torch.device("meta"):
        model = Net()
    opt = mpiddp.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                      zero_stage=3, bucket_cap_mb=0.0005)
    start = model.state_dict()
    assert all(not v.is_meta for v in start.values())
    everyone = mpiddp.allgather_object(start)
    assert all(torch.equal(other[k], start[k]) for other in everyone for k in start), "agree"
    assert torch.equal(start["emb.weight"], start["out.weight"]), "tied"
    for name in ("l1", "l2", "frozen", "sometimes"):     # kaiming_uniform(a=sqrt(5)) bounds
        weight = start[f"{name}.weight"]
        bound = 1 / math.sqrt(weight.shape[1])
        assert weight.abs().max() <= bound and weight.std() > bound / 4, name
        assert start[f"{name}.bias"].abs().max() <= bound, name
    assert 0.7 < start["emb.weight"].std() < 1.3                   # Embedding: N(0, 1)
    plain = Net()
    plain.load_state_dict(start)
    plain_opt = mpiddp.DistributedOptimizer(OPTIMIZERS["adam"](plain.parameters()),
                                            named_parameters=plain.named_parameters())
    for step in range(3):
        step_once(model, opt, step)
        step_once(plain, plain_opt, step)
    now, want = model.state_dict(), plain.state_dict()
    assert all(same(now[k], want[k]) for k in want), "training"
    # The calls a converted script makes: Checkpoint save; another meta-built model with
    # broadcast_parameters and broadcast_optimizer_state after construction, then restore.
    directory = mpiddp.broadcast_object(tempfile.mkdtemp(prefix="zero3-meta-")
                                        if RANK == 0 else None)
    path = os.path.join(directory, "ckpt.pt")
    mpiddp.Checkpoint(path, model=model, optimizer=opt).save(epoch=1)
    with torch.device("meta"):
        fresh = Net()
    fresh_opt = mpiddp.DistributedOptimizer(OPTIMIZERS["adam"](fresh.parameters()),
                                            model=fresh, zero_stage=3, bucket_cap_mb=0.0005)
    mpiddp.broadcast_parameters(fresh.state_dict(), root_rank=0)
    mpiddp.broadcast_optimizer_state(fresh_opt, root_rank=0)
    assert mpiddp.Checkpoint(path, model=fresh, optimizer=fresh_opt).restore()
    for net, optimizer in ((fresh, fresh_opt), (model, opt)):
        step_once(net, optimizer, 3)
    now, want = fresh.state_dict(), model.state_dict()
    assert all(torch.equal(now[k], want[k]) for k in want), "restored"
    mpiddp.barrier()
    if RANK == 0:
        shutil.rmtree(directory)
    checks.ok("a model built on the meta device: every rank the same values, each module's "
              "own initialisation, then training as zero_stage=0; broadcast_optimizer_state "
              "and a Checkpoint restored into another meta-built model", RANK,
              bitwise=SIZE == 2)


class Scaled(nn.Module):
    """A module without reset_parameters()."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(width))

    def forward(self, x):
        return x * self.scale


def check_buffers_and_param_init_fn():
    def build():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), Scaled(6), nn.Linear(6, 2))
    model = build()
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, zero_stage=3),
        "2 (Scaled)", "param_init_fn")
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=2), "meta device")

    def init(module):
        if isinstance(module, Scaled):
            nn.init.constant_(module.scale, 0.5)
        else:
            module.reset_parameters()
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model=model, zero_stage=3, param_init_fn=init)
    state = model.state_dict()
    assert torch.equal(state["2.scale"], torch.full((6,), 0.5))
    assert torch.equal(state["1.running_mean"], torch.zeros(6))
    assert torch.equal(state["1.running_var"], torch.ones(6))
    assert int(state["1.num_batches_tracked"]) == 0
    everyone = mpiddp.allgather_object(state)
    assert all(torch.equal(other[k], state[k]) for other in everyone for k in state)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(RANK))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert float(model.state_dict()["1.num_batches_tracked"]) == 1
    checks.ok("a meta model's buffers and modules without reset_parameters (param_init_fn) "
              "get memory and the first rank's values; a missing initialisation and stage 2 "
              "are refused by name", RANK)


check_a_meta_model_trains_as_stage_0()
check_buffers_and_param_init_fn()
