"""Fault-injection soak (CI size): faults in the gradients never reach params or optimizer state.

The full 10,000-step run is ``python tests/soak/fault_soak.py --steps 10000``; the checks
are the same (``fault_soak.check``), against a plain-Python model of the scale rule and the
fault schedule written on the host.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from soak import fault_soak

# Slow (make test-fast leaves it out): the fault-injection soak, 1,500 steps per mode and policy.
pytestmark = pytest.mark.slow

STEPS = 1500


@functools.cache
def soak(mode, policy):
    """One run per mode and policy in this process (the cache key is both, always given)."""
    return fault_soak.run_soak(mode, STEPS, seed=1, policy_name=policy)


# headroom_taps (uncapped, the taps hand it the float16 loss's ceiling) in "both" mode, which
# injects every kind of fault; the three modes ran clean over 10,000 steps
# (docs/reliability.md).
CASES = [
    (mode, policy)
    for policy in fault_soak.POLICY_NAMES
    for mode in ("ieee", "saturating", "both")
    if policy != "headroom_taps" or mode == "both"
]


@pytest.mark.parametrize("mode,policy", CASES)
def test_soak(mode, policy):
    result = soak(mode, policy)
    fault_soak.check(result)
    s = result["summary"]
    # The schedule exercised what it is meant to: faults of every injected kind, bursts
    # that drive the scale to its floor (stuck steps), and recovery above the floor.
    assert all(s["faults"][k] > 0 for k in fault_soak.INJECTED[mode]), s
    assert s["stuck_steps"] > 0 and s["scale_max"] > 2 * s["scale_min"], s
    assert s["natural_overflow_steps"] == 0, s
    # In ieee mode +-65504 is a finite gradient: steps with only those are applied.
    if mode == "ieee":
        faulty = (fault_soak.fault_schedule(STEPS, mode, 1)["leaf"] >= 0).any(axis=1)
        assert np.sum(faulty & ~result["record"]["skipped"]) > 0


def test_soak_check_catches_a_wrong_count():
    """The checker is not vacuous: a record that disagrees with the schedule fails it."""
    good = soak("both", "dynamic")  # test_soak[both-dynamic]'s run, not a second one
    for field in ("overflow", "finite", "params_same"):
        record = dict(good["record"])
        record[field] = record[field].copy()
        at = np.argmax(good["expected_overflow"])  # a skipped step
        record[field][at] = not record[field][at]
        with pytest.raises(AssertionError):
            fault_soak.check(recount(good, record))


def recount(result, record):
    """``result`` with ``record`` swapped in and its summary recomputed from it."""
    s = dict(result["summary"])
    s["non_finite_steps"] = int(np.sum(~record["finite"]))
    s["skips_not_bit_identical"] = int(
        np.sum(record["skipped"] & ~(record["params_same"] & record["inner_same"]))
    )
    return {**result, "record": record, "summary": s}
