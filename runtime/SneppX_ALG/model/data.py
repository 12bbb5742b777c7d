"""The reference data: a generated language with a known loss floor, and a data stream whose position is
part of the training state.

- `SyntheticLanguage` generates the data set (no download): a seeded tiny grammar in which every token has a
  few possible successors with fixed probabilities. A small model visibly learns it, and its entropy is the
  lowest loss any model can reach (`loss_floor`), so a learning curve has a known target.
- `DataStream` hands out batches in a shuffled order per epoch. Its position (epoch, cursor, the epoch's order)
  and its RNG state are tensors in the training state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from SneppX_ALG import _native, errors

# Successor probabilities of the grammar: a few likely continuations, like word choice in a sentence.
SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)


@dataclasses.dataclass(frozen=True)
class SyntheticLanguage:
    """A seeded synthetic language: `num_sequences` windows of `seq_len + 1` token ids.

    Each token id has len(SUCCESSOR_PROBS) successors drawn at random once per seed; a sentence starts at a random
    token and picks each next token among its predecessor's successors with SUCCESSOR_PROBS. Generation is
    vectorised over sequences (one step per position), so the data set costs milliseconds to make.
    """

    vocab_size: int = 1000
    seq_len: int = 64
    num_sequences: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "num_sequences"):
            if getattr(self, field) < 1:
                raise errors.ModelConfigError(f"SyntheticLanguage.{field} must be >= 1, got {getattr(self, field)}")
        if self.vocab_size < len(SUCCESSOR_PROBS):
            raise errors.ModelConfigError(f"vocab_size must be >= {len(SUCCESSOR_PROBS)} for the grammar")

    @property
    def loss_floor(self) -> float:
        """The entropy of the next token (nats): no model can do better on average."""
        probs = np.array(SUCCESSOR_PROBS)
        return float(-(probs * np.log(probs)).sum())

    def successors(self) -> np.ndarray:
        """(vocab, branching) table: the possible next tokens of each token, distinct within a row."""
        rng = np.random.Generator(np.random.PCG64([self.seed, 1]))
        table = rng.integers(0, self.vocab_size, (self.vocab_size, len(SUCCESSOR_PROBS)), dtype=np.int32)
        while True:  # redraw rows that picked a successor twice (few, and fewer each round)
            ordered = np.sort(table, axis=1)
            repeated = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
            if not repeated.size:
                return table
            table[repeated] = rng.integers(0, self.vocab_size, (repeated.size, table.shape[1]), dtype=np.int32)

    def generate(self) -> np.ndarray:
        """(num_sequences, seq_len + 1) int32 token ids; the same array for the same fields, in any process."""
        rng = np.random.Generator(np.random.PCG64([self.seed, 2]))
        table = self.successors()
        cumulative = np.cumsum(SUCCESSOR_PROBS)
        tokens = np.empty((self.num_sequences, self.seq_len + 1), np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab_size, self.num_sequences)
        choices = np.searchsorted(cumulative, rng.random((self.num_sequences, self.seq_len)), side="right")
        choices = np.minimum(choices, len(SUCCESSOR_PROBS) - 1)  # guards the float edge of the last bucket
        for position in range(self.seq_len):  # one vectorised step per position, over all sequences
            tokens[:, position + 1] = table[tokens[:, position], choices[:, position]]
        return tokens


def fingerprint(tokens: np.ndarray) -> int:
    """CRC32C of a data set's bytes: a resumed run checks it trains on the same data."""
    return _native.crc32c(np.ascontiguousarray(tokens))


# --- the data position ----------------------------------------------------------------------------------------------


