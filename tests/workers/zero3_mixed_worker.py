"""Stage 3 with mixed precision (``mixed_precision=mpiddp.MixedPrecisionPolicy(...)``;
docs/sharding.md) against float32 stage 3. Rank 0 prints 'OK <check>' for: the losses of
bf16 parameters within 3% of float32's over Adam steps (also with GradScaler, clipping and
accumulation); the shards float32 and the parameters and the forward's inputs bf16 in the
forward; a gather moving half float32's bytes; ``model.state_dict()`` float32 and equal to the
masters, ``load_state_dict`` taking them at full precision; an ``mpiddp.Checkpoint`` resuming
bitwise; a meta-built model; a new optimizer taking the masters over; the refusals.
"""
import os
import shutil
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import mpiddp
import zero_model

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
BF16 = mpiddp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(20, 48)
        self.l2 = nn.Linear(48, 48)
        self.out = nn.Linear(48, 5)

    def forward(self, x):
        return self.out(torch.relu(self.l2(torch.relu(self.l1(x)))))


def batch(step, rank=RANK):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 20, generator=g)
    return x, (x[:, :5].sum(1) > 0).long() + (x[:, 5] > 0.5).long() * 2


def build(policy, cap=0.004):
    torch.manual_seed(3)
    model = Net()
    opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      model=model, zero_stage=3, bucket_cap_mb=cap,
                                      mixed_precision=policy)
    return model, opt


def train(model, opt, steps, first=0, scaler=None, clip=None, passes=1):
    losses = []
    for step in range(first, first + steps):
        opt.zero_grad()
        total = 0.0
        for part in range(passes):
            x, y = batch(passes * step + part)
            loss = F.cross_entropy(model(x).float(), y) / passes
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach().item()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(mpiddp.allreduce(torch.tensor([total]), name=f"loss{step}").item())
    return losses


def close(a, b, rel=0.03):
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def check_losses():
    want = train(*build(None), 12)
    got = train(*build(BF16), 12)
    assert close(got, want), (got, want)
    assert got[-1] < got[0] * 0.9, got
    # GradScaler, clipping and two accumulated passes.
    kwargs = {"clip": 0.5, "passes": 2}
    want = train(*build(None), 6, scaler=torch.amp.GradScaler("cpu", init_scale=256.0),
                 **kwargs)
    got = train(*build(BF16), 6, scaler=torch.amp.GradScaler("cpu", init_scale=256.0),
                **kwargs)
    assert close(got, want), (got, want)
    checks.ok("bf16 parameters' losses within 3% of float32's over 12 Adam steps, and with "
              "GradScaler, clipping and accumulation", RANK)


def check_tied_frozen():
    """zero_model.Net: a tied weight, a frozen layer (its bucket bf16 too), a layer used every
    other step, integer inputs (not cast)."""
    losses = {}
    for policy in (None, BF16):
        torch.manual_seed(5)
        model = zero_model.Net()
        opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                          model=model, zero_stage=3, bucket_cap_mb=0.0005,
                                          mixed_precision=policy)
        losses[policy] = []
        for step in range(6):
            opt.zero_grad()
            tokens, labels = zero_model.batch(step, RANK)
            loss = F.cross_entropy(model(tokens, step).float(), labels)
            loss.backward()
            opt.step()
            losses[policy].append(loss.detach().item())
        if policy is not None:
            assert model.frozen.weight.dtype == torch.bfloat16
            assert model.state_dict()["frozen.weight"].dtype == torch.float32
    assert close(losses[BF16], losses[None]), losses
    checks.ok("a tied weight, a frozen layer and a layer used every other step in bf16", RANK)


def check_dtypes():
    model, opt = build(BF16)
    seen = []
    model.l2.register_forward_pre_hook(
        lambda module, args: seen.append((module.weight.dtype, args[0].dtype)))
    inputs = []
    model.register_forward_pre_hook(lambda module, args: inputs.append(args[0].dtype))
    train(model, opt, 2)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2, seen
    assert inputs == [torch.bfloat16] * 2, inputs     # (the policy's hook ran before this one)
    shards = [p for group in opt.param_groups for p in group["params"]]
    assert shards and all(p.dtype == torch.float32 for p in shards)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(s.dtype == torch.float32 for st in opt.state.values() for s in st.values()
               if torch.is_tensor(s) and s.numel() > 1)
    checks.ok("the shards and optimizer state float32, the parameters and the forward bf16",
              RANK)


