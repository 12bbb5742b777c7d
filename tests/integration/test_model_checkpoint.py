"""Seed recipe 1 and deterministic resume, across real processes and real SNPX files (never pickle).

Each "fresh process" here is a real `python` child: parameters are compared by SHA-256 of their bytes, printed as
JSON by the child, so nothing but the checkpoint file carries state between processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from SneppX_ALG import checkpoint, errors
from SneppX_ALG.model import data, training
from SneppX_ALG.model import transformer as model_lib

RECIPE = "Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64)"


def run_python(code: str, *args: str) -> dict:
    """Runs code in a new interpreter; returns the JSON object it prints last."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def digests(params: dict[str, np.ndarray]) -> dict[str, str]:
    return {name: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for name, v in params.items()}


DIGESTS_SNIPPET = """
import hashlib, json
import numpy as np
def digests(params):
    return {n: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for n, v in params.items()}
"""


def test_recipe_one_save_in_one_process_load_in_another_is_bitwise_equal(tmp_path):
    path = str(tmp_path / "model.ckpt")
    saved = run_python(DIGESTS_SNIPPET + f"""
import sys
from SneppX_ALG import Transformer, SyntheticLanguage, Trainer

model = {RECIPE}
Trainer(model, SyntheticLanguage(num_sequences=64), batch_size=4).train(2)  # weights no init would give
model.save_checkpoint(sys.argv[1])       # SNPX, not a pickle
print(json.dumps(digests(model.params)))
""", path)
    loaded = run_python(DIGESTS_SNIPPET + f"""
import sys
from SneppX_ALG import Transformer

model = {RECIPE}
before = digests(model.params)
model.load_checkpoint(sys.argv[1])
print(json.dumps({{"before": before, "after": digests(model.params)}}))
""", path)
    assert loaded["after"] == saved
    assert loaded["before"] != saved  # the load really replaced the fresh model's weights
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89SNPX\r\n\x1a"
    ok, problems = checkpoint.validate_checkpoint(path)
    assert ok and problems == []


def test_recipe_one_checkpoint_holds_params_and_config_only(tmp_path):
    path = tmp_path / "model.ckpt"
    model = model_lib.Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512, max_seq_len=64)
    model.save_checkpoint(path)
    with checkpoint.CheckpointReader(path) as reader:
        assert set(reader.names()) == {f"params/{n}" for n in model.params}
        assert reader.config == model.config.to_json()
        assert reader.metadata["sneppx.training_state"] == "false"


def test_from_checkpoint_builds_the_architecture_that_was_saved(tmp_path):
    path = tmp_path / "m.snpx"
    original = model_lib.Transformer(vocab_size=37, dim=24, num_heads=3, num_layers=3, ffn_dim=40, max_seq_len=9,
                                     seed=11)
    original.save_checkpoint(path)
    rebuilt = model_lib.Transformer.from_checkpoint(path)
    assert rebuilt.config == original.config
    assert digests(rebuilt.params) == digests(original.params)
    tokens = np.arange(9).reshape(1, 9) % 37
    assert np.array_equal(rebuilt.forward(tokens), original.forward(tokens))


def test_loading_a_different_architecture_names_the_difference_and_changes_nothing(tmp_path):
    path = tmp_path / "m.snpx"
    model_lib.Transformer(vocab_size=50, dim=16, num_heads=2, num_layers=1, ffn_dim=32, max_seq_len=8).save_checkpoint(
        path)
    other = model_lib.Transformer(vocab_size=50, dim=16, num_heads=4, num_layers=2, ffn_dim=32, max_seq_len=8)
    before = digests(other.params)
    with pytest.raises(errors.ConfigMismatchError) as caught:
        other.load_checkpoint(path)
    assert "num_heads=2 (this model: 4)" in str(caught.value)
    assert "num_layers=1 (this model: 2)" in str(caught.value)
    assert "from_checkpoint" in str(caught.value)
    assert digests(other.params) == before


