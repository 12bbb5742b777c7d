"""Training the reference model: the generated language, the data position, and that the model really learns."""

from __future__ import annotations

import math

import numpy as np
import pytest

from SneppX_ALG import errors
from SneppX_ALG.model import data, training
from SneppX_ALG.model import transformer as model_lib


def test_synthetic_language_is_deterministic_and_follows_its_grammar():
    lang = data.SyntheticLanguage(vocab_size=40, seq_len=16, num_sequences=64, seed=3)
    tokens = lang.generate()
    assert tokens.shape == (64, 17) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, lang.generate())
    assert not np.array_equal(tokens, data.SyntheticLanguage(40, 16, 64, seed=4).generate())
    table = lang.successors()
    assert all(len(set(row)) == len(row) for row in table.tolist())
    # Every transition in the data is one the grammar allows.
    allowed = np.zeros((40, 40), bool)
    allowed[np.arange(40)[:, None], table] = True
    assert allowed[tokens[:, :-1], tokens[:, 1:]].all()


def test_loss_floor_is_the_entropy_of_the_successor_choice():
    probs = np.array(data.SUCCESSOR_PROBS)
    assert data.SyntheticLanguage().loss_floor == pytest.approx(-(probs * np.log(probs)).sum())
    assert 0 < data.SyntheticLanguage().loss_floor < math.log(len(probs))


def test_data_stream_reshuffles_each_epoch_and_restores_its_position():
    tokens = np.arange(40, dtype=np.int32).reshape(10, 4)
    stream = data.DataStream(tokens, batch_size=3, seed=1)
    first_epoch = np.concatenate([stream.next_batch()[:, 0] // 4 for _ in range(3)])
    assert len(set(first_epoch.tolist())) == 9  # 3 full batches of 10 rows; the partial one is dropped
    for _ in range(2):
        stream.next_batch()  # into epoch 1
    assert stream.epoch == 1
    saved = {k: np.array(v) for k, v in stream.state_dict().items()}
    expected = [stream.next_batch() for _ in range(6)]  # crosses into epoch 2: needs the RNG state too

    resumed = data.DataStream(tokens, batch_size=3, seed=99)
    resumed.load_state_dict(saved)
    for batch in expected:
        np.testing.assert_array_equal(resumed.next_batch(), batch)


def test_data_stream_refuses_a_position_from_other_data_or_batch_size():
    tokens = data.SyntheticLanguage(vocab_size=20, seq_len=4, num_sequences=12).generate()
    state = data.DataStream(tokens, batch_size=4).state_dict()
    with pytest.raises(errors.TrainingStateError, match="different data set"):
        data.DataStream(tokens + 1, batch_size=4).load_state_dict(state)
    with pytest.raises(errors.TrainingStateError, match="batch_size 4"):
        data.DataStream(tokens, batch_size=3).load_state_dict(state)
    with pytest.raises(errors.TrainingStateError, match="permutation"):
        data.DataStream(tokens, batch_size=4).load_state_dict(
            dict(state, **{"data/order": np.zeros(12, np.int64)}))


def test_pcg64_state_round_trips_through_six_words():
    rng = np.random.Generator(np.random.PCG64(12345))
    rng.random(7)
    rng.integers(0, 10, dtype=np.uint32)  # leaves a buffered 32-bit half
    words = data.encode_pcg64(rng.bit_generator.state)
    assert words.dtype == np.uint64 and words.shape == (6,)
    other = np.random.Generator(np.random.PCG64())
    other.bit_generator.state = data.decode_pcg64(words)
    assert other.random(5).tolist() == rng.random(5).tolist()
    with pytest.raises(errors.TrainingStateError):
        data.decode_pcg64(np.array([1, 2, 4, 0, 7, 0], np.uint64))


def test_learning_rate_warms_up_linearly_then_stays():
    assert [training.learning_rate(s, 1.0, 4) for s in (1, 2, 4, 10)] == [0.25, 0.5, 1.0, 1.0]
    assert training.learning_rate(1, 0.3, 0) == 0.3


def test_clip_by_global_norm_scales_all_gradients_together():
    grads = {"a": np.array([3.0]), "b": np.array([4.0])}
    assert training.clip_by_global_norm(grads, 1.0) == pytest.approx(5.0)
    assert math.hypot(grads["a"][0], grads["b"][0]) == pytest.approx(1.0, rel=1e-5)
    assert grads["a"][0] / grads["b"][0] == pytest.approx(0.75)


def test_training_drives_the_loss_well_below_its_start_in_bounded_steps():
    model = model_lib.Transformer(vocab_size=64, dim=32, num_heads=4, num_layers=2, ffn_dim=128, max_seq_len=32)
    lang = data.SyntheticLanguage(vocab_size=64, seq_len=32, num_sequences=512, seed=0)
    trainer = training.Trainer(model, lang, batch_size=8, lr=3e-3)
    held_out = data.SyntheticLanguage(vocab_size=64, seq_len=32, num_sequences=64, seed=0).generate()
    start = model.loss(held_out)
    assert start == pytest.approx(math.log(64), abs=0.2)
    losses = trainer.train(150)
    end = model.loss(held_out)
    assert trainer.step == 150 and len(losses) == 150
    # Uniform guessing costs ln(64) = 4.16 nats; the grammar's floor is 1.03. Learning the bigram table gets
    # most of the way: well below half the starting loss.
    assert end < 0.5 * start, f"loss went from {start:.3f} to {end:.3f} in 150 steps"
    assert end > lang.loss_floor - 0.05  # no model beats the entropy of the data (a sanity check on the loss)


def test_trainer_refuses_data_longer_than_the_model_context():
    model = model_lib.Transformer(vocab_size=20, dim=8, num_heads=2, num_layers=1, ffn_dim=8, max_seq_len=4)
    with pytest.raises(errors.ModelConfigError, match="max_seq_len"):
        training.Trainer(model, data.SyntheticLanguage(vocab_size=20, seq_len=8, num_sequences=8))


def test_trainer_state_round_trip_continues_bitwise_in_process():
    def fresh() -> training.Trainer:
        model = model_lib.Transformer(vocab_size=30, dim=16, num_heads=2, num_layers=1, ffn_dim=32,
                                      max_seq_len=8, seed=2)
        return training.Trainer(model, data.SyntheticLanguage(30, 8, 40, seed=1), batch_size=8, seed=5)

    straight = fresh()
    straight.train(12)  # 5 batches per epoch: crosses two epoch boundaries
    first = fresh()
    first.train(6)
    saved = {k: np.array(v) for k, v in first.model.state_dict(include_optimizer=True).items()}
    second = fresh()
    second.model.load_state_dict(saved)
    assert second.step == 6
    second.train(6)
    for name, value in straight.model.params.items():
        assert value.tobytes() == second.model.params[name].tobytes(), name


def test_state_dict_carries_the_training_state_by_default_once_a_trainer_is_attached():
    model = model_lib.Transformer(vocab_size=30, dim=16, num_heads=2, num_layers=1, ffn_dim=32, max_seq_len=8)
    assert all(name.startswith("params/") for name in model.state_dict())
    training.Trainer(model, data.SyntheticLanguage(30, 8, 40), batch_size=8).train(1)
    names = set(model.state_dict())
    assert {"optim/step", "optim/m/tok_emb", "data/order", "data/cursor", "rng/pcg64"} <= names
    assert all(name.startswith("params/") for name in model.state_dict(include_optimizer=False))
