"""The run's model as the server and every hospital hold it: built from the run's configuration, moved
only by opened sums.

It is the model under its update rule and the coming round's settings
(``training.methods.registry.SharedState``), and the initial parameters that, with the configuration,
name the run. A Welcome and the server's checkpoint carry it as three float32 arrays (``arrays``).
"""

from __future__ import annotations

import numpy as np

from consilium.protocol.run.config import RunConfig
from consilium.protocol.secure_round.statement import state_digest
from consilium.protocol.wire.codec import float32_values
from consilium.training.methods.registry import SharedState, TrainingMethod, ledger_release
from consilium.training.models.build import build_model, get_flat_parameters, set_flat_parameters
from consilium.training.privacy.accounting import Release

__all__ = ["RunModel"]


class RunModel:
    def __init__(self, config: RunConfig, *, seed: int | None = None) -> None:
        self.network = build_model(config.model, seed=seed)
        self.shared = SharedState(config.training, self.network)
        self.initial = get_flat_parameters(self.network)

    @property
    def parameter_count(self) -> int:
        return self.shared.parameter_count

    def fingerprint(self, config: RunConfig) -> str:
        """The run's name: its configuration and initial parameters (``RunConfig.fingerprint``)."""
        return config.fingerprint(self.initial.tobytes())

    def arrays(self) -> dict[str, bytes]:
        """The model as a Welcome and a checkpoint carry it."""
        return {
            "initial_parameters": self.initial.tobytes(),
            "parameters": get_flat_parameters(self.network).tobytes(),
            "optimizer_state": self.shared.state().tobytes(),
        }

    def load(self, carrier, *, whose: str) -> None:
        """Go on from ``arrays()`` as a Welcome or a checkpoint (``carrier``) holds them; ``ValueError``, naming
        ``whose`` arrays, where they are unusable."""
        count = self.parameter_count
        try:
            self.initial = float32_values(carrier.initial_parameters, count, f"{whose} initial model")
            set_flat_parameters(self.network, float32_values(carrier.parameters, count, f"{whose} model"))
            state = float32_values(carrier.optimizer_state, self.shared.state().size, f"{whose} optimizer state")
        except TypeError:  # a checkpoint's JSON may hold anything where bytes belong
            raise ValueError(f"{whose} model is not float32 values") from None
        self.shared.load_state(state)

    def digest(self) -> bytes:
        """The model and update rule's state at a round's start: what every honest hospital holds too."""
        return state_digest(get_flat_parameters(self.network).tobytes(), self.shared.state().tobytes())

    def release(self, contributors: int, coalition: int) -> Release:
        """What a round's sum of ``contributors`` updates releases, as the server's ledger charges it."""
        return ledger_release(self.shared.settings, self.shared.mechanism, contributors, coalition)

    def mean(self, summed: np.ndarray, contributors: int, settings: TrainingMethod | None = None) -> np.ndarray:
        """The mean an opened sum of ``contributors`` updates gives at the round's ``settings`` (by default, the
        coming round's, which are the round's until it moves on)."""
        settings = self.shared.settings if settings is None else settings
        return settings.read_sum(summed, contributors, self.parameter_count)

    def move(self, mean: np.ndarray, contributors: int) -> None:
        """Move the model by a round's mean, and on to the next round's settings."""
        self.shared.apply(mean, contributors)
