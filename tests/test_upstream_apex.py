"""NVIDIA apex's own loss-scale tests, run against ``lossscale_jax.compat.apex``.

Upstream (``tests/L0/run_amp/``): ``test_update_scale_hysteresis.py`` (the fused
``amp_C.update_scale_hysteresis`` kernel), ``test_scale.py`` (``amp_C.scale_check_overflow``:
unscale and find inf/nan) and ``test_checkpointing.py::test_loss_scale_decrease`` (``amp``'s
``LossScaler``, one per loss). Each test names the upstream test it ports and keeps its numbers.
One documented deviation (docs/porting.md): the kernel has no floor and its scale flushes to 0
below ``2**-126``; here it stops at ``2**-126``. Not ported (amp's opt levels, casts and
per-loss bookkeeping have no counterpart): ``test_checkpointing.py::test_restoring``,
``test_multiple_models_optimizers_losses.py``, the cast/cache/RNN/multi-tensor tests.
"""

from __future__ import annotations

import itertools
import math
import random

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_policy  # noqa: I001  (tests/ is on sys.path under pytest)

import lossscale_jax as lsj
from lossscale_jax import compat

# Slow (make test-fast leaves it out): a port of the peer's own tests, several seconds in all.
pytestmark = pytest.mark.slow

TINY = float(np.finfo(np.float32).tiny)  # torch.finfo(torch.float32).smallest_normal
F32_MAX = float(np.finfo(np.float32).max)


def isfinite(val):
    """The upstream test's helper."""
    return (val >= TINY) and (val <= F32_MAX)


# Longest sequence of the fuzz (hysteresis, growth_interval <= 100, extra iterations <= 1000),
# padded so that one compilation per policy serves every draw.
_N = 2 * 100 + 2 * (100 + 1000)


def _update_scale_hysteresis_body(rng, growth_factor, backoff_factor, growth_interval, hysteresis):
    """TestUpdateScaleHysteresis.update_scale_hysteresis_body, for init_scale 1, 1024, 65536."""
    policy = compat.apex.update_scale_hysteresis(
        1.0, growth_factor, backoff_factor, growth_interval, hysteresis
    )
    for init_scale in [1, 1024, 65536]:
        extra_bad = rng.randint(0, 1000)
        extra_good = rng.randint(0, 1000)
        phases = [
            [True] * (hysteresis - 1),  # infs for hysteresis-1 iterations: scale unchanged
            [False] * (growth_interval - 1),  # no infs for growth_interval-1: unchanged
            [True] * (hysteresis + extra_bad),  # more than hysteresis infs: backed off
            [False] * (growth_interval + extra_good),  # growth_interval goods: increased
        ]
        flags = sum(phases, [])
        ends = np.cumsum([len(p) for p in phases]) - 1
        state = policy.init().replace(scale=jnp.float32(init_scale))
        got = run_policy(policy, flags + [False] * (_N - len(flags)), state).scale

        assert got[ends[0]] == init_scale
        assert got[ends[1]] == init_scale

        scale_ref = float(got[ends[1]])  # scale_before
        for _ in range(1 + extra_bad):
            scale_new = scale_ref * backoff_factor
            scale_ref = scale_new if isfinite(scale_new) else 0
        # Documented deviation: where the kernel's scale reaches 0, this library stops at 2**-126.
        assert got[ends[2]] == (scale_ref if scale_ref != 0 else TINY)

        scale_ref = float(got[ends[2]])  # scale_before
        for _ in range(1 + int(math.floor(extra_good / growth_interval))):
            scale_new = scale_ref * growth_factor
            if isfinite(scale_new):
                scale_ref = scale_new
        assert got[ends[3]] == scale_ref


FUZZ = list(itertools.product([1.0, 2.0, 4.0], [0.5, 0.25], [10, 100], [10, 100]))


