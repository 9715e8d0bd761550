"""``DistributedOptimizer(zero_stage=1|2)`` on a device against ``zero_stage=0``, and its
memory against the ZeRO formula.

    MPIDDP_ALLREDUCE_ALGORITHM=ring mpiexec -n 2 python tests/workers/zero_cuda_worker.py cuda|cpu

(ring: the sharded reduce-scatter sums in the ring all-reduce's order). ``cuda``: the model,
its gradients and the optimizer's state on the rank's GPU (scripts/gpu/gpu_check.sh: 2 ranks on
one device); ``cpu``: the same checks on host tensors (CI).

Checks (rank 0 prints 'OK <check> | {numbers}'):

* bitwise equality with ``zero_stage=0`` after every step, SGD (momentum, nesterov, weight
  decay) and Adam, stages 1 and 2, ``overlap_forward`` off and on, on a small model with odd
  sizes, a frozen layer and tied weights (the first step waits for step(), the later ones take
  the early schedule: ready events per packed gradient, the engine stream waiting for them,
  the device reduce-scatter, the all-gathers straight into the parameters);
* memory, Adam on a 4 x 1024 MLP: the wrapped optimizer's state is this rank's shards only,
  8 B per parameter / N (exact up to the chunk's rounding), and the model-state memory after
  a step (parameters + the gradients held + optimizer state) against the ZeRO formula:
  16 B per parameter at stage 0, 4 + 4 + 8/N at stage 1, 4 + (4 + 8)/N at stage 2. On a
  device it is ``torch.cuda.memory_allocated`` after the step less before the model existed
  (and the peak, ``torch.cuda.max_memory_allocated``, is reported); on the host, the bytes of
  the distinct storages those tensors hold. mpiddp's fusion and staging buffers are CuPy's
  (its own memory pool), outside torch's allocator: reported, not counted.

The fake CUDA layer cannot carry this worker: the sharded optimizer packs, copies, views and
steps gradients with torch's own kernels on CUDA tensors (``zero_``, ``copy_``, ``view``, the
wrapped optimizer's step), as does the model's forward and backward, and the fake provides
CuPy and torch.cuda's streams and events only, not torch kernels on CUDA tensors.
"""
import gc
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import mpiddp

MODE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
assert MODE in ("cuda", "cpu"), MODE
torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
DEVICE = torch.device("cuda", torch.cuda.current_device()) if MODE == "cuda" else \
    torch.device("cpu")
VOCAB, WIDTH, HIDDEN, BATCH = 11, 13, 17, 6


def ok(check, **values):
    checks.ok(f"[{MODE}] {check}", RANK, barrier=mpiddp.barrier, **values)


class Net(nn.Module):
    """Odd and prime sizes; a frozen layer; the output layer's weight tied to the embedding
    (a reduced copy of tests/workers/zero_worker.py's, which runs its checks at import)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.l1 = nn.Linear(WIDTH, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(WIDTH, VOCAB)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens).mean(1)
        h = self.l2(torch.tanh(self.l1(h))) + self.frozen(h)
        return self.out(torch.tanh(h))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, 4), generator=g).to(DEVICE), \
        torch.randint(0, VOCAB, (BATCH,), generator=g).to(DEVICE)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def train(stage, kind, overlap=False, steps=4):
    torch.manual_seed(5)
    model = Net().to(DEVICE)
    opt = mpiddp.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
        zero_stage=stage, bucket_cap_mb=64.0, overlap_forward=overlap)
    snaps = []
    for step in range(steps):
        opt.zero_grad()
        tokens, labels = batch(step, RANK)
        F.cross_entropy(model(tokens), labels).backward()
        opt.step()
        with torch.no_grad():
            snaps.append([p.detach().clone() for p in model.parameters()])
    assert all(p.device == DEVICE for p in model.parameters())
    return snaps


def check_exact():
    configurations = 0
    for kind in OPTIMIZERS:
        reference = train(0, kind)
        for stage in (1, 2):
            for overlap in (False, True):
                got = train(stage, kind, overlap)
                for step, (r, g) in enumerate(zip(reference, got)):
                    assert all(torch.equal(x, y) for x, y in zip(r, g)), \
                        (kind, stage, overlap, step)
                configurations += 1
    ok("zero_stage 1 and 2 bitwise equal to zero_stage=0 after every step on %s (SGD, Adam; "
       "overlap_forward off and on)" % DEVICE.type, configurations=configurations)


# ---- memory ----------------------------------------------------------------------------------
LAYERS, MEM_WIDTH, MEM_BATCH = 4, 1024, 8


def formula(stage, params):
    """The ZeRO paper's model-state bytes per rank for float32 Adam."""
    grads = 4 * params / (SIZE if stage >= 2 else 1)
    optimizer = 8 * params / (SIZE if stage >= 1 else 1)
    return {"params": 4 * params, "grads": grads, "optimizer": optimizer,
            "total": 4 * params + grads + optimizer}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one chunk count once)."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def cupy_pool_bytes() -> int:
    if DEVICE.type != "cuda":
        return 0
    import cupy
    return int(cupy.get_default_memory_pool().total_bytes())


