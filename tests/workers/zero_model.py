"""The model, data and optimizers the sharded-optimizer workers share (zero_worker.py,
zero3_worker.py): odd and prime sizes; a frozen layer; one used on even steps only; the
output layer's weight tied to the embedding; optionally an activation-checkpointed block."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpiddp

VOCAB, WIDTH, HIDDEN, BATCH = 11, 13, 17, 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.l1 = nn.Linear(WIDTH, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)
        self.out.weight = self.emb.weight

    checkpointed = None      # activation checkpointing of l1-l2: None, or use_reentrant

    def block(self, h):
        return self.l2(torch.tanh(self.l1(h)))

    def forward(self, tokens, step):
        h = self.emb(tokens).mean(1)
        if self.checkpointed is None or not torch.is_grad_enabled():
            h = self.block(h) + self.frozen(h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.block, h,
                                                  use_reentrant=self.checkpointed) \
                + self.frozen(h)
        if step % 2 == 0:
            h = h + self.sometimes(h)
        return self.out(torch.tanh(h))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, 4), generator=g), \
        torch.randint(0, VOCAB, (BATCH,), generator=g)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def pair(stage, kind="adam", seed=5, cap=0.0005):
    """A model and its DistributedOptimizer (several buckets at the default ``cap``;
    ``ZERO_TEST_HYBRID=1`` in the environment: sharded with ``hybrid_shard=True``)."""
    torch.manual_seed(seed)
    model = Net()
    hybrid = {"hybrid_shard": True} if stage and os.environ.get("ZERO_TEST_HYBRID") == "1" \
        else {}
    opt = mpiddp.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
        zero_stage=stage, bucket_cap_mb=cap, model=model if stage == 3 else None, **hybrid)
    assert not hybrid or opt._mpiddp.layout.grid.replicated
    return model, opt


def same(a, b) -> bool:
    """Stage 3 against stage 0: bitwise at 2 ranks; from 3 the sums' order differs where the
    layouts do (docs/dev/sharding.md), so within rounding."""
    if mpiddp.size() == 2:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def step_once(model, opt, step):
    """One training step on this rank's batch of ``step``."""
    opt.zero_grad()
    tokens, labels = batch(step, mpiddp.rank())
    F.cross_entropy(model(tokens, step), labels).backward()
    opt.step()
