"""Mixed precision with DistributedOptimizer: float16 with a GradScaler, bfloat16 without one.

    mpiexec -n 2 python examples/amp_recipes.py

On a GPU both recipes run under CUDA autocast; without one, under CPU autocast (the same
code, slower). docs/training.md, "Mixed precision", explains each line.
"""
import torch
import torch.nn.functional as F

import mpiddp


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 2)).to(device)


def make_loader(device, steps=20, batch=32):
    """Synthetic batches, different on each rank."""
    g = torch.Generator().manual_seed(1 + mpiddp.rank())
    loader = []
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=g)
        loader.append((x.to(device), (x[:, :4].sum(1) > 0).long().to(device)))
    return loader


def train_fp16(model, optimizer, loader, device):
    scaler = torch.amp.GradScaler(device.type)
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()      # returns with averaged (still scaled) gradients
        scaler.unscale_(optimizer)         # unscale before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)             # an inf/nan is seen on every rank: all skip the step
        scaler.update()                    # so the scale stays the same on every rank
    return loss.item()


def train_bf16(model, optimizer, loader, device):
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()                    # no GradScaler: bfloat16 has float32's range
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    return loss.item()


def main():
    mpiddp.init()
    if torch.cuda.is_available():
        device = torch.device("cuda", mpiddp.local_rank() % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    loader = make_loader(device)
    for recipe in (train_fp16, train_bf16):
        model = make_model(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
        optimizer = mpiddp.DistributedOptimizer(optimizer,
                                                named_parameters=model.named_parameters())
        mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
        loss = recipe(model, optimizer, loader, device)
        # Every rank stepped on the same averaged gradients: the replicas are equal.
        sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
        assert all(s == sums[0] for s in sums), f"{recipe.__name__}: replicas differ"
        if mpiddp.rank() == 0:
            print(f"{recipe.__name__}: last loss {loss:.4f}, replicas equal")


if __name__ == "__main__":
    main()
