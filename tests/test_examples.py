"""The examples run, and their printed results say what their docstrings claim."""

from __future__ import annotations

import numpy as np
from helpers import load_script  # tests/ is on sys.path under pytest


def load(name: str):
    return load_script(f"examples/{name}.py")


def test_linear_regression_underflow(capsys):
    ex = load("linear_regression_underflow")
    rows = ex.main()
    out = capsys.readouterr().out
    assert "fp16, no scaling" in out
    # Hand-derived: dL/dw = 2 * (w x + b - y) * x = 2 * 1e-4 * 1e-4 = 2e-8.
    ref = 2 * (ex.W0 * ex.X + ex.B0 - ex.Y) * ex.X
    np.testing.assert_allclose(rows["fp32 reference"], ref, rtol=1e-6)
    assert rows["fp16, no scaling"] == 0.0  # underflow: lost
    scaled_key = f"fp16 x {ex.SCALE:g}, unscaled in fp32"
    np.testing.assert_allclose(rows[scaled_key], ref, rtol=2**-10)  # fp16 precision
    assert rows[f"fp16 x {ex.SCALE:g}, unscaled in fp16"] == 0.0  # underflows again
    # Training: fp16 without scaling never moves w; with the scale it follows fp32.
    assert rows["w: fp16, no scaling"] == 0.0
    assert rows[f"w: fp16, StaticScale({ex.SCALE:g})"] < 0.0
    np.testing.assert_allclose(
        rows[f"w: fp16, StaticScale({ex.SCALE:g})"], rows["w: fp32 reference"], rtol=2e-3
    )
