"""AdamW for the reference model: Adam with decoupled weight decay, in place on numpy arrays."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from SneppX_ALG import errors


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter), in place on the model's arrays.

    The moments and the step count are training state: `state_dict()` gives them as `optim/...` tensors so a
    checkpoint can resume training bitwise. Weight decay applies to matrices only (not biases or LayerNorm gains).
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, decayed: Iterable[str] | None = None):
        """`decayed` names the parameters weight decay applies to; by default those with ndim >= 2. A sharded
        optimizer holding flat pieces of matrices names them (model/data_parallel.py)."""
        if not (lr >= 0 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1 and eps > 0 and weight_decay >= 0):
            raise errors.ModelConfigError(
                f"AdamW hyperparameters out of range: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.decayed = frozenset(name for name, value in params.items() if value.ndim >= 2) if decayed is None \
            else frozenset(decayed)
        self.m = {name: np.zeros_like(value) for name, value in params.items()}
        self.v = {name: np.zeros_like(value) for name, value in params.items()}
        self.step_count = 0

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], lr: float | None = None) -> None:
        """One update of every parameter from its gradient (grads are used as scratch and left changed)."""
        lr = self.lr if lr is None else lr
        beta1, beta2 = self.betas
        self.step_count += 1
        t = self.step_count
        step_size = lr / (1.0 - beta1 ** t)
        inv_sqrt_bc2 = 1.0 / math.sqrt(1.0 - beta2 ** t)
        for name, value in params.items():
            g, m, v = grads[name], self.m[name], self.v[name]
            dt = value.dtype.type
            m *= dt(beta1)
            m += dt(1.0 - beta1) * g
            v *= dt(beta2)
            g *= g
            g *= dt(1.0 - beta2)
            v += g
            if name in self.decayed and self.weight_decay:
                value *= dt(1.0 - lr * self.weight_decay)
            denom = np.sqrt(v)
            denom *= dt(inv_sqrt_bc2)
            denom += dt(self.eps)
            update = np.divide(m, denom, out=denom)
            update *= dt(step_size)
            value -= update

    def state_dict(self) -> dict[str, np.ndarray]:
        state: dict[str, np.ndarray] = {"optim/step": np.array(self.step_count, np.int64)}
        for name in self.m:
            state[f"optim/m/{name}"] = self.m[name]
            state[f"optim/v/{name}"] = self.v[name]
        return state

    def check_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Raises TrainingStateError unless `state` holds this optimizer's tensors with the right shapes."""
        step = state.get("optim/step")
        if step is None or step.shape != () or step.dtype != np.int64 or int(step) < 0:
            raise errors.TrainingStateError("training state lacks a valid optim/step (int64 scalar >= 0)")
        for kind, moments in (("m", self.m), ("v", self.v)):
            for name, ours in moments.items():
                value = state.get(f"optim/{kind}/{name}")
                if value is None or value.shape != ours.shape or value.dtype != ours.dtype:
                    found = "missing" if value is None else f"{value.dtype}{list(value.shape)}"
                    raise errors.TrainingStateError(
                        f"optimizer moment optim/{kind}/{name} is {found}, needs {ours.dtype}{list(ours.shape)}")

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.check_state_dict(state)
        for name in self.m:
            np.copyto(self.m[name], state[f"optim/m/{name}"], casting="no")
            np.copyto(self.v[name], state[f"optim/v/{name}"], casting="no")
        self.step_count = int(state["optim/step"])