def measure(stage, steps=3):
    gc.collect()                     # the previous configuration's optimizer and model
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(MEM_WIDTH, MEM_WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers).to(DEVICE)
    params = sum(p.numel() for p in model.parameters())
    opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters(),
                                      zero_stage=stage)
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 * step + RANK)
        x = torch.randn(MEM_BATCH, MEM_WIDTH, generator=g).to(DEVICE)
        model(x).square().mean().backward()
        opt.step()
    state = [t for s in opt.state.values() for t in s.values()
             if torch.is_tensor(t) and t.numel() > 1]
    optimizer_bytes = sum(t.numel() * t.element_size() for t in state)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if stage:
        grads += [shard.grad for group in opt.param_groups for shard in group["params"]
                  if shard.grad is not None]
    row = {"params": params, "optimizer_state_bytes": optimizer_bytes,
           "grad_bytes": storage_bytes(grads),
           "host_model_state_bytes": 4 * params + storage_bytes(grads) + optimizer_bytes}
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        row["device_model_state_bytes"] = torch.cuda.memory_allocated() - before
        row["device_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        row["cupy_pool_bytes"] = cupy_pool_bytes()
    del opt, model, state, grads
    return row


def check_memory():
    rows, numbers = {}, {}
    for stage in (0, 1, 2):
        row = rows[stage] = measure(stage)
        want = formula(stage, row["params"])
        # The optimizer state: this rank's shards only, exactly (chunks differ by < N).
        assert abs(row["optimizer_state_bytes"] - want["optimizer"]) <= 8 * SIZE, (stage, row)
        state_key = "device_model_state_bytes" if DEVICE.type == "cuda" else \
            "host_model_state_bytes"
        ratio = row[state_key] / want["total"]
        # Within 5% (+ 1 MiB of allocator rounding and scalars): what the formula counts, and
        # no full-size copy left behind (one would be +25% at stage 0, more past it).
        assert abs(row[state_key] - want["total"]) <= 0.05 * want["total"] + (1 << 20), \
            (stage, row, want)
        numbers[f"stage{stage}_model_state_MiB"] = round(row[state_key] / 2 ** 20, 2)
        numbers[f"stage{stage}_formula_MiB"] = round(want["total"] / 2 ** 20, 2)
        numbers[f"stage{stage}_ratio"] = round(ratio, 3)
        if "device_peak_bytes" in row:
            numbers[f"stage{stage}_peak_MiB"] = round(row["device_peak_bytes"] / 2 ** 20, 2)
            numbers[f"stage{stage}_cupy_pool_MiB"] = round(row["cupy_pool_bytes"] / 2 ** 20, 2)
    assert rows[0]["host_model_state_bytes"] > rows[1]["host_model_state_bytes"] > \
        rows[2]["host_model_state_bytes"], rows
    ok("zero memory on %s against the formula (Adam, %d parameters, %d ranks; %s)"
       % (DEVICE.type, rows[0]["params"], SIZE,
          "torch.cuda.memory_allocated" if DEVICE.type == "cuda" else "tensor storages"),
       **numbers)


check_exact()
check_memory()
mpiddp.shutdown()