class CreatesFileWhenUnpickled:
    """A pickle payload: unpickling it calls open(marker, "w"), i.e. runs code from the file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_at_the_path_is_refused_and_none_of_its_code_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.ckpt"
    payload = {"param_data": {"tok_emb": np.zeros((2, 2), np.float32)}, "config": {},
               "evil": CreatesFileWhenUnpickled(str(marker))}
    path.write_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    model = model_lib.Transformer(vocab_size=1000, dim=128, num_heads=4, num_layers=2, ffn_dim=512,
                                  max_seq_len=64)
    before = digests(model.params)
    with pytest.raises(errors.UnsafeFormatError, match="(?i)pickle") as caught:
        model.load_checkpoint(path)
    assert caught.value.path == str(path)
    with pytest.raises(errors.UnsafeFormatError):
        model_lib.Transformer.from_checkpoint(path)
    assert not marker.exists(), "loading ran code from the pickle"
    assert digests(model.params) == before
    # Sanity check of the test itself, without unpickling anything: the payload's reduce callable creates the file.
    rebuild, args = CreatesFileWhenUnpickled(str(marker)).__reduce__()
    rebuild(*args)
    assert marker.exists()


def test_missing_and_corrupt_checkpoints_raise_typed_errors_and_change_nothing(tmp_path):
    model = model_lib.Transformer(vocab_size=50, dim=16, num_heads=2, num_layers=1, ffn_dim=32, max_seq_len=8)
    with pytest.raises(errors.CheckpointNotFoundError):
        model.load_checkpoint(tmp_path / "nothing-here.snpx")
    path = tmp_path / "m.snpx"
    model_lib.Transformer(vocab_size=50, dim=16, num_heads=2, num_layers=1, ffn_dim=32, max_seq_len=8,
                          seed=5).save_checkpoint(path)
    with checkpoint.CheckpointReader(path) as reader:
        offset = reader.entry("params/head.weight").offset
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    before = digests(model.params)
    with pytest.raises(errors.ChecksumMismatchError, match="head.weight"):
        model.load_checkpoint(path)
    assert digests(model.params) == before


def test_a_params_only_checkpoint_cannot_resume_training(tmp_path):
    path = tmp_path / "params-only.snpx"
    model = model_lib.Transformer(vocab_size=30, dim=16, num_heads=2, num_layers=1, ffn_dim=32, max_seq_len=8)
    model.save_checkpoint(path)
    training.Trainer(model, data.SyntheticLanguage(30, 8, 40), batch_size=8)
    with pytest.raises(errors.TrainingStateError, match="parameters only"):
        model.load_checkpoint(path, include_optimizer=True)
    model.load_checkpoint(path)  # parameters only, by default, is fine


RESUME_CHILD = DIGESTS_SNIPPET + """
import sys
from SneppX_ALG import SyntheticLanguage, Trainer, Transformer

mode, steps, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# 40 rows / batch 8 = 5 batches per epoch: both halves cross an epoch boundary, so the RNG must be restored.
model = Transformer(vocab_size=48, dim=32, num_heads=4, num_layers=2, ffn_dim=64, max_seq_len=16, seed=3)
trainer = Trainer(model, SyntheticLanguage(vocab_size=48, seq_len=16, num_sequences=40, seed=7), batch_size=8,
                  lr=3e-3, seed=1)
if mode == "resume":
    model.load_checkpoint(path, include_optimizer=True)
start = trainer.step
losses = trainer.train(steps)
if mode == "first":
    model.save_checkpoint(path, include_optimizer=True)
print(json.dumps({"start": start, "step": trainer.step, "losses": [repr(x) for x in losses],
                  "params": digests(model.params), "m": digests(trainer.optimizer.m)}))
"""


def test_resume_in_a_fresh_process_gives_bitwise_the_params_of_an_uninterrupted_run(tmp_path):
    n = 7
    path = str(tmp_path / "resume.snpx")
    straight = run_python(RESUME_CHILD, "straight", str(2 * n), "unused")
    first = run_python(RESUME_CHILD, "first", str(n), path)
    resumed = run_python(RESUME_CHILD, "resume", str(n), path)
    assert (first["step"], resumed["start"], resumed["step"]) == (n, n, 2 * n)
    assert resumed["losses"] == straight["losses"][n:]
    assert resumed["params"] == straight["params"]
    assert resumed["m"] == straight["m"]
    assert first["params"] != straight["params"]  # the halves really are different points of training
    with checkpoint.CheckpointReader(path) as reader:
        names = set(reader.names())
        assert {"optim/step", "data/order", "data/cursor", "data/epoch", "rng/pcg64"} <= names
        assert int(reader.read("optim/step")) == n
        assert reader.metadata["sneppx.training_state"] == "true"


def test_resuming_without_the_rng_and_data_position_would_diverge(tmp_path):
    """The control for the test above: restoring only params and moments is not enough to continue exactly."""
    n = 7
    path = str(tmp_path / "resume.snpx")
    straight = run_python(RESUME_CHILD, "straight", str(2 * n), "unused")
    run_python(RESUME_CHILD, "first", str(n), path)
    model = model_lib.Transformer(vocab_size=48, dim=32, num_heads=4, num_layers=2, ffn_dim=64, max_seq_len=16)
    trainer = training.Trainer(model, data.SyntheticLanguage(vocab_size=48, seq_len=16, num_sequences=40, seed=7),
                               batch_size=8, lr=3e-3, seed=1)
    with checkpoint.CheckpointReader(path) as reader:
        state = {name: np.array(reader.read(name)) for name in reader.names()}
    state.update(trainer.stream.state_dict())  # forget where the data stream was and its RNG
    model.load_state_dict(state)
    trainer.train(n)
    assert digests(model.params) != straight["params"]


def test_saving_over_a_checkpoint_replaces_it_whole_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "m.snpx"
    a = model_lib.Transformer(vocab_size=30, dim=16, num_heads=2, num_layers=1, ffn_dim=32, max_seq_len=8, seed=1)
    b = model_lib.Transformer(vocab_size=30, dim=16, num_heads=2, num_layers=1, ffn_dim=32, max_seq_len=8, seed=2)
    a.save_checkpoint(path)
    b.save_checkpoint(path)
    assert digests(model_lib.Transformer.from_checkpoint(path).params) == digests(b.params)
    assert [p for p in os.listdir(tmp_path) if p != "m.snpx"] == []  # no temporary files left behind
