"""``lsj.presets``: each preset runs its stack's rule with the settings the stack uses.

The reference is each framework's rule transcribed from its source (tests/reference_scalers.py)
with the settings as the stack writes them (torch's defaults; Precision-RL's verl patch,
``ShardedGradScaler(growth_interval=400)``; verl's Megatron actor; Megatron-LM's and
DeepSpeed's defaults), stepped on the same seeded overflow sequence as the preset.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_policy  # tests/ is on sys.path under pytest
from reference_scalers import (  # tests/ is on sys.path under pytest
    DeepSpeedDynamicLossScaler,
    MegatronDynamicGradScaler,
    TorchGradScaler,
)

import lossscale_jax as lsj

STEPS = 3000


def megatron(initial_scale):
    return MegatronDynamicGradScaler(
        initial_scale=initial_scale,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        hysteresis=2,
    )


REFERENCES = {
    "torch_amp": lambda: TorchGradScaler(),
    "precision_rl": lambda: TorchGradScaler(growth_interval=400),
    "verl_megatron": lambda: megatron(2.0**15),
    "megatron_lm": lambda: megatron(2.0**32),
    "deepspeed_fp16": lambda: DeepSpeedDynamicLossScaler(
        init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2
    ),
}


def flags(seed):
    """Overflows at a rate that lets each rule grow between them (1 in 900), with bursts."""
    rng = np.random.default_rng(seed)
    out = rng.random(STEPS) < 1 / 900
    out[100:104] = True  # a burst: hysteresis and backoff both show
    return out


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_each_preset_is_its_stacks_rule_and_settings(name):
    assert name in lsj.presets.__all__
    policy = getattr(lsj.presets, name)()
    for seed in (0, 1):
        f = flags(seed)
        states = run_policy(policy, f)
        reference = REFERENCES[name]()
        want = [float(reference.step(bool(x))[0]) for x in f]
        np.testing.assert_array_equal(states.scale, np.asarray(want, np.float32))


def test_presets_are_named_in_the_module_docstring_table():
    doc = lsj.presets.__doc__
    assert all(f"``{name}``" in doc for name in lsj.presets.__all__)
