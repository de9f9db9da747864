"""A Ray Train worker holds only its shard of the training rows (ttc/nets/shards.py): an
epoch's order, the same on every process, must give each process the rows of every batch it
holds, as many as the others' (to one), and be a local run's order with one process."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttc.nets.shards import Shard


def batches_of(order: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [order[i:i + size] for i in range(0, len(order), size)]


def test_one_process_draws_the_local_run_s_order():
    local = torch.randperm(37, generator=torch.Generator().manual_seed(3))
    assert torch.equal(Shard(37).order(torch.Generator().manual_seed(3)), local)
    rows = torch.tensor([5, 1, 9])
    assert torch.equal(Shard(37).local(rows), rows) and Shard(37).own(rows).all()


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 90), world=st.integers(1, 5), batch=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_every_process_trains_its_own_rows_of_every_batch(total, world, batch, seed):
    data = torch.arange(total) * 10  # row r's value is 10 r
    whole = Shard(total)
    orders = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(seed)
        orders.append(whole.of(rank, world).order(generator))
        assert torch.equal(generator.get_state(),  # every process leaves it alike
                           orders_state(whole.of(0, world), seed))
    assert all(torch.equal(order, orders[0]) for order in orders)  # the same on every process
    assert sorted(orders[0].tolist()) == list(range(total))  # a permutation of the rows
    held = [whole.of(rank, world).rows(data) for rank in range(world)]
    assert sum(len(rows) for rows in held) == total
    for part in batches_of(orders[0], batch):
        counts = []
        for rank in range(world):
            shard = whole.of(rank, world)
            mine = held[rank][shard.local(part)]
            assert torch.equal(mine, data[part[shard.own(part)]])  # its rows, in batch order
            counts.append(len(mine))
        assert sum(counts) == len(part) and max(counts) - min(counts) <= 1


def orders_state(shard: Shard, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shard.order(generator)
    return generator.get_state()


def test_a_batch_s_units_count_every_process_s_rows():
    shard = Shard(6, units=torch.tensor([3, 0, 2, 5, 1, 4])).of(1, 2)
    assert shard.units_of(torch.tensor([0, 3, 4])) == 9.0
    assert Shard(6).units_of(torch.tensor([0, 3, 4])) == 3.0
    assert [shard.size(rank) for rank in (0, 1)] == [3, 3] and Shard(7).of(0, 2).size() == 4


def test_a_shard_s_rows_are_a_contiguous_copy_of_its_part():
    """What the driver puts in the object store: only the shard's rows (a strided view would
    pickle the whole tensor's storage), and a list's items for a detector's boxes."""
    x = torch.arange(20.0).reshape(10, 2)
    part = Shard(10).of(1, 3).rows(x)
    assert part.is_contiguous() and part.untyped_storage().nbytes() == 3 * 2 * 4
    assert torch.equal(part, x[1::3])
    assert Shard(5).of(0, 2).rows(["a", "b", "c", "d", "e"]) == ["a", "c", "e"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_trailing_batch_kept_gives_each_process_two_rows(world):
    """EpochRunner keeps a trailing batch of at least 2 × world rows (BatchNorm needs two
    values per process): the interleaved order splits it evenly."""
    total, size = 10 * world + 2 * world, 10 * world
    order = Shard(total).of(0, world).order(torch.Generator().manual_seed(0))
    trailing = batches_of(order, size)[-1]
    assert [int(Shard(total).of(rank, world).own(trailing).sum())
            for rank in range(world)] == [2] * world


class Passing:
    """Process B of two: records what it contributes to the all-reduce."""

    rank, world = 1, 2

    def sum(self, values: list[float]) -> list[float]:
        self.values = values
        return values


class Adding:
    """Process A of two: its all-reduce adds B's contribution."""

    rank, world = 0, 2

    def __init__(self, other: list[float]) -> None:
        self.other = other

    def sum(self, values: list[float]) -> list[float]:
        return [a + b for a, b in zip(values, self.other)]


def test_the_workers_pooled_batchnorm_is_one_process_s_estimate_over_all_their_rows():
    """Each of two processes re-estimates BatchNorm on its own rows; pooled, the running
    statistics equal those one process estimates from all the rows (the same batches)."""
    from ttc.nets.epoch_loop import pool_batchnorm, recalibrate_batchnorm

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3),
                              torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.BatchNorm1d(4))
    x = torch.randn(40, 1, 4, 4) * 3 + 1
    whole, first, second = (copy_of(net) for _ in range(3))
    recalibrate_batchnorm(whole, x, batch_size=8)  # batches 0-7, 8-15, ...: 5 of them
    recalibrate_batchnorm(first, torch.cat([x[0:8], x[16:24], x[32:40]]), batch_size=8)
    recalibrate_batchnorm(second, torch.cat([x[8:16], x[24:32]]), batch_size=8)
    passing = Passing()
    pool_batchnorm(second, passing)
    pool_batchnorm(first, Adding(passing.values))
    for pooled, alone in zip(norms_of(first), norms_of(whole)):
        assert torch.allclose(pooled.running_mean, alone.running_mean, atol=1e-5)
        assert torch.allclose(pooled.running_var, alone.running_var, atol=1e-5)
    assert not torch.allclose(norms_of(second)[0].running_mean, norms_of(whole)[0].running_mean)


def copy_of(net: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(net)


def norms_of(net: torch.nn.Module) -> list:
    return [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
