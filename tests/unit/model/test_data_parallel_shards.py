"""The flat layout and shards of model/data_parallel.py, and data-parallel steps on in-process ranks (threads over
real loopback sockets). Real rank processes at world sizes 1-4 are tests/integration/test_data_parallel.py."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np
import pytest
from directory_store import DirectoryStore
from hypothesis import given
from hypothesis import strategies as st

from SneppX_ALG import collectives, errors
from SneppX_ALG.model import data, data_parallel, training, transformer

KEY = b"data-parallel-unit-test-key-0123"
TINY = {"vocab_size": 32, "dim": 16, "num_heads": 2, "num_layers": 1, "ffn_dim": 32, "max_seq_len": 8}
LANGUAGE = data.SyntheticLanguage(vocab_size=32, seq_len=8, num_sequences=64, seed=2)

shapes_strategy = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=6),
                                  st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
                                  min_size=1, max_size=8)


@given(shapes=shapes_strategy, bucket_bytes=st.integers(1, 4000), world=st.integers(1, 9))
def test_the_ranks_pieces_tile_every_tensor_exactly_once(shapes: dict[str, tuple[int, ...]], bucket_bytes: int,
                                                         world: int) -> None:
    layout = data_parallel.FlatLayout.build(shapes, 4, bucket_bytes)
    held = {name: np.zeros(math.prod(shape), int) for name, shape in shapes.items()}
    flat_held = np.zeros(layout.size, int)
    for rank in range(world):
        for piece in layout.pieces(world, rank):
            held[piece.name][piece.start:piece.stop] += 1
            flat_held[piece.flat_start:piece.flat_stop] += 1
            assert piece.flat_start == layout.offsets[piece.name] + piece.start
            assert piece.shape == shapes[piece.name]
    assert all((count == 1).all() for count in held.values())
    assert (flat_held == 1).all()


@given(shapes=shapes_strategy, bucket_bytes=st.integers(1, 4000))
def test_buckets_hold_whole_tensors_in_order_and_respect_their_size(shapes: dict[str, tuple[int, ...]],
                                                                    bucket_bytes: int) -> None:
    layout = data_parallel.FlatLayout.build(shapes, 4, bucket_bytes)
    assert [name for bucket in layout.buckets for name in bucket.names] == list(shapes)
    assert layout.buckets[0].start == 0 and layout.buckets[-1].stop == layout.size
    for before, after in zip(layout.buckets, layout.buckets[1:], strict=False):
        assert before.stop == after.start
    for bucket in layout.buckets:  # a bucket only overflows when one tensor alone is bigger
        assert (bucket.stop - bucket.start) * 4 <= bucket_bytes or len(bucket.names) == 1


def run_group(world: int, store_dir: str, body: Any) -> list[Any]:
    """body(group) on `world` threads, each a rank of a real TCP ProcessGroup; returns results or exceptions."""
    results: list[Any] = [None] * world

    def rank_main(rank: int) -> None:
        try:
            with collectives.ProcessGroup(DirectoryStore(store_dir), rank, world, key=KEY, timeout=120) as g:
                results[rank] = body(g)
        except Exception as e:  # noqa: BLE001 - handed to the test
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def test_one_rank_is_bitwise_the_plain_trainer(tmp_path: os.PathLike[str]) -> None:
    def body(group: collectives.ProcessGroup) -> Any:
        model = transformer.Transformer(**TINY, seed=1)
        trainer = data_parallel.DataParallelTrainer(model, LANGUAGE, group, batch_size=6, seed=4, bucket_bytes=512)
        return trainer.train(8), model, trainer

    [(losses, model, trainer)] = run_group(1, str(tmp_path), body)
    want_model = transformer.Transformer(**TINY, seed=1)
    want = training.Trainer(want_model, LANGUAGE, batch_size=6, seed=4)
    assert losses == want.train(8)
    for name, value in want_model.params.items():
        assert np.array_equal(model.params[name], value), name
        for ours, theirs in ((trainer.optimizer.m, want.optimizer.m), (trainer.optimizer.v, want.optimizer.v)):
            assert np.array_equal(ours[name], theirs[name].reshape(-1)), name  # one piece: the whole tensor
    assert trainer.step == want.step == 8


def test_more_ranks_than_rows_still_trains_the_global_batch(tmp_path: os.PathLike[str]) -> None:
    """A global batch of 2 rows on 3 ranks: one rank has no rows and contributes nothing, and the result is the
    single process's."""
    def body(group: collectives.ProcessGroup) -> Any:
        model = transformer.Transformer(**TINY, seed=1, dtype="float64")
        trainer = data_parallel.DataParallelTrainer(model, LANGUAGE, group, batch_size=2, seed=4)
        return trainer.train(5)

    results = run_group(3, str(tmp_path), body)
    assert not [r for r in results if isinstance(r, Exception)], results
    want = training.Trainer(transformer.Transformer(**TINY, seed=1, dtype="float64"), LANGUAGE, batch_size=2,
                            seed=4).train(5)
    assert results[0] == results[1] == results[2]
    np.testing.assert_allclose(results[0], want, rtol=1e-12)


def test_every_rank_starts_from_rank_0s_parameters(tmp_path: os.PathLike[str]) -> None:
    def body(group: collectives.ProcessGroup) -> Any:
        model = transformer.Transformer(**TINY, seed=group.rank)  # different on purpose
        data_parallel.DataParallelTrainer(model, LANGUAGE, group, batch_size=4)
        return model.params

    results = run_group(2, str(tmp_path), body)
    want = transformer.Transformer(**TINY, seed=0).params
    for params in results:
        assert all(np.array_equal(params[name], want[name]) for name in want)


def test_rows_longer_than_the_model_takes_are_refused(tmp_path: os.PathLike[str]) -> None:
    def body(group: collectives.ProcessGroup) -> Any:
        long_rows = data.SyntheticLanguage(vocab_size=32, seq_len=20, num_sequences=16)
        with pytest.raises(errors.ModelConfigError, match="max_seq_len"):
            data_parallel.DataParallelTrainer(transformer.Transformer(**TINY), long_rows, group)

    assert run_group(1, str(tmp_path), body) == [None]