class DataStream:
    """Batches of rows from a (rows, seq) token array, reshuffled every epoch, with a saveable position.

    The order of each epoch is drawn from the stream's own RNG when the epoch starts; the position is (epoch,
    cursor into that order). `state_dict()` holds all of it, so a restored stream yields the same batches.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seed: int = 0):
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise errors.ModelInputError(f"tokens must be a 2-D integer array, got {tokens.dtype}{tokens.shape}")
        if not 1 <= batch_size <= tokens.shape[0]:
            raise errors.ModelConfigError(f"batch_size {batch_size} must be in 1..{tokens.shape[0]} (rows)")
        self.tokens = tokens
        self.batch_size = batch_size
        self.fingerprint = fingerprint(tokens)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.epoch = 0
        self.cursor = 0
        self.order = self.rng.permutation(tokens.shape[0])

    @property
    def batches_per_epoch(self) -> int:
        return self.tokens.shape[0] // self.batch_size

    def next_batch(self) -> np.ndarray:
        """The next (batch_size, seq) batch; a new shuffled epoch starts when the current one can't fill one."""
        if self.cursor + self.batch_size > len(self.order):
            self.epoch += 1
            self.cursor = 0
            self.order = self.rng.permutation(self.tokens.shape[0])
        rows = self.order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return self.tokens[rows]

    def state_dict(self) -> dict[str, np.ndarray]:
        return {
            "data/epoch": np.array(self.epoch, np.int64),
            "data/cursor": np.array(self.cursor, np.int64),
            "data/order": self.order.astype(np.int64),
            "data/batch_size": np.array(self.batch_size, np.int64),
            "data/fingerprint": np.array(self.fingerprint, np.uint32),
            "rng/pcg64": encode_pcg64(self.rng.bit_generator.state),
        }

    def check_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Raises TrainingStateError unless `state` is a position in this same data set with this batch size."""
        for name, shape in (("data/epoch", ()), ("data/cursor", ()), ("data/batch_size", ()),
                            ("data/fingerprint", ()), ("data/order", (self.tokens.shape[0],)), ("rng/pcg64", (6,))):
            value = state.get(name)
            if value is None or value.shape != shape:
                found = "missing" if value is None else f"of shape {list(value.shape)}"
                raise errors.TrainingStateError(f"training state tensor {name} is {found}, needs shape {list(shape)}")
        if int(state["data/fingerprint"]) != self.fingerprint:
            raise errors.TrainingStateError(
                f"the checkpoint was trained on a different data set (fingerprint {int(state['data/fingerprint']):#010x}"
                f", this one {self.fingerprint:#010x}): resuming would not continue the same run")
        if int(state["data/batch_size"]) != self.batch_size:
            raise errors.TrainingStateError(
                f"the checkpoint used batch_size {int(state['data/batch_size'])}, this run {self.batch_size}")
        order = state["data/order"]
        if not np.array_equal(np.sort(order), np.arange(self.tokens.shape[0])):
            raise errors.TrainingStateError("data/order is not a permutation of the data set's rows")
        if not 0 <= int(state["data/cursor"]) <= len(order) or int(state["data/epoch"]) < 0:
            raise errors.TrainingStateError("data/cursor or data/epoch is out of range")
        decode_pcg64(state["rng/pcg64"])  # raises on a malformed RNG state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.check_state_dict(state)
        self.epoch = int(state["data/epoch"])
        self.cursor = int(state["data/cursor"])
        self.order = np.array(state["data/order"], np.int64)
        self.rng.bit_generator.state = decode_pcg64(state["rng/pcg64"])


_U64 = (1 << 64) - 1


def encode_pcg64(state: Mapping[str, Any]) -> np.ndarray:
    """numpy's PCG64 state (two 128-bit ints and a buffered 32-bit value) as six uint64s."""
    inner = state["state"]
    return np.array([inner["state"] & _U64, inner["state"] >> 64, inner["inc"] & _U64, inner["inc"] >> 64,
                     state["has_uint32"], state["uinteger"]], np.uint64)


def decode_pcg64(words: np.ndarray) -> dict[str, Any]:
    """The inverse of encode_pcg64; TrainingStateError for anything numpy's PCG64 would not accept."""
    if words.shape != (6,) or words.dtype != np.uint64:
        raise errors.TrainingStateError(f"rng/pcg64 must be 6 uint64 words, got {words.dtype}{list(words.shape)}")
    w = [int(x) for x in words]
    if w[4] not in (0, 1) or w[5] > 0xFFFFFFFF or not w[2] & 1:
        raise errors.TrainingStateError("rng/pcg64 is not a valid PCG64 state (bad flag, buffer or increment)")
    return {"bit_generator": "PCG64", "state": {"state": w[0] | w[1] << 64, "inc": w[2] | w[3] << 64},
            "has_uint32": w[4], "uinteger": w[5]}
