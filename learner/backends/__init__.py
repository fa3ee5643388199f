"""The ``Backend`` seam: everything the learner loop needs from a training framework. The optimiser
step is separate from forward/backward, so the guard-rails and skipping a non-finite step are the
loop's decisions.
"""

from __future__ import annotations

import abc

from core.registry import resolve


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient: the step is discarded before it reaches the optimiser."""


class Backend(abc.ABC):
    """Built as ``Backend(cfg, model_dir)``: the HF-format model at ``model_dir`` (and a frozen KL reference)."""

    name = ""
    skipped_nonfinite = 0  # steps discarded for a non-finite loss or gradient

    @abc.abstractmethod
    def logprobs(self, batch, *, reference: bool = False, with_entropy: bool = False, sampling=None):
        """``(logp, entropy)`` ``[N, L-1]`` of the batch's completion tokens (zeros elsewhere)."""

    @abc.abstractmethod
    def forward_backward(self, batch) -> dict[str, float]:
        """Loss and gradients of one batch; returns the step's metrics. Raises NonFiniteError."""

    @abc.abstractmethod
    def optim_step(self) -> float:
        """Clip and apply the gradients; returns the gradient norm. Raises NonFiniteError."""

    @abc.abstractmethod
    def discard_grads(self) -> None:
        """Drop accumulated gradients (a skipped step)."""

    @abc.abstractmethod
    def named_tensors(self) -> dict:
        """The policy's weights under their HF names, as the actors' engines load them."""

    @abc.abstractmethod
    def save_model(self, path: str) -> None:
        """Write an HF-format model directory (weights, config, the base model's tokenizer)."""

    @abc.abstractmethod
    def save_state(self, path: str) -> dict:
        """Write weights and optimiser/RNG state into ``path``; returns JSON-able metadata."""

    @abc.abstractmethod
    def load_state(self, path: str, meta: dict) -> None:
        """Restore what :meth:`save_state` wrote."""

    def step(self, batch, check=None) -> dict[str, float]:
        """One optimiser step; on any error the gradients are discarded and the error re-raised.
        ``check(metrics)`` (the guard-rails) runs before the optimiser: True discards the step."""
        try:
            metrics = self.forward_backward(batch)
            if check is not None and check(metrics):
                self.discard_grads()
                return metrics
            metrics["learner/grad_norm"] = self.optim_step()
        except Exception as e:
            self.discard_grads()
            self.skipped_nonfinite += isinstance(e, NonFiniteError)
            raise
        return metrics


BACKENDS = {"torch": "learner.backends.torch:TorchBackend",
            "megatron": "learner.backends.megatron:MegatronBackend"}


def make_backend(cfg, model_dir: str) -> Backend:
    return resolve(BACKENDS, cfg.learner.backend, "learner backend")(cfg, model_dir)