def gather_bytes(policy):
    model, opt = build(policy)
    train(model, opt, 1)
    before = mpiddp.engine_stats()["sent_bytes"]
    with torch.no_grad():           # gathers every bucket once, then releases them
        model(batch(0)[0])
    return mpiddp.engine_stats()["sent_bytes"] - before


def check_bytes():
    full, half = gather_bytes(None), gather_bytes(BF16)
    assert half * 2 == full, (half, full)
    checks.ok(f"a forward's gathers send {half} bytes in bf16 against {full} in float32",
              RANK)


def masters_of(model, opt):
    """This rank's masters: name -> [(start, stop, shard)]."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for bucket in opt._mpiddp.layout.buckets:
        for piece in bucket.pieces:
            found.setdefault(names[id(piece.param)], []).append(piece)
    return found


def check_state_dict():
    model, opt = build(BF16)
    train(model, opt, 3)
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    for name, pieces in masters_of(model, opt).items():
        for piece in pieces:
            assert torch.equal(state[name].reshape(-1)[piece.start:piece.stop], piece.shard)
    rounded = any(not torch.equal(v, v.bfloat16().float()) for v in state.values())
    assert rounded, "the state dict holds bf16 values"
    opt.consolidate_state_dict(to=None)
    again = model.state_dict()
    assert all(torch.equal(again[k], state[k]) for k in state)
    # load_state_dict takes full precision values into the masters.
    other, _ = build(BF16)
    other.load_state_dict(state)
    loaded = other.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    checks.ok("model.state_dict() float32, equal to the masters (consolidated too); "
              "load_state_dict takes them at full precision", RANK)


def check_checkpoint():
    directory = mpiddp.broadcast_object(tempfile.mkdtemp(prefix="zero3-mixed-")
                                        if RANK == 0 else None)
    path = os.path.join(directory, "ckpt.pt")
    model, opt = build(BF16)
    train(model, opt, 3)
    mpiddp.Checkpoint(path, model=model, optimizer=opt).save(epoch=1)
    want = train(model, opt, 3, first=3)
    fresh, fresh_opt = build(BF16)
    assert mpiddp.Checkpoint(path, model=fresh, optimizer=fresh_opt).restore()
    got = train(fresh, fresh_opt, 3, first=3)
    assert got == want, (got, want)
    now, then = fresh.state_dict(), model.state_dict()
    assert all(torch.equal(now[k], then[k]) for k in then)
    mpiddp.barrier()
    if RANK == 0:
        shutil.rmtree(directory)
    checks.ok("an mpiddp.Checkpoint of a bf16 stage-3 run resumes bitwise", RANK)


def check_meta_and_takeover():
    """A model built on the meta device with a policy; a new optimizer (no policy) taking the
    model over gets the float32 masters back as its parameters."""
    with torch.device("meta"):
        model = Net()
    opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      model=model, zero_stage=3, bucket_cap_mb=0.004,
                                      mixed_precision=BF16)
    train(model, opt, 2)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    state = model.state_dict()
    del opt
    opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      model=model, zero_stage=3, bucket_cap_mb=0.004)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    now = model.state_dict()
    assert all(torch.equal(now[k], state[k]) for k in state)
    train(model, opt, 1)
    checks.ok("a meta-built model with a policy; a new optimizer takes the float32 masters "
              "over", RANK)


def check_refusals():
    model = Net()
    for stage in (0, 1, 2):
        try:
            mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        zero_stage=stage, mixed_precision=BF16)
        except ValueError as exc:
            assert "zero_stage=3" in str(exc), exc
        else:
            raise AssertionError(f"mixed precision at stage {stage}")
    try:
        mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    zero_stage=3, mixed_precision=BF16,
                                    compression=mpiddp.Compression.bf16)
    except ValueError as exc:
        assert "compression" in str(exc), exc
    else:
        raise AssertionError("mixed precision with compression")
    for dtype in (torch.int8, "bfloat16"):
        try:
            mpiddp.MixedPrecisionPolicy(param_dtype=dtype)
        except ValueError:
            pass
        else:
            raise AssertionError(dtype)
    checks.ok("mixed precision refused at stages 0-2, with compression and for a "
              "non-floating dtype", RANK)


check_losses()
check_tied_frozen()
check_dtypes()
check_bytes()
check_state_dict()
check_checkpoint()
check_meta_and_takeover()
check_refusals()
mpiddp.shutdown()
