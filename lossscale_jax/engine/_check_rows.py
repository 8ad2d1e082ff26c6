"""The overflow check as XLA:GPU takes it: every gradient read by one kernel, in rows.

XLA:GPU reduces a large array in two kernels (the first writes partial results, the second
reduces them) and keeps reductions of different shapes in kernels of their own, so the
check's grouped reductions (``_check.leaf_flags``, XLA:CPU's formulation: one variadic
reduction per shape, 16 leaves at a time) cost it two kernels per group of same-shape leaves,
and one more stacking the flags (the 185M language model's optimizer step: 13 kernels).

Here each leaf's overflow test (``_check.predicates``) is laid out in rows of ``ROW`` elements,
its last row padded with ``False``, the rows of every leaf concatenated, and each row ORed:
XLA:GPU fuses the concatenation into one row reduction that reads every gradient once (the same
2 bytes a float16 gradient costs the grouped check). A leaf overflowed when one of its rows
did: the running count of overflowing rows at the leaf's last row exceeds the count before its
first (a prefix sum and a gather at constant positions; 4 kernels in all for that model). The
flags are the grouped check's, bit for bit (``tests/test_check_rows.py``). The range a
``HeadroomScale`` measures is a maximum, which a running count cannot take apart by leaf: a
check with the range keeps the grouped reductions on every platform.

``leaf_vector`` keeps, by the platform the step is lowered for, the rows on ``ON`` (CUDA,
ROCm) and the grouped reductions elsewhere (``_platform.pick_when_lowered``: no conditional),
each traced when the step is lowered for a platform that keeps it, so the CPU's trace and
program hold the grouped check alone (under a mesh both are traced, and the compiler drops
the other: ``_platform.pick``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.engine import _check, _platform

ROW = 8192
"""Elements per row: short enough that XLA:GPU reduces a row in one pass (it splits a row of
more than 16,384), long enough that the rows of a large model are few (the language model's
185M parameters: 22,681 rows) and its prefix sum one kernel."""

ON = _platform.GPUS
"""The platforms whose steps check in rows (XLA:GPU); the others keep the grouped check."""


def test_of(g: jax.Array, mode: str, threshold: float) -> jax.Array:
    """``g``'s elementwise overflow test: the union of ``_check.predicates``."""
    return jnp.logical_or(*_check.predicates(g, mode, threshold))


def _rows(test: jax.Array) -> jax.Array:
    """A leaf's overflow test as ``[rows, ROW]`` booleans, the last row padded with ``False``."""
    test = test.ravel()
    rows = -(-test.size // ROW)
    if rows * ROW != test.size:
        test = jnp.pad(test, (0, rows * ROW - test.size))
    return test.reshape(rows, ROW)


def in_rows(
    leaves: list[Any], mode: str, threshold: float, tests: dict[int, jax.Array] | None = None
) -> jax.Array:
    """One ``bool`` per leaf of ``leaves`` (``False`` for a leaf that is not floating): the
    flags ``_check.every_leaf_flags`` gives, from one row reduction over every leaf.
    ``tests``: the leaves' ``test_of``, by index, where the caller has them already."""
    tests = tests or {}
    blocks, bounds, total = [], [], 0
    for i, g in enumerate(leaves):
        if _check.is_float(g) and jnp.size(g) > 0:
            test = tests.get(i)
            if test is None:
                test = test_of(jnp.asarray(g), mode, threshold)
            block = _rows(test)
            blocks.append(block)
            bounds.append((total, total + block.shape[0]))
            total += block.shape[0]
        else:
            bounds.append((total, total))  # no rows: never overflows
    if not blocks:
        return jnp.zeros([len(leaves)], jnp.bool_)
    row_flags = jnp.any(jnp.concatenate(blocks), axis=1)
    count = jnp.cumsum(row_flags.astype(jnp.int32))
    count = jnp.concatenate([jnp.zeros([1], jnp.int32), count])  # count[k]: rows before k
    first, end = (np.asarray(b, np.int32) for b in zip(*bounds, strict=True))
    return count[end] > count[first]


def grouped(
    leaves: list[Any], mode: str, threshold: float, tests: dict[int, jax.Array] | None = None
) -> jax.Array:
    """The grouped reductions' flags (``_check.leaf_flags``) as one vector (``tests``: as
    ``in_rows``')."""
    tests = tests or {}
    checked = [i for i, g in enumerate(leaves) if _check.is_float(g)]
    found = _check.leaf_flags(
        [jnp.asarray(leaves[i]) for i in checked],
        mode,
        threshold,
        tests=[tests.get(i) for i in checked],
    )
    flags = [jnp.zeros([], jnp.bool_)] * len(leaves)
    for i, flag in zip(checked, found, strict=True):
        flags[i] = flag
    return jnp.stack(flags) if flags else jnp.zeros([0], jnp.bool_)


def leaf_vector(grads: Any, mode: Any, compute_dtype: Any) -> jax.Array:
    """``_check.leaf_vector(grads, mode, compute_dtype)`` (one ``bool`` per leaf, in
    ``tree_leaves`` order), in rows where the step is lowered for a platform of ``ON``."""
    mode = _check.validate_overflow_mode(mode)
    limit = _check.threshold(compute_dtype)
    leaves = jax.tree_util.tree_leaves(grads)
    if not leaves:
        return jnp.zeros([0], jnp.bool_)

    # Each leaf's test traced once, for both: the grouped reductions of several leaves reduce
    # it, the rows lay it out (a leaf alone in its group reduces its two predicates instead).
    alone = _check.alone(leaves)
    tested = [
        i for i, g in enumerate(leaves) if i not in alone and _check.is_float(g) and jnp.size(g) > 0
    ]
    tests = [test_of(jnp.asarray(leaves[i]), mode, limit) for i in tested]
    # The operands: the floating leaves and those tests; another leaf never overflows, and
    # stands in the functions below as an int32 zero (not a value of the step's).
    floats = [i for i, g in enumerate(leaves) if _check.is_float(g)]
    stand_in = np.zeros((), np.int32)

    def both_from(operands: Any) -> tuple[list[Any], dict[int, Any]]:
        given = [stand_in] * len(leaves)
        for i, g in zip(floats, operands[: len(floats)], strict=True):
            given[i] = g
        return given, dict(zip(tested, operands[len(floats) :], strict=True))

    def by_group(*operands: Any) -> jax.Array:
        given, tests_by_leaf = both_from(operands)
        return grouped(given, mode, limit, tests_by_leaf)

    def by_rows(*operands: Any) -> jax.Array:
        given, tests_by_leaf = both_from(operands)
        return in_rows(given, mode, limit, tests_by_leaf)

    operands = [jnp.asarray(leaves[i]) for i in floats] + tests
    out = jax.ShapeDtypeStruct((len(leaves),), jnp.bool_)
    return _platform.pick_when_lowered(by_group, by_rows, ON, operands, out)
