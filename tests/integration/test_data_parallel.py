"""Data-parallel training with ZeRO-1 on real rank processes: the losses do not depend on the world size."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import collective_workers as workers
import numpy as np
import pytest

from SneppX_ALG.model import data, training, transformer

if TYPE_CHECKING:
    from conftest import Ranks

pytestmark = pytest.mark.timeout(600)
STEPS = 20


def train(ranks: Ranks, store_dir: str, world: int, bucket_bytes: int = 4096) -> dict[int, Any]:
    for rank in range(world):
        ranks.start(rank, workers.train_data_parallel, store_dir, rank, world, STEPS, bucket_bytes, ranks.results)
    reports = {report[0]: report for report in (ranks.get() for _ in range(world))}
    failed = {rank: report[1] for rank, report in reports.items() if len(report) == 2}
    assert not failed, failed
    return reports


@pytest.fixture(scope="module")
def single_process() -> tuple[list[float], transformer.Transformer, training.Trainer]:
    """The same training on one process with the plain Trainer: what every world size must reproduce."""
    model = transformer.Transformer(**workers.TINY_MODEL, seed=3)
    trainer = training.Trainer(model, data.SyntheticLanguage(**workers.TINY_DATA), **workers.TRAINING)
    return trainer.train(STEPS), model, trainer


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_losses_and_state_match_a_single_process_at_every_world_size(
        tmp_path: os.PathLike[str], ranks: Ranks, world: int,
        single_process: tuple[list[float], transformer.Transformer, training.Trainer]) -> None:
    want_losses, want_model, want_trainer = single_process
    reports = train(ranks, str(tmp_path), world)
    losses, params = reports[0][1], reports[0][2]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert losses[-1] < losses[0] - 0.5  # it learns
    for rank in range(world):
        _, their_losses, their_params, _, position = reports[rank]
        assert their_losses == losses  # the global loss is allreduced: the same bits everywhere
        assert all(np.array_equal(their_params[name], params[name]) for name in params)  # allgathered
        # the data position is the single process's, whatever the world size
        assert {k: v.tolist() for k, v in position.items()} == {
            k: v.tolist() for k, v in want_trainer.stream.state_dict().items()}
    for name, value in params.items():
        np.testing.assert_allclose(value, want_model.params[name], rtol=1e-4, atol=1e-5)
    # The ranks' moment pieces tile every tensor exactly once and put together are the single process's moments.
    for kind, want in (("m", want_trainer.optimizer.m), ("v", want_trainer.optimizer.v)):
        for name, full in want.items():
            assembled = np.full(full.size, np.nan, full.dtype)
            for rank in range(world):
                for piece_name, start, stop, m, v in reports[rank][3]:
                    if piece_name == name:
                        assert np.isnan(assembled[start:stop]).all(), f"{name}[{start}:{stop}] held twice"
                        assembled[start:stop] = m if kind == "m" else v
            assert not np.isnan(assembled).any(), f"part of {name} is held by no rank"
            np.testing.assert_allclose(assembled, full.reshape(-1), rtol=1e-3, atol=1e-7)
    if world == 1:  # one rank does exactly what the plain Trainer does
        assert losses == want_losses
        assert all(np.array_equal(params[name], want_model.params[name]) for name in params)
