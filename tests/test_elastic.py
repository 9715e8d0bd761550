"""mpiddp.elastic: snapshots that restore on any rank count, and a sampler that trains every
sample of an interrupted epoch exactly once across a resize (docs/elastic.md)."""
from collections import Counter

import pytest
import torch

from mpi_launch import assert_ok, reported, run_mpi
from mpiddp.elastic import ElasticSampler, list_snapshots, write_durably
from mpiddp.torch.elastic import _newest_readable


def trained(dataset: int, batch: int, sizes_and_steps, seed=3) -> Counter:
    """Sample ids trained in one epoch by ranks of successive runs (size, steps to run)."""
    seen, consumed = Counter(), 0
    for size, steps in sizes_and_steps:
        samplers = [ElasticSampler(dataset, batch, seed=seed, rank=r, size=size)
                    for r in range(size)]
        for s in samplers:
            s.set_epoch(0, consumed=consumed)
        iterators = [iter(s) for s in samplers]
        for _ in range(steps):
            batches = [next(it, None) for it in iterators]
            if batches[0] is None:
                assert all(b is None for b in batches), "ranks ran different step counts"
                break
            for b in batches:
                seen.update(b)
        consumed = samplers[0].consumed
        assert all(s.consumed == consumed for s in samplers)
    return seen


@pytest.mark.parametrize("plan", [[(3, 4), (2, 100)], [(2, 1), (5, 3), (1, 100)],
                                  [(4, 100)], [(1, 7), (7, 100)]])
def test_every_sample_once_across_resizes(plan):
    seen = trained(101, 4, plan)
    assert sorted(seen) == list(range(101)), f"skipped: {set(range(101)) - set(seen)}"
    assert max(seen.values()) == 1, f"duplicated: {[i for i, n in seen.items() if n > 1]}"


def test_ranks_run_the_same_number_of_steps():
    for size in range(1, 9):
        lengths = {len(list(ElasticSampler(37, 3, rank=r, size=size))) for r in range(size)}
        assert len(lengths) == 1, f"{size} ranks: step counts {lengths}"


def test_a_half_written_snapshot_is_never_loaded(tmp_path):
    write_durably(str(tmp_path / "snapshot-3-a.pt"), _saved({"n": 3}))
    # A writer killed mid-write leaves only its temporary file behind:
    (tmp_path / "snapshot-4-b.pt.tmp123").write_bytes(_saved({"n": 4})[:20])
    # A file corrupted on disk after its rename is skipped for an older one.
    (tmp_path / "snapshot-5-c.pt").write_bytes(b"not a snapshot")
    assert sorted(n for n, _, _ in list_snapshots(str(tmp_path))) == [3, 5]
    assert _newest_readable(str(tmp_path)) == (3, {"n": 3})


def _saved(obj) -> bytes:
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def epoch_ids(directory) -> dict[int, Counter]:
    counts: dict[int, Counter] = {}
    for path in directory.glob("ids.*"):
        for line in path.read_text().splitlines():
            epoch, sample = map(int, line.split())
            counts.setdefault(epoch, Counter())[sample] += 1
    return counts


def test_resize_from_three_ranks_to_two(tmp_path):
    """3 ranks stop part-way through epoch 2; 2 ranks restore and finish: every epoch trains
    each of the 103 samples once, parameters and momentum are equal on every rank."""
    first = run_mpi("elastic_worker.py", 3, tmp_path, 3, "--stop-at", 12, timeout=120)
    assert_ok(first)
    stopped = reported(first, "stopped")[0]
    assert stopped == {"check": "stopped", "step": 12, "consumed": 36}, stopped
    second = run_mpi("elastic_worker.py", 2, tmp_path, 3, timeout=120)
    assert_ok(second)
    restored = reported(second, "restored")[0]
    assert restored["restored"] and restored["epoch"] == 1 and restored["consumed"] == 36, \
        restored
    ids = epoch_ids(tmp_path)
    assert sorted(ids) == [0, 1, 2]
    for epoch, counts in ids.items():
        assert sorted(counts) == list(range(103)), f"epoch {epoch}: samples skipped"
        assert max(counts.values()) == 1, \
            f"epoch {epoch}: duplicated {[i for i, n in counts.items() if n > 1]}"
    finished = reported(second, "finished")
    assert len(finished) == 2 and finished[0]["params"] == finished[1]["params"]
