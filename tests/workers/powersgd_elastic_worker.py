"""PowerSGD's state through ``elastic.State`` (docs/powersgd.md "Checkpoints and restarts"):
the step count and the Q memories are kept, the error buffers start at zero, at any rank
count.

    powersgd_elastic_worker.py DIR first      (3 ranks)
    powersgd_elastic_worker.py DIR second     (another rank count: 2)

A float64 model of three layers (two matrices compressed at rank 2, one too small, biases)
trains with ``DistributedOptimizer(compression=Compression.powersgd(rank=2, start_step=1))``,
``ElasticSampler`` and ``elastic.State`` as docs/elastic.md shows. Every step is compared
with the float64 reference of the paper that simulates every rank
(``powersgd_reference.py``): each rank computes every rank's local gradients of the step
(each rank's batch is its share of the sampler's chunk), and after backward its gradients,
Q memories and error buffer must be the reference's; the replicas must be identical.

``first``: a restore that finds nothing, then commits every 2 steps; after step 5 an
in-process ``state.restore()`` (what a failure costs: back to the commit of step 4) must give
back the committed step, parameters, sampler position, PowerSGD step count and every Q
bitwise, with no error buffer; the reference, given that Q and no errors, then matches the
next steps (so the Q is used as the warm start and the errors are zero). The snapshot file
must itself carry ``"mpiddp_powersgd"``. Rank 0 writes the state of the last commit (step 6)
to DIR/expected.pt.

``second``: ``state.restore()`` on 2 ranks must give every rank that step count and every Q
bitwise, no error buffer, the parameters; the reference at 2 ranks, from that Q and zero
errors, then matches the rest of the epoch.
"""
import os
import sys

import numpy as np
import torch
import torch.nn as nn

import checks
import mpiddp
from mpiddp.elastic import ElasticSampler, State, list_snapshots
from mpiddp.torch.gradients.powersgd import STATE_KEY
from powersgd_reference import Reference

torch.set_num_threads(1)
DATASET, BATCH, COMMIT_EVERY = 100, 4, 2
SETTINGS = dict(rank=2, start_step=1)
TOL = 1e-9


def make_model():
    torch.manual_seed(mpiddp.rank())        # different until restore/sync makes them equal
    return nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(),
                         nn.Linear(12, 2)).double()


DATA = torch.randn(DATASET, 20, generator=torch.Generator().manual_seed(0),
                   dtype=torch.float64)
TARGET = torch.stack([DATA[:, :10].sum(1), DATA[:, 10:].prod(1)], 1)


def loss_of(model, batch):
    x, y = DATA[batch], TARGET[batch]
    return ((model(x) - y) ** 2).sum() / max(1, len(batch))


def local_grads(model, batch):
    """This batch's gradients (autograd.grad: no hook runs), as float64 arrays."""
    named = list(model.named_parameters())
    grads = torch.autograd.grad(loss_of(model, batch), [p for _, p in named])
    return {name: g.detach().numpy().copy() for (name, _), g in zip(named, grads)}


def close(got, want, what):
    got = got.detach().double().numpy().reshape(want.shape)
    error = float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-30))
    assert error <= TOL, f"rank {mpiddp.rank()}: {what}: relative error {error:.3g} > {TOL}"
    return error


def identical_everywhere(model, what):
    mine = [p.detach().clone() for p in model.parameters()]
    everyone = mpiddp.allgather_object(mine, name=f"check.{what}")
    assert all(all(torch.equal(a, b) for a, b in zip(other, mine)) for other in everyone), \
        f"rank {mpiddp.rank()}: the replicas differ {what}"