@pytest.mark.parametrize("growth_factor, backoff_factor, growth_interval, hysteresis", FUZZ)
def test_update_scale_hysteresis_fuzz(growth_factor, backoff_factor, growth_interval, hysteresis):
    # Upstream: test_update_scale_hysteresis.py, TestUpdateScaleHysteresis.test_fuzz (the grid
    # init_scale [1, 1024, 65536] x growth_factor [1.0, 2.0, 4.0] x backoff_factor [0.5, 0.25] x
    # growth_interval [10, 100] x hysteresis [10, 100]; a growth factor of 1 included).
    rng = random.Random(hash((growth_factor, backoff_factor, growth_interval, hysteresis)))
    _update_scale_hysteresis_body(rng, growth_factor, backoff_factor, growth_interval, hysteresis)


# --------------------------------------------------------------------------
# test_scale.py: scale_check_overflow (unscale by 1/128, find inf/nan).

SCALE = 128.0
NX, NY = 999, 888


def _downscale_test(input_dtype):
    inp = jnp.ones((NY, NX), input_dtype) * SCALE
    out = jnp.zeros((NY, NX), jnp.float32)  # the fp32 output buffer: unscaled into its dtype
    unscaled, overflow = lsj.unscale_and_check(inp, SCALE, params=out)
    assert unscaled.dtype == jnp.float32
    np.testing.assert_allclose(unscaled, np.ones((NY, NX), np.float32))  # fp32_ref
    assert not bool(overflow)


def _find_inf_test(input_dtype, x, y, val):
    inp = jnp.ones((NY, NX), input_dtype).at[x, y].set(val)
    _, overflow = lsj.unscale_and_check(inp, SCALE, params=jnp.zeros((NY, NX), jnp.float32))
    assert bool(overflow)


def test_fp16_to_fp32():
    # Upstream: test_scale.py, TestScale.test_fp16_to_fp32.
    _downscale_test(jnp.float16)


def test_fp32_to_fp32():
    # Upstream: test_scale.py, TestScale.test_fp32_to_fp32.
    _downscale_test(jnp.float32)


def test_fp16_to_fp32_find_inf_nan():
    # Upstream: test_scale.py, TestScale.test_fp16_to_fp32_find_inf_nan.
    _find_inf_test(jnp.float16, 0, 0, float("nan"))
    _find_inf_test(jnp.float16, NY // 2, NX // 2, float("inf"))
    _find_inf_test(jnp.float16, NY - 1, NX - 1, float("nan"))


def test_fp32_to_fp32_find_inf_nan():
    # Upstream: test_scale.py, TestScale.test_fp32_to_fp32_find_inf_nan.
    _find_inf_test(jnp.float32, 0, 0, float("inf"))
    _find_inf_test(jnp.float32, NY // 2, NX // 2, float("nan"))
    _find_inf_test(jnp.float32, NY - 1, NX - 1, float("inf"))


# --------------------------------------------------------------------------
# test_checkpointing.py


def test_loss_scale_decrease():
    # Upstream: test_checkpointing.py, TestCheckpointing.test_loss_scale_decrease: three losses,
    # each with its own dynamic LossScaler; loss idx overflows in the first
    # nb_decrease_loss_scales[idx] of max(...) = 2 iterations (upstream feeds x * 2**17 in
    # fp16). Afterwards loss_scale = init / 2**factor and amp.state_dict()'s "unskipped" (the
    # good steps counted, here growth_count) = 2 - factor.
    num_losses = 3
    nb_decrease_loss_scales = [0, 1, 2]
    iters = max(nb_decrease_loss_scales)
    for idx in range(num_losses):
        factor = nb_decrease_loss_scales[idx]
        scaler = compat.apex.LossScaler("dynamic")
        init_ls = float(scaler.init().scale)
        flags = [True] * factor + [False] * (iters - factor)
        states = run_policy(scaler, flags)
        assert float(states.scale[-1]) == init_ls / 2**factor  # loss_scale
        unskipped_target = iters - factor
        assert int(states.growth_count[-1]) == unskipped_target  # unskipped
