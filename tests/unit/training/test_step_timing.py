"""The send offset follows the step's time at the largest batch a hospital will plausibly draw, timed on a
batch of a size fixed in advance, never on a round's draw (``training.methods.step_timing``)."""

import time

import numpy as np
import torch
from scipy.stats import binom

from consilium.training.data.splits import Split
from consilium.training.methods.dopamine import DopamineSettings
from consilium.training.methods.step_timing import MARGIN, TAIL, SendOffset, largest_batch, rehearse_step
from consilium.training.models.build import build_model
from consilium.training.models.spec import ModelSpec

SETTINGS = dict(max_grad_norm=1.5, quorum=3, expected_batch_size=12.0, learning_rate=0.1, momentum=0.9)


class _Slow(torch.nn.Module):
    """A model whose every forward pass takes at least ``seconds``: a large model on a slow machine."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = build_model(ModelSpec("mlp", (4,), 2, (8,))), seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.inner(x)


def _data(n: int) -> Split:
    rng = np.random.default_rng(0)
    return Split(rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 2, n))


def test_the_largest_batch_is_exceeded_by_a_round_s_draw_with_probability_at_most_the_tail():
    for records, rate in ((200, 0.05), (10_000, 0.01), (3, 0.5)):
        size = largest_batch(records, rate)
        assert binom.sf(size, records, rate) <= TAIL < binom.sf(size - 1, records, rate)


def test_the_rehearsal_runs_the_method_s_own_step_on_the_largest_batch_and_the_offset_covers_it():
    settings = DopamineSettings(sample_rate=0.05, noise_multiplier=1.0, **SETTINGS)
    model = _Slow(0.3)
    seconds, records = rehearse_step(settings, model, _data(200))
    assert records == largest_batch(200, 0.05) and seconds >= 0.3  # the batch fixed in advance, whatever q draws
    assert SendOffset(floor_s=0.25, step_s=seconds).seconds() == MARGIN * seconds > 0.25  # 0.25 s would be overrun
    assert SendOffset(floor_s=0.25, step_s=0.01).seconds() == 0.25  # never below the operator's floor
    assert SendOffset(floor_s=0.0, step_s=seconds).seconds() == 0.0  # 0: the operator's choice to send at once


def test_a_rehearsal_leaves_the_model_for_the_hospital_s_own_step_and_a_misfit_to_that_step():
    settings = DopamineSettings(sample_rate=0.05, noise_multiplier=1.0, **SETTINGS)
    model, data = build_model(ModelSpec("mlp", (4,), 2, (8,))), _data(200)
    assert rehearse_step(settings, model, data)[1] == largest_batch(200, 0.05)
    share, _ = settings.local_step(model, data)()  # the model is not hooked by the rehearsal
    assert share.size > 0
    assert rehearse_step(settings, model, Split(data.x[:0], data.y[:0])) is None  # no records: the step says why


def test_a_hospital_s_offset_is_rehearsed_and_said_and_a_model_that_diverges_leaves_the_floor(caplog):
    settings = DopamineSettings(sample_rate=0.05, noise_multiplier=1.0, **SETTINGS)
    offset = SendOffset(floor_s=0.25)
    with caplog.at_level("INFO", logger="consilium.hospital"):
        offset.rehearse(settings, _Slow(0.3), _data(200), "hospital-1")
    assert offset.seconds() >= MARGIN * 0.3
    assert f"hospital-1: a step of {largest_batch(200, 0.05)} records took" in caplog.text
    diverging = build_model(ModelSpec("mlp", (4,), 2, (8,)))
    with torch.no_grad():
        for parameter in diverging.parameters():
            parameter.fill_(3e38)  # finite, as a Welcome's values must be, and its gradients are not
    stays = SendOffset(floor_s=0.25)
    with caplog.at_level("WARNING", logger="consilium.hospital"):
        stays.rehearse(settings, diverging, _data(200), "hospital-1")  # no traceback: round 1's step says why
    assert stays.seconds() == 0.25
    assert "hospital-1: the step could not be timed; each update is encrypted 0.25 s after" in caplog.text