class Trainer:
    """The user's training loop, one step at a time, each checked against the reference."""

    def __init__(self, directory):
        self.size, self.rank = mpiddp.size(), mpiddp.rank()
        self.model = make_model()
        self.optimizer = mpiddp.DistributedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=0.02, momentum=0.9),
            named_parameters=self.model.named_parameters(),
            compression=mpiddp.Compression.powersgd(**SETTINGS))
        self.sync = self.optimizer._mpiddp
        self.sampler = ElasticSampler(DATASET, BATCH, seed=5)
        self.state = State(self.model, self.optimizer, sampler=self.sampler,
                           directory=directory, samples_done=0)
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        self.ref = Reference(shapes, self.size, **SETTINGS)
        self.compressible = [name for name in shapes if self.ref.compressed(name)]
        assert len(self.compressible) == 2, self.compressible
        self.worst = 0.0
        self.batches = self.committed = None

    def restore(self):
        """``state.restore()``; the reference then starts from the restored PowerSGD state:
        its step count and Q's, and no error (the rule under test)."""
        restored = self.state.restore()
        self.ref.steps = self.sync.steps
        self.ref.q = {key: memory.q.double().numpy().copy()
                      for key, memory in self.sync.memories.items() if memory.q is not None}
        self.ref.reset_errors()
        self.sampler.set_epoch(self.state.epoch, consumed=self.state.consumed)
        self.batches = iter(self.sampler)
        return restored

    def step(self):
        """One training step, checked; commits every COMMIT_EVERY steps. False at the end of
        the epoch."""
        start = self.sampler.consumed
        batch = next(self.batches, None)
        if batch is None:
            return False
        chunk = self.sampler.order()[start:self.sampler.consumed]
        grads = [local_grads(self.model, chunk[r::self.size]) for r in range(self.size)]
        expected = self.ref.step(grads)
        self.optimizer.zero_grad()
        loss_of(self.model, batch).backward()
        for name, p in self.model.named_parameters():
            self.worst = max(self.worst, close(p.grad, expected[name],
                                               f"step {self.state.step} {name} gradient"))
        if self.sync.steps > SETTINGS["start_step"]:
            for name in self.compressible:
                memory = self.sync.memories[name]
                self.worst = max(self.worst, close(memory.q, self.ref.q[name],
                                                   f"step {self.state.step} {name} Q"))
                self.worst = max(self.worst, close(memory.error, self.ref.errors[name][self.rank],
                                                   f"step {self.state.step} {name} error"))
        self.optimizer.step()
        identical_everywhere(self.model, f"after step {self.state.step}")
        self.state.samples_done += len(chunk)
        self.state.step += 1
        if self.state.step % COMMIT_EVERY == 0:
            self.state.commit()
            self.committed = self.record()
        return True

    def record(self):
        """What the commit just made must bring back."""
        return {"step": self.state.step, "consumed": self.state.consumed,
                "samples_done": self.state.samples_done, "powersgd": self.sync.state(),
                "params": [p.detach().clone() for p in self.model.parameters()]}

    def check_restored(self, expected, what):
        """Every rank: the committed training state and PowerSGD state, bitwise; no error
        buffer."""
        assert self.state.step == expected["step"], (what, self.state.step)
        assert self.state.consumed == expected["consumed"], (what, self.state.consumed)
        assert self.state.samples_done == expected["samples_done"], what
        assert all(torch.equal(a, b) for a, b in zip(self.model.parameters(),
                                                     expected["params"])), \
            f"{what}: parameters differ from the committed ones"
        saved = expected["powersgd"]
        assert self.sync.steps == saved["steps"], (what, self.sync.steps, saved["steps"])
        assert sorted(saved["q"]) == sorted(self.compressible), (what, sorted(saved["q"]))
        assert sorted(self.sync.memories) == sorted(saved["q"]), \
            (what, sorted(self.sync.memories))
        for key, q in saved["q"].items():
            memory = self.sync.memories[key]
            assert memory.q is not None and torch.equal(memory.q, q), \
                f"rank {self.rank}: {what}: Q of {key} differs from the saved one"
            assert memory.error is None, \
                f"rank {self.rank}: {what}: the error buffer of {key} was not reset"
        identical_everywhere(self.model, what)
        # ... and the same PowerSGD state on every rank
        everyone = mpiddp.allgather_object(self.sync.state(), name=f"check.state.{what}")
        assert all(other["steps"] == saved["steps"] and all(
            torch.equal(other["q"][k], q) for k, q in saved["q"].items()) for other in everyone)


def first(directory):
    trainer = Trainer(directory)
    state, sync = trainer.state, trainer.sync
    assert not trainer.restore(), "a snapshot was found in a fresh directory"
    assert sync.steps == 0 and not sync.memories
    while state.step < 5:
        assert trainer.step()
    committed = trainer.committed
    assert committed["step"] == 4 and committed["powersgd"]["steps"] == 4, committed["step"]
    state.wait()
    if state.writer:            # the snapshot file itself carries the PowerSGD state
        newest = max(list_snapshots(directory))[2]
        snapshot = torch.load(newest, weights_only=False, map_location="cpu")
        saved = snapshot["optimizer"][STATE_KEY]
        assert snapshot["step"] == 4 and saved["steps"] == 4, (snapshot["step"], saved)
        assert sorted(saved["q"]) == sorted(committed["powersgd"]["q"])
        assert all(torch.equal(saved["q"][k], q) for k, q in committed["powersgd"]["q"].items())
    # After step 5, as after a failure: back to the commit of step 4, in this process.
    moved = sync.steps
    assert trainer.restore()
    trainer.check_restored(committed, "in-process restore")
    checks.ok("first launch: restored in process at the commit of step 4 (from step "
              f"{moved}): PowerSGD steps and every Q bitwise, no error buffer", trainer.rank,
              barrier=mpiddp.barrier, steps=sync.steps,
              q=sorted(committed["powersgd"]["q"]))
    while state.step < 7:       # the reference, from the restored Q and zero errors
        assert trainer.step()
    state.wait()
    assert trainer.committed["step"] == 6
    if trainer.rank == 0:
        torch.save(trainer.committed, os.path.join(directory, "expected.pt"))
    checks.ok("first launch: the reference matched after the restore", trainer.rank,
              barrier=mpiddp.barrier, size=trainer.size, step=state.step,
              committed=trainer.committed["step"], worst=trainer.worst)


def second(directory):
    trainer = Trainer(directory)
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=False)
    assert trainer.restore(), "no snapshot found"
    trainer.check_restored(expected, f"restore at {trainer.size} ranks")
    checks.ok(f"second launch: restored at {trainer.size} ranks: PowerSGD steps and every Q "
              "bitwise, no error buffer", trainer.rank, barrier=mpiddp.barrier,
              size=trainer.size, step=trainer.state.step, steps=trainer.sync.steps)
    steps = 0
    while trainer.step():
        steps += 1
    assert trainer.sampler.consumed == DATASET
    trainer.state.commit()
    trainer.state.wait()
    checks.ok("second launch: the reference matched to the end of the epoch", trainer.rank,
              barrier=mpiddp.barrier, size=trainer.size, steps_trained=steps,
              step=trainer.state.step, worst=trainer.worst)


def main():
    directory, phase = sys.argv[1], sys.argv[2]
    mpiddp.init()
    {"first": first, "second": second}[phase](directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
