"""The reference Transformer: shapes, causality, hand-written gradients against finite differences, AdamW, state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from SneppX_ALG import errors
from SneppX_ALG.model import optimizer
from SneppX_ALG.model import transformer as model_lib

TINY = {"vocab_size": 11, "dim": 8, "num_heads": 2, "num_layers": 2, "ffn_dim": 12, "max_seq_len": 6}


def perturbed_tiny_model(dtype: str = "float64") -> model_lib.Transformer:
    """A tiny model whose LayerNorm gains and biases are not 1 / 0, so every gradient term is exercised."""
    model = model_lib.Transformer(**TINY, seed=1, dtype=dtype)
    rng = np.random.default_rng(7)
    for value in model.params.values():
        value += (rng.standard_normal(value.shape) * 0.1).astype(value.dtype)
    return model


def test_recipe_one_constructor_builds_the_documented_architecture():
    model = model_lib.Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64)
    assert model.params["tok_emb"].shape == (1000, 128)
    assert model.params["blocks.1.attn.qkv.weight"].shape == (128, 384)
    assert model.params["blocks.0.ffn.in.weight"].shape == (128, 512)
    assert model.params["head.weight"].shape == (128, 1000)
    assert all(v.dtype == np.float32 for v in model.params.values())
    # 2 * (4*128^2 + 4*128 (attn) + 2*128*512 + 512 + 128 (ffn) + 4*128 (ln)) + embeddings + ln_f + head
    per_block = 4 * 128 * 128 + 4 * 128 + 2 * 128 * 512 + 512 + 128 + 4 * 128
    assert model.num_params == 2 * per_block + 1000 * 128 + 64 * 128 + 2 * 128 + 128 * 1000


def test_forward_gives_logits_per_position_and_loss_starts_near_uniform():
    model = model_lib.Transformer(vocab_size=50, dim=16, num_heads=4, num_layers=1, ffn_dim=32, max_seq_len=10)
    tokens = np.random.default_rng(0).integers(0, 50, (3, 10))
    assert model.forward(tokens).shape == (3, 10, 50)
    assert model.forward(tokens[0]).shape == (1, 10, 50)
    # Small initial weights: predictions are close to uniform, so the loss is close to ln(vocab).
    assert abs(model.loss(np.random.default_rng(1).integers(0, 50, (4, 11))) - math.log(50)) < 0.1


def test_attention_is_causal_a_later_token_never_changes_earlier_logits():
    model = perturbed_tiny_model("float32")
    tokens = np.array([[1, 2, 3, 4, 5, 6]])
    changed = tokens.copy()
    changed[0, 4] = 9
    before, after = model.forward(tokens), model.forward(changed)
    np.testing.assert_array_equal(before[0, :4], after[0, :4])
    assert not np.allclose(before[0, 4:], after[0, 4:])


def test_same_seed_same_parameters_different_seed_different_parameters():
    a, b, c = (model_lib.Transformer(**TINY, seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert not np.array_equal(a.params["tok_emb"], c.params["tok_emb"])


def test_every_parameter_gradient_matches_central_finite_differences_in_float64():
    model = perturbed_tiny_model("float64")
    tokens = np.random.default_rng(3).integers(0, TINY["vocab_size"], (3, TINY["max_seq_len"] + 1))
    loss, grads = model.loss_and_grads(tokens)
    assert loss == model.loss(tokens)
    assert set(grads) == set(model.params)
    eps = 1e-6
    for name, value in model.params.items():
        numeric = np.zeros_like(value)
        flat, nflat = value.reshape(-1), numeric.reshape(-1)
        for i in range(flat.size):
            saved = flat[i]
            flat[i] = saved + eps
            plus = model.loss(tokens)
            flat[i] = saved - eps
            minus = model.loss(tokens)
            flat[i] = saved
            nflat[i] = (plus - minus) / (2 * eps)
        assert grads[name].shape == value.shape
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8, err_msg=f"gradient of {name}")


def test_float32_gradients_agree_with_float64_gradients():
    model64 = perturbed_tiny_model("float64")
    model32 = model_lib.Transformer(**TINY, dtype="float32")
    for name, value in model64.params.items():
        model32.params[name][...] = value.astype(np.float32)
    tokens = np.random.default_rng(4).integers(0, TINY["vocab_size"], (2, 7))
    loss64, grads64 = model64.loss_and_grads(tokens)
    loss32, grads32 = model32.loss_and_grads(tokens)
    assert abs(loss64 - loss32) < 1e-5
    for name in grads64:
        np.testing.assert_allclose(grads32[name], grads64[name], atol=2e-5, err_msg=name)


def test_explicit_targets_equal_the_shifted_form():
    model = perturbed_tiny_model("float32")
    tokens = np.random.default_rng(5).integers(0, 11, (2, 7))
    assert model.loss(tokens) == model.loss(tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("tokens, message", [
    (np.array([[1.5, 2.0]]), "integer"),
    (np.zeros((2, 2, 2), np.int64), "1-D or 2-D"),
    (np.array([[0, 11]]), "outside 0..10"),
    (np.array([[-1, 3]]), "outside 0..10"),
    (np.zeros((1, 8), np.int64), "length 8 is outside 1..7"),
    (np.zeros((1, 1), np.int64), "at least 2"),
])
def test_bad_tokens_raise_a_typed_error_that_says_what_is_wrong(tokens, message):
    model = model_lib.Transformer(**TINY)
    with pytest.raises(errors.ModelInputError, match=message):
        model.loss(tokens)


@pytest.mark.parametrize("kwargs, message", [
    ({"dim": 10, "num_heads": 4}, "divisible"),
    ({"num_layers": 0}, "num_layers must be a positive int"),
    ({"dtype": "float16"}, "dtype"),
])
def test_bad_config_raises_model_config_error(kwargs, message):
    with pytest.raises(errors.ModelConfigError, match=message):
        model_lib.Transformer(**{**TINY, **kwargs})


def test_adamw_first_step_matches_the_published_update_rule():
    params = {"w": np.array([[1.0, -2.0]]), "b": np.array([0.5])}
    grads = {"w": np.array([[0.1, -0.3]]), "b": np.array([2.0])}
    opt = optimizer.AdamW(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    expected = {}
    for name, value in params.items():
        g = grads[name]
        m, v = 0.1 * g, 0.001 * g * g
        mhat, vhat = m / 0.1, v / 0.001
        decay = 1 - 0.01 * 0.1 if value.ndim >= 2 else 1.0
        expected[name] = value * decay - 0.01 * mhat / (np.sqrt(vhat) + 1e-8)
    opt.step(params, {k: g.copy() for k, g in grads.items()})
    assert opt.step_count == 1
    for name, value in params.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-12)
    np.testing.assert_allclose(opt.m["w"], 0.1 * grads["w"])


def test_adamw_state_dict_round_trips_and_rejects_a_wrong_shape():
    params = {"w": np.ones((2, 3), np.float32)}
    opt = optimizer.AdamW(params)
    opt.step(params, {"w": np.full((2, 3), 0.5, np.float32)})
    other = optimizer.AdamW(params)
    other.load_state_dict({k: v.copy() for k, v in opt.state_dict().items()})
    assert other.step_count == 1
    np.testing.assert_array_equal(other.v["w"], opt.v["w"])
    bad = dict(opt.state_dict(), **{"optim/m/w": np.zeros((3, 2), np.float32)})
    with pytest.raises(errors.TrainingStateError, match="optim/m/w"):
        other.load_state_dict(bad)


def test_state_dict_round_trip_is_bitwise_and_a_misfit_changes_nothing():
    source = perturbed_tiny_model("float32")
    target = model_lib.Transformer(**TINY, seed=9)
    state = {k: v.copy() for k, v in source.state_dict().items()}
    assert all(k.startswith("params/") for k in state)
    target.load_state_dict(state)
    for name in source.params:
        assert source.params[name].tobytes() == target.params[name].tobytes()

    before = {k: v.copy() for k, v in target.params.items()}
    wrong_shape = dict(state, **{"params/tok_emb": np.zeros((12, 8), np.float32)})
    with pytest.raises(errors.ConfigMismatchError, match="tok_emb"):
        target.load_state_dict(wrong_shape)
    missing = {k: v for k, v in state.items() if k != "params/ln_f.bias"}
    with pytest.raises(errors.ConfigMismatchError, match="ln_f.bias"):
        target.load_state_dict(missing)
    assert all(np.array_equal(before[k], target.params[k]) for k in before)


def test_optimizer_state_without_a_trainer_is_a_typed_error():
    model = model_lib.Transformer(**TINY)
    with pytest.raises(errors.TrainingStateError, match="no trainer"):
        model.state_dict(include_optimizer=True)
    with pytest.raises(errors.TrainingStateError, match="no trainer"):
        model.load_state_dict(model.state_dict(), include_optimizer=True)


def test_config_json_round_trips_and_foreign_configs_are_refused():
    config = model_lib.ModelConfig(**TINY)
    assert model_lib.ModelConfig.from_json(config.to_json()) == config
    with pytest.raises(errors.ModelConfigError, match="not a sneppx.Transformer config"):
        model_lib.ModelConfig.from_json({"layers": 3})
    with pytest.raises(errors.ModelConfigError, match="unknown keys"):
        model_lib.ModelConfig.from_json(dict(config.to_json(), extra=1))


def test_a_batch_split_over_threads_gives_the_loss_and_gradients_of_the_whole_batch():
    # With two BLAS threads a large enough batch runs as two parts on two threads (Transformer docstring,
    # "Cores"); each part's terms are over the whole batch's tokens, so the sums are the whole batch's values.
    threadpoolctl = pytest.importorskip("threadpoolctl")
    model = perturbed_tiny_model("float64")
    tokens = np.random.default_rng(6).integers(0, TINY["vocab_size"], (101, TINY["max_seq_len"] + 1))
    assert len(model_lib.batch_parts(101, TINY["max_seq_len"], 2)) == 2
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        whole_loss, whole_grads = model.loss_and_grads(tokens)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        split_loss, split_grads = model.loss_and_grads(tokens)
        assert model.loss(tokens) == split_loss  # loss() splits the same way: the same bits
    assert split_loss == pytest.approx(whole_loss, rel=1e-12)
    for name, grad in whole_grads.items():
        np.testing.assert_allclose(split_grads[name], grad, rtol=1e-9, atol=1e-14, err_msg=name)


def test_batch_parts_cover_every_row_once_and_keep_small_batches_whole():
    assert model_lib.batch_parts(16, 64, 2) == [(0, 8), (8, 16)]
    assert model_lib.batch_parts(7, 128, 3) == [(0, 2), (2, 4), (4, 7)]
    assert model_lib.batch_parts(12, 16, 2) == [(0, 12)]  # 192 tokens: one part
    assert model_lib.batch_parts(3, 1000, 8) == [(0, 1), (1, 2), (2, 3)]  # never more parts than rows
