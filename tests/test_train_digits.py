"""The digits job (examples/train_digits.py) in its --quick mode.

References: the underflow count is recomputed here from plain NumPy on gradients taken
separately; the skipped-step rate from the runs' own per-step flags; the accuracy of fp32
from an independent NumPy argmax over the model's logits.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_script  # tests/ is on sys.path under pytest

import lossscale_jax as lsj

# fp16 + dynamic scaling must reach fp32's validation accuracy within this many points
# (mean over the quick run's seeds; one validation sample is 0.22 points).
ACCURACY_TOLERANCE = 0.02


def load():
    return load_script("examples/train_digits.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ex = load()
    out = tmp_path_factory.mktemp("digits")
    result = ex.main(["--quick", "--out", str(out), "--no-progress"])
    return ex, out, result


@pytest.mark.slow
def test_quick_table_has_four_finite_rows(job, capsys):
    ex, out, result = job
    rows = result["rows"]
    assert list(rows) == list(ex.CONFIGS)
    assert len(rows) == 4
    for name, row in rows.items():
        for key in ("acc_mean", "acc_std", "underflow_lost", "skipped_rate", "final_scale"):
            assert math.isfinite(row[key]), (name, key, row[key])
        assert 0.0 <= row["underflow_lost"] <= 1.0
        assert 0.0 <= row["skipped_rate"] <= 1.0
    table = (out / "digits_table.md").read_text()
    for name in ex.CONFIGS:
        assert f"| {name} |" in table
    saved = json.loads((out / "digits_table.json").read_text())
    assert saved["rows"].keys() == rows.keys()
    png = (out / "digits_plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow
def test_quick_fp16_dynamic_matches_fp32(job):
    _, _, result = job
    rows = result["rows"]
    assert rows["fp32"]["acc_mean"] > 0.9  # it learned something
    assert abs(rows["fp16, dynamic"]["acc_mean"] - rows["fp32"]["acc_mean"]) <= ACCURACY_TOLERANCE


@pytest.mark.slow
def test_quick_counts_agree_with_the_histories(job):
    ex, _, result = job
    for name, runs in result["results"].items():
        policy = ex.CONFIGS[name][1]
        for run in runs:
            h = run["history"]
            assert len(h["loss"]) == 100
            skipped = int(np.sum(h["skipped"]))
            assert run["metrics"]["skipped_steps"] == skipped
            # The train state's step counts only the good steps.
            assert run["step"] == 100 - skipped
            if not isinstance(policy, lsj.DynamicScale):  # fixed scales stay put
                np.testing.assert_array_equal(h["scale"], run["metrics"]["loss_scale"])
        if name == "fp32":
            assert all(r["lost"] == 0 for r in runs)  # not probed: it is the reference
        else:
            assert all(r["nonzero"] > 0 for r in runs)  # probed


@pytest.mark.slow
def test_underflow_probe_against_numpy():
    """The probe's count equals a NumPy count over gradients taken separately."""
    ex = load()
    x_tr, y_tr, _, _ = ex.load_data()
    x, y = x_tr[:64], y_tr[:64]
    variables = ex.CNN().init(jax.random.key(0), x[:2])
    params, stats = variables["params"], variables["batch_stats"]
    weight = jnp.float32(2.0**-8)  # small enough that float16 loses entries
    a16, a32 = ex.APPLY[jnp.float16], ex.APPLY[jnp.float32]
    # A NoScale optimizer state (scale 1) of the structure the job hands the probe, the
    # "fp16, no scaling" configuration's: the job's compiled probe runs it (same program).
    state = ex.make_tx(lsj.NoScale()).init(params)
    assert float(lsj.get_loss_scale_state(state).scale) == 1.0
    lost, nonzero = ex.probe_underflow(a16, a32, params, stats, x, y, state, weight)

    def grads(apply_fn):
        def loss_fn(p):
            logits, _ = apply_fn({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1)) * weight

        g = jax.jit(jax.grad(loss_fn))(params)
        return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(g)]

    g16, g32 = grads(a16), grads(a32)
    ref_lost = sum(int(np.sum((a == 0) & (b != 0))) for a, b in zip(g16, g32, strict=True))
    ref_nonzero = sum(int(np.sum(b != 0)) for b in g32)
    assert int(nonzero) == ref_nonzero
    assert int(lost) == ref_lost
    assert ref_lost > 0  # the setting does underflow


def test_bad_flags_are_rejected():
    ex = load()
    for argv in (["--steps", "0"], ["--seeds", "0"], ["--loss-weight", "0"]):
        with pytest.raises(SystemExit):
            ex.parse_args(argv)
