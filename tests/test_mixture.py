"""Dataset mixtures: the realised proportions follow the weights, the order is a function of the
step alone (any mesh, O(1) resume), and each dataset is read in shuffled epochs."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import Dataset

from trainer.config import ConfigError, load_config
from trainer.data import mixture
from trainer.data.loader import build_dataloader
from trainer.data.mixture import MixtureDataset, MixtureOrder

WEIGHTS = [0.6, 0.3, 0.1]
SIZES = [50, 7, 23]


class Member(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i of member m is (tensor([m * 1000 + i]), ...): batches read as (member, index)."""

    def __init__(self, member: int, n: int) -> None:
        self.member, self.n = member, n
        self.seq_len, self.pad_id = 1, 0
        self.identity = {"samples_sha256": f"member{member}-{n}", "tokenizer_sha256": "t"}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        value = torch.tensor([self.member * 1000 + index])
        return value, value


def mixture_of(sizes=SIZES, weights=WEIGHTS) -> MixtureDataset:
    return MixtureDataset([Member(m, n) for m, n in enumerate(sizes)], [f"d{m}" for m in range(len(sizes))], weights)


def test_closed_form_counts_match_the_sequence() -> None:
    order = MixtureOrder(SIZES, WEIGHTS, 8, seed=0)
    running = [0, 0, 0]
    for position in range(3000):
        assert order.counts(position) == running
        running[order.dataset_at(position)] += 1
    # Far into the stream (and past a full period), counts of a window equal the window's members.
    for start in [12_345_678, (1 << mixture.PERIOD_BITS) - 100, 3 * (1 << mixture.PERIOD_BITS) + 17]:
        window = [order.dataset_at(p) for p in range(start, start + 500)]
        expected = [c + window.count(d) for d, c in enumerate(order.counts(start))]
        assert order.counts(start + 500) == expected


def test_proportions_follow_the_weights() -> None:
    order = MixtureOrder(SIZES, WEIGHTS, 8, seed=0)
    assert order.shares(1000) == pytest.approx(WEIGHTS, abs=2e-3)
    assert order.shares(100_000) == pytest.approx(WEIGHTS, abs=5e-5)
    # Every batch is mixed as evenly as 8 samples allow: never far from the expected counts.
    for step in random.Random(0).sample(range(10**6), 200):
        before, after = order.counts(step * 8), order.counts((step + 1) * 8)
        assert all(abs((a - b) - 8 * w) <= 2 for a, b, w in zip(after, before, WEIGHTS))
    # A dataset with a small weight still appears, spread over the run, not at its end.
    rare = MixtureOrder([10, 10], [0.99, 0.01], 8, seed=0)
    positions = [p for p in range(8 * 500) if rare.dataset_at(p) == 1]
    assert 35 <= len(positions) <= 45 and positions[0] < 8 * 20


def test_each_dataset_is_read_in_shuffled_epochs() -> None:
    dataset = mixture_of()
    order = dataset.order(8, seed=4)
    drawn: list[list[int]] = [[], [], []]
    for step in range(60):
        for index in order.batch(step):
            value = int(dataset[index][0])
            drawn[value // 1000].append(value % 1000)
    for member, size in enumerate(SIZES):
        epochs = [drawn[member][e * size : (e + 1) * size] for e in range(len(drawn[member]) // size)]
        assert epochs and all(sorted(epoch) == list(range(size)) for epoch in epochs)
        assert len({tuple(e) for e in epochs}) == len(epochs)  # reshuffled every epoch
    assert order.batch(3) == mixture_of().order(8, seed=4).batch(3)
    assert order.batch(3) != mixture_of().order(8, seed=5).batch(3)


def step_values(loader, steps: int) -> list[list[int]]:
    return [torch.cat([inputs for inputs, _ in loader.next_step()]).flatten().tolist() for _ in range(steps)]


@pytest.mark.parametrize(("dp", "lbs"), [(1, 8), (2, 2), (4, 1)])
def test_global_batches_do_not_depend_on_the_mesh_and_resume(dp: int, lbs: int) -> None:
    dataset = mixture_of()
    expected = [[int(dataset[i][0]) for i in dataset.order(8, 9).batch(step)] for step in range(6)]
    per_rank = []
    for rank in range(dp):
        loader = build_dataloader(
            dataset, microbatches=8 // (dp * lbs), local_batch_size=lbs, dp_rank=rank, dp_degree=dp, seed=9
        )
        per_rank.append([[mb[0].flatten().tolist() for mb in loader.next_step()] for _ in range(6)])
    for step in range(6):
        merged = [v for m in range(8 // (dp * lbs)) for rank in range(dp) for v in per_rank[rank][step][m]]
        assert merged == expected[step]
    # A checkpoint taken after 3 steps on one mesh resumes on this one with the same batches.
    first = build_dataloader(dataset, microbatches=4, local_batch_size=2, dp_rank=0, dp_degree=1, seed=9)
    step_values(first, 3)
    resumed = build_dataloader(dataset, microbatches=1, local_batch_size=8, dp_rank=0, dp_degree=1, seed=9)
    resumed.load_state_dict(first.state_dict())
    assert step_values(resumed, 3) == expected[3:]


def test_identity_covers_members_and_weights() -> None:
    """Other weights are other data under the key a refused resume names: `training.dataset_weights`."""
    base = mixture_of().identity
    assert mixture_of(weights=[6, 3, 1]).identity == base  # only the normalised shares count
    reweighted = mixture_of(weights=[0.5, 0.4, 0.1]).identity
    assert reweighted["samples_sha256"] == base["samples_sha256"]
    assert (base["training.dataset_weights"], reweighted["training.dataset_weights"]) == (
        "0.6, 0.3, 0.1",
        "0.5, 0.4, 0.1",
    )
    assert mixture_of(sizes=[50, 7, 24]).identity["samples_sha256"] != base["samples_sha256"]


def test_config_errors_name_the_keys() -> None:
    assert load_config(
        ["--training.dataset_path", "a,b", "--training.dataset_weights", "2,1"]
    ).training.dataset_weights == (2.0, 1.0)
    for argv, match in [
        (["--training.dataset_path", "a,b", "--training.dataset_weights", "1"], "dataset_weights` has 1 weight"),
        (["--training.dataset_path", "a,b", "--training.dataset_weights", "1,0"], "must all be > 0"),
        (["--training.dataset_path", "a,b", "--training.dataset_weights", "1,inf"], "finite"),
        (["--training.dataset_path", "a,b", "--training.dataset_weights", "1,x"], "comma-separated numbers"),
        (["--training.dataset_path", "a,a"], "names a path twice"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(argv)
