"""The send offset a hospital with the built-in ResNet-18 (11.2M parameters) takes on this machine: its step
rehearsed at the largest batch it will plausibly draw, against three steps at Poisson draws.
Run: python results/send_offset/resnet18.py (output.txt, 2-core machine, 2026-11-28)."""

import time, numpy as np
from consilium.training.data.splits import Split
from consilium.training.methods.dopamine import DopamineSettings
from consilium.training.methods.step_timing import rehearse_step, SendOffset
from consilium.training.models.build import build_model
from consilium.training.models.spec import ModelSpec

spec = ModelSpec("resnet18", (3, 64, 64), 2, ())
model = build_model(spec)
print("parameters", sum(p.numel() for p in model.parameters()))
rng = np.random.default_rng(0)
n, q = 300, 0.1
data = Split(rng.normal(size=(n, 3, 64, 64)).astype(np.float32), rng.integers(0, 2, n))
settings = DopamineSettings(
    sample_rate=q,
    noise_multiplier=1.0,
    max_grad_norm=1.0,
    quorum=3,
    expected_batch_size=30.0,
    learning_rate=0.1,
    momentum=0.9,
)
seconds, records = rehearse_step(settings, model, data)
print(
    f"rehearsal: {records} records (b_hi for n={n}, q={q}) in {seconds:.1f} s; offset {SendOffset(0.25, seconds).seconds():.1f} s before encryption"
)
step = settings.local_step(model, data)
for r in range(3):
    t = time.perf_counter()
    _, b = step()
    dt = time.perf_counter() - t
    print(
        f"round-like step {r + 1}: batch {b} in {dt:.1f} s ({'within' if dt <= SendOffset(0.25, seconds).seconds() else 'OVER'} the offset)"
    )
