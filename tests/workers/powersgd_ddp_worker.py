"""``Compression.powersgd`` against torch's DDP ``powerSGD_hook`` (gloo) at equal settings.

The same float64 model and data train twice: DDP with the hook, and mpiddp. The two differ
by design only in the first Q's random draw (docs/powersgd.md); here the hook's Q memory is
filled, just before its first compressed step, with the Q's mpiddp draws (``initial_q``, laid
out as the hook lays out its bucket), so the two must then follow the same trajectory up to
rounding: the parameters after every step and the losses agree to a relative 1e-9, at rank 2
(the hook's Gram-Schmidt) and rank 3 (its QR). The other
differences (torch sums P where mpiddp averages it before Gram-Schmidt, and adds error
feedback to the uncompressed tensors too, where its mean across ranks is zero) change only
rounding. Rank 0 prints 'OK ...'.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook_module
from torch.nn.parallel import DistributedDataParallel

import checks
import mpiddp
from mpiddp.torch.gradients.powersgd import initial_q

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
START, STEPS, SEED = 2, 10, 0


def init_gloo():
    """gloo from the MPI ranks: rank 0's store takes a free port (no race for it)."""
    store = dist.TCPStore("127.0.0.1", 0, SIZE, is_master=True, wait_for_workers=False) \
        if RANK == 0 else None
    port = mpiddp.broadcast_object(store.port if RANK == 0 else None)
    if RANK != 0:
        store = dist.TCPStore("127.0.0.1", port, SIZE, is_master=False)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=SIZE)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(3, 6, 3)
        self.l1 = nn.Linear(96, 40)
        self.l2 = nn.Linear(40, 40)
        self.out = nn.Linear(40, 3)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.out(torch.tanh(self.l2(torch.tanh(self.l1(h)))))


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(5, 3, 6, 6, generator=g, dtype=torch.float64), \
        torch.randint(0, 3, (5,), generator=g)


def train(model, optimizer, wrapped=None):
    losses, snapshots = [], []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy((wrapped or model)(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return losses, snapshots


def ddp_run(RANK_R):
    model = Net()
    names = {id(p): name for name, p in model.named_parameters()}
    ddp = DistributedDataParallel(model)
    state = hook_module.PowerSGDState(
        process_group=None, matrix_approximation_rank=RANK_R, start_powerSGD_iter=START,
        min_compression_rate=2, use_error_feedback=True, warm_start=True,
        orthogonalization_epsilon=0, random_seed=SEED)

    def hook(state, bucket):
        index = bucket.index()
        if state.iter == START and index not in state.q_memory_dict:
            # The hook's layout: the bucket's compressed tensors grouped by shape (in the
            # order each shape first appears), each one's (m, r) Q row-major.
            groups: dict = {}
            for grad, param in zip(bucket.gradients(), bucket.parameters()):
                n, m = grad.shape[0], grad.numel() // grad.shape[0]
                r = min(n, m, RANK_R)
                if grad.dim() > 1 and hook_module._should_compress(n, m, r, 2)[0]:
                    groups.setdefault((n, m), []).append((names[id(param)], n, m, r))
            items = [item for group in groups.values() for item in group]
            state.p_memory_dict[index] = torch.empty(sum(n * r for _, n, _, r in items),
                                                     dtype=torch.float64)
            state.q_memory_dict[index] = torch.cat([
                initial_q(SEED, name, START, m, r, torch.float64, "cpu").reshape(-1)
                for name, _, m, r in items])
        return hook_module.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return train(model, optimizer, ddp)


def mpiddp_run(RANK_R):
    model = Net()
    optimizer = mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=mpiddp.Compression.powersgd(rank=RANK_R, start_step=START, seed=SEED))
    return train(model, optimizer)


init_gloo()
for RANK_R in (2, 3):        # torch: Gram-Schmidt at 2, QR above (column signs may differ)
    ddp_losses, ddp_params = ddp_run(RANK_R)
    our_losses, our_params = mpiddp_run(RANK_R)
    worst = 0.0
    for step, (a, b) in enumerate(zip(ddp_params, our_params)):
        for x, y in zip(a, b):
            error = float((x - y).norm() / y.norm())
            worst = max(worst, error)
            assert error < 1e-9, (RANK_R, step, error)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(ddp_losses, our_losses))
    assert loss_error < 1e-9, (RANK_R, ddp_losses, our_losses)
    checks.ok(f"rank {RANK_R}: the same trajectory as torch's DDP powerSGD_hook (gloo) from "
              "the same first Q", RANK, barrier=mpiddp.barrier, worst_parameter=worst,
              worst_loss=loss_error, losses=our_losses)
dist.destroy_process_group()
