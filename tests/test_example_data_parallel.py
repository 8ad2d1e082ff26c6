"""examples/data_parallel.py runs as a user runs it (its own process, 8 CPU devices set at
the top of the script) in under a minute, and prints what its docstring claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT  # tests/ is on sys.path under pytest

import lossscale_jax as lsj

# Slow (make test-fast leaves it out): the example run as a process on 8 devices.
pytestmark = [pytest.mark.slow, pytest.mark.multidevice]

SCRIPT = ROOT / "examples" / "data_parallel.py"
ROW = re.compile(r"^\s*(\d+)\s+(device \d+|-)\s+([\d. ]+)\|([\d ]+)$")


def expected_scales(policy: lsj.DynamicScale, steps: int, poisoned: set[int]) -> list[float]:
    """Hand-rolled DynamicScale (hysteresis 1): halve on overflow, double after a run."""
    scale, good, out = policy.init_scale, 0, []
    for t in range(steps):
        if t in poisoned:
            scale, good = max(scale * policy.backoff_factor, policy.min_scale), 0
        else:
            good += 1
            if good == policy.growth_interval:
                scale, good = min(scale * policy.growth_factor, policy.max_scale), 0
        out.append(scale)
    return out


def test_data_parallel_example():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 60
    out = proc.stdout

    # The script's settings, read from the script itself (not imported: that would set up
    # JAX in this process a second time).
    src = SCRIPT.read_text()
    poisoned = eval(re.search(r"^POISONED = (\{.*?\})", src, re.M).group(1))  # noqa: S307
    steps = int(re.search(r"^STEPS = (\d+)", src, re.M).group(1))
    policy = eval(re.search(r"^POLICY = (lsj\.DynamicScale\(.*?\))$", src, re.M).group(1))  # noqa: S307
    ref = expected_scales(policy, steps, set(poisoned))

    sections = out.split("\nshard_map:")
    assert len(sections) == 2 and sections[0].lstrip().startswith("pmap:")
    for section in sections:
        rows = [ROW.match(line) for line in section.splitlines()]
        rows = [r for r in rows if r]
        assert len(rows) == len({s + d for s in poisoned for d in (-1, 0)} | {steps - 1})
        for r in rows:
            t = int(r.group(1))
            scales = np.array(r.group(3).split(), float)
            skips = np.array(r.group(4).split(), int)
            assert scales.shape == skips.shape == (8,)
            np.testing.assert_array_equal(scales, ref[t])  # every device, the reference value
            np.testing.assert_array_equal(skips, sum(1 for s in poisoned if s <= t))
            assert (r.group(2) == "-") == (t not in poisoned)
        assert "every device agrees on every step: True" in section
    assert min(ref) < policy.init_scale < max(ref)  # the scale moved both ways

    assert "pmap and shard_map: same scales, same skips, same weights: True" in out
    sat = out[out.index("saturating devices") :]
    assert "averaged gradients: [False, False, False, False, False, False, False, False]" in sat
    assert "per device:        [True, True, True, True, True, True, True, True]" in sat
    w = re.search(r"learned w \(pmap\): (.*)", out).group(1)
    w_true = re.search(r"true w\s*: (.*)", out).group(1)
    learned = np.array([float(v) for v in re.findall(r"-?\d+\.?\d*", w)])
    true = np.array([float(v) for v in re.findall(r"-?\d+\.?\d*", w_true)])
    np.testing.assert_allclose(learned, true, atol=0.15)  # it trains despite the skips
