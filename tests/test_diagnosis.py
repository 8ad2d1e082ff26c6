"""``diagnose``: the float32 rewrite, the per-leaf numbers and the verdicts.

The references are independent of ``diagnose``: the float32 loss written by hand (the same
model built in float32), and float16 gradients at a given scale computed here with
``jax.grad``, whose zeros and non-finite entries are counted in NumPy.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale_jax as lsj
from lossscale_jax.taps import _upcast

# Slow (make test-fast leaves it out): each test compiles a model's gradients at many loss scales,
# or runs a process.
pytestmark = pytest.mark.slow

SIZES = [16, 32, 32, 4]


def mlp_params(seed: int = 0) -> dict:
    key, params = jax.random.key(seed), {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        key, k = jax.random.split(key)
        kernel = jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a)
        params[f"Dense_{i}"] = {"kernel": kernel, "bias": jnp.full((b,), 0.01, jnp.float32)}
    return params


def mlp_loss(weight: float, dtype=jnp.float16):
    """An MLP's mean squared error times ``weight``, computed in ``dtype`` (float32 weights);
    each layer's output is tapped (``lsj.tap``), which only diagnose's localizer sees."""

    def loss_fn(params, batch):
        x, y = batch
        h = x.astype(dtype)
        p = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
        for i in range(len(p)):
            h = lsj.tap(h @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"], f"Dense_{i}")
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        return weight * jnp.mean((h.astype(jnp.float32) - y) ** 2)

    return loss_fn


BATCHES = [
    (
        jax.random.normal(jax.random.key(10 + i), (32, SIZES[0]), jnp.float32),
        jax.random.normal(jax.random.key(20 + i), (32, SIZES[-1]), jnp.float32),
    )
    for i in range(2)
]
# Tried scales: powers of two from 2^-4 to 2^24 every 2 (fewer gradient evaluations).
SCALES = 2.0 ** np.arange(-4, 25, 2)


class Block(nn.Module):
    """A transformer block: layer norm, self-attention, an MLP with gelu."""

    dtype: type = jnp.float16

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        # Self-attention (nn.SelfAttention is deprecated in favour of this call).
        h = nn.MultiHeadDotProductAttention(num_heads=2, dtype=self.dtype)(h)
        x = x + h
        h = nn.Dense(16, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(8, dtype=self.dtype)(nn.gelu(h))


def test_rewrite_is_the_float32_model():
    """The rewritten float16 loss equals the same loss written in float32, and computes
    nothing in float16: a hand-written MLP, and a Flax block (casts inside Flax's layers)."""
    params = mlp_params()
    ref = _upcast.upcast(mlp_loss(1.0))
    assert not _upcast.computes_in(ref, (params, BATCHES[0]), jnp.float16)
    got = jax.jit(jax.grad(ref))(params, BATCHES[0])
    want = jax.jit(jax.grad(mlp_loss(1.0, jnp.float32)))(params, BATCHES[0])
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)

    x = jax.random.normal(jax.random.key(1), (2, 4, 8), jnp.float32)
    block_params = jax.jit(Block().init)(jax.random.key(0), x)

    def loss(dtype):
        return lambda p, x: jnp.mean(jnp.square(Block(dtype=dtype).apply(p, x)))

    ref = _upcast.upcast(loss(jnp.float16))
    assert _upcast.computes_in(loss(jnp.float16), (block_params, x), jnp.float16)
    assert not _upcast.computes_in(ref, (block_params, x), jnp.float16)
    got = jax.tree_util.tree_leaves(jax.jit(jax.grad(ref))(block_params, x))
    want = jax.tree_util.tree_leaves(jax.jit(jax.grad(loss(jnp.float32)))(block_params, x))
    # Constants the float16 program holds stay rounded to float16 (gelu's 0.044715 is
    # 0.044708 there, 1.6e-4 off), so the two differ by more than float32 rounding. The
    # tolerance is relative to the largest gradient of the model: some leaves (the key's
    # bias, which softmax cannot see) have gradients that are rounding noise in both.
    top = max(float(jnp.max(jnp.abs(w))) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * top)


def _float16_grads(loss_fn, params, batch, scale):
    """Float16 gradients of the scaled loss, as a training step takes them."""
    grads = jax.grad(lambda p: loss_fn(p, batch).astype(jnp.float32) * scale)(params)
    return [np.asarray(g, np.float32) for g in jax.tree_util.tree_leaves(grads)]


def _counts(weight, params, scale):
    """Per leaf, over BATCHES, for the MLP's loss times ``weight``: (entries nonzero in
    float32 and zero in float16, nonzero in float32, non-finite in float16, nonzero in both
    but deep in float16's subnormals, below 2**-17), from a hand-written float32 loss."""
    ref32 = mlp_loss(weight, jnp.float32)
    out = np.zeros((len(jax.tree_util.tree_leaves(params)), 4), np.int64)
    for batch in BATCHES:
        ref = [np.asarray(g) for g in jax.tree_util.tree_leaves(jax.grad(ref32)(params, batch))]
        low = _float16_grads(mlp_loss(weight), params, batch, scale)
        for j, (r, g) in enumerate(zip(ref, low, strict=True)):
            # Nonzero: above float32's rounding noise relative to the leaf's largest.
            nz = np.abs(r) > np.finfo(np.float32).eps * np.abs(r).max()
            a = np.abs(g.astype(np.float64))
            out[j] += [
                np.sum(nz & (g == 0)),
                np.sum(nz),
                np.sum(~np.isfinite(g)),
                np.sum(nz & (a > 0) & (a < 2.0**-17)),
            ]
    return out


WEIGHT_SMALL = 1e-6  # a small loss weight: most gradients fall below float16's range


def test_underflowing_model_gets_a_scale_that_removes_the_underflow(capsys):
    params, loss_fn = mlp_params(), mlp_loss(WEIGHT_SMALL)
    report = lsj.diagnose(loss_fn, params, BATCHES, scales=SCALES)
    table = capsys.readouterr().out
    assert "scale needed" in table and "['Dense_1']['kernel']" in table

    # The numbers at scale 1 are those counted independently.
    unscaled = _counts(WEIGHT_SMALL, params, 1.0)
    for leaf, (under, nonzero, bad, _) in zip(report.leaves, unscaled, strict=True):
        assert leaf.underflow_unscaled == under / nonzero and bad == 0
    assert max(leaf.underflow_unscaled for leaf in report.leaves) > 0.5  # it does underflow
    assert report.verdict.startswith("scale needed: init_scale in [")

    lo, hi = report.init_scale_range
    assert lo <= report.recommended_scale <= hi and lo > 1.0
    # Used, the recommended scale removes the underflow (down to the floor) and
    # overflows nothing: counted here, not by diagnose.
    scaled = _counts(WEIGHT_SMALL, params, report.recommended_scale)
    assert scaled[:, 2].sum() == 0
    assert scaled[:, 0].sum() / scaled[:, 1].sum() <= report.underflow_floor + report.tolerance
    assert scaled[:, 0].sum() < 0.05 * unscaled[:, 0].sum()
    # The leaf that underflows most needs the scale; the table's model line says so.
    worst = max(report.leaves, key=lambda leaf: leaf.underflow_unscaled)
    assert worst.verdict == "scale needed"


def _subnormal_fraction(weight, params, scale):
    """Over BATCHES, the share of the nonzero reference entries deep in float16's
    subnormals (``_counts``' last column)."""
    counts = _counts(weight, params, scale)
    return counts[:, 3].sum() / counts[:, 1].sum()


def test_subnormal_entries_count_as_lost_precision():
    # With a loss weight of 2**-6 nothing underflows to zero, but some entries are deep in
    # float16's subnormals (few significant bits): the range's lower end is where they are not.
    params, weight = mlp_params(), 2.0**-6
    report = lsj.diagnose(mlp_loss(weight), params, BATCHES, scales=SCALES, print_table=False)
    assert all(leaf.underflow_unscaled == 0 for leaf in report.leaves)
    i1 = int(np.searchsorted(report.scales, 1.0))
    want = _subnormal_fraction(weight, params, 1.0)
    assert want > report.tolerance
    np.testing.assert_allclose(report.subnormal[i1], want, rtol=1e-12)
    assert report.verdict.startswith("scale needed: init_scale in [")
    lo, _ = report.init_scale_range
    assert lo > 1.0
    assert _subnormal_fraction(weight, params, lo) <= report.tolerance
    assert _subnormal_fraction(weight, params, lo / 4) > report.tolerance  # a grid step below
    table = report.table()
    assert "subnormal@1" in table and "zero@1" in table


def test_model_that_does_not_underflow_says_so():
    report = lsj.diagnose(mlp_loss(16.0), mlp_params(), BATCHES, scales=SCALES, print_table=False)
    assert report.verdict == "float16 needs no scaling here"
    assert all(leaf.verdict == "float16 needs no scaling here" for leaf in report.leaves)
    assert all(leaf.underflow_unscaled == 0 for leaf in report.leaves)
    assert all(leaf.subnormal_unscaled == 0 for leaf in report.leaves)
    # The histogram holds every nonzero reference entry, in the binade of its log2.
    ref = jax.grad(mlp_loss(1.0, jnp.float32))(mlp_params(), BATCHES[0])
    kernel = np.abs(np.asarray(ref["Dense_0"]["kernel"]))
    leaf = report.leaves[[x.path for x in report.leaves].index("['Dense_0']['kernel']")]
    assert leaf.log2_histogram.sum() >= np.count_nonzero(kernel)
    assert leaf.max_abs >= kernel.max()


def test_forward_overflow_is_reported():
    """Activations past 65504: the float16 loss is inf at every scale, so no scale helps."""
    params = mlp_params()
    params["Dense_0"]["kernel"] = params["Dense_0"]["kernel"] * 3e4
    report = lsj.diagnose(mlp_loss(1.0), params, BATCHES[:1], scales=[1.0], print_table=False)
    assert not report.loss_finite and report.init_scale_range is None
    assert report.verdict.startswith("the float16 loss is not finite")
    # the localizer names the layer (the MLP's outputs are tapped): the first one
    assert "overflows first at Dense_0" in report.verdict
    assert "keep Dense_0 in float32" in report.verdict and "the layers" not in report.verdict
    assert all(
        leaf.verdict == "this layer overflows at any scale: keep it in float32"
        for leaf in report.leaves
    )


def test_plot_shifts_the_histogram_by_the_recommended_scale(tmp_path):
    """The picture: the reference histogram and the same moved right by log2 of the
    recommended scale; saved where asked."""
    report = lsj.diagnose(
        mlp_loss(WEIGHT_SMALL), mlp_params(), BATCHES[:1], scales=SCALES, print_table=False
    )
    path = tmp_path / "float16.png"
    fig = report.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    top, bottom, activations = fig.axes  # the MLP's layers are tapped: a third panel
    assert len(activations.get_yticks()) == len(report.taps) > 0
    (bars,) = top.containers
    (stairs,) = [p for p in top.patches if type(p).__name__ == "StepPatch"]
    hist = np.sum([leaf.log2_histogram for leaf in report.leaves], axis=0)
    heights = np.array([b.get_height() for b in bars])
    np.testing.assert_allclose(heights, hist / hist.sum())
    lefts = np.array([b.get_x() for b in bars])
    shift = np.log2(report.recommended_scale)
    np.testing.assert_array_equal(stairs.get_data().edges[:-1], lefts + shift)
    assert len(bottom.get_yticks()) == len(report.leaves)


def test_matplotlib_is_imported_only_by_plot():
    code = (
        "import sys, jax.numpy as jnp, lossscale_jax as lsj\n"
        "lsj.diagnose(lambda p, x: jnp.sum(x @ p['w'].astype(jnp.float16)).astype(jnp.float32),"
        " {'w': jnp.ones((2, 2))}, [jnp.ones((1, 2), jnp.float16)], scales=[1.0])\n"
        "assert 'matplotlib' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)


# --------------------------------------------------------------------------
# The localizer: per tap, in forward order, against a float32 model of its own (the same
# network built with dtype float32) and Flax's capture_intermediates.


class MiddleOverflows(nn.Module):
    """Its middle layer's float16 output leaves float16's range; tanh hides it from the loss."""

    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(32, dtype=self.dtype, name="embed")(x.astype(self.dtype)))
        init = nn.initializers.normal(8000.0)
        x = nn.Dense(32, dtype=self.dtype, name="middle", kernel_init=init)(x)
        x = jnp.tanh(x / 4096)
        return nn.Dense(1, dtype=self.dtype, name="head")(x)


def _middle_case():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 8))
    y = jnp.zeros((64, 1))
    variables = MiddleOverflows().init(jax.random.PRNGKey(1), x)

    def loss_fn(v, batch, dtype=jnp.float16):
        out = MiddleOverflows(dtype=dtype).apply(v, batch[0])
        return jnp.mean((out.astype(jnp.float32) - batch[1]) ** 2)

    return loss_fn, variables, (x, y)


def test_localizer_names_the_middle_layer_and_where_underflow_starts(tmp_path):
    loss_fn, variables, batch = _middle_case()
    report = lsj.diagnose(loss_fn, variables, [batch], print_table=False)
    names = [t.name for t in report.taps]
    assert names == ["embed", "middle", "head", "MiddleOverflows"]  # forward order
    middle = report.taps[1]

    # forward: float32 model's own intermediates (Flax's capture_intermediates)
    _, state = MiddleOverflows(dtype=jnp.float32).apply(
        variables, batch[0], capture_intermediates=True, mutable=["intermediates"]
    )
    inter = state["intermediates"]
    for t in report.taps[:3]:
        (out,) = inter[t.name]["__call__"]
        np.testing.assert_allclose(t.forward_max_reference, np.abs(out).max(), rtol=1e-5)
    assert middle.forward_overflows and middle.forward_max == np.inf
    assert not any(t.forward_overflows for t in report.taps if t.name != "middle")

    # backward: d loss / d (middle's output) of the float32 model, by a zero perturbation
    def with_eps(eps):
        def add(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            return out + eps if context.module.name == "middle" else out

        with nn.intercept_methods(add):
            return loss_fn(variables, batch, jnp.float32)

    ct = np.abs(np.asarray(jax.grad(with_eps)(jnp.zeros((64, 32)))))
    np.testing.assert_allclose(middle.backward_max, ct.max(), rtol=1e-5)
    nz = ct[ct > 0]
    np.testing.assert_allclose(middle.underflow_unscaled, np.mean(nz < 2.0**-14), rtol=1e-6)
    at = np.mean(nz * report.recommended_scale < 2.0**-14)
    np.testing.assert_allclose(middle.underflow_at_recommended, at, rtol=1e-6)

    # the verdict names the module, and where the gradient starts to underflow
    assert "the float16 forward pass overflows first at middle" in report.verdict
    assert "keep middle in float32" in report.verdict
    assert "start to underflow at middle" in report.verdict
    table = report.table()
    assert "activations and their gradients" in table and "OVERFLOWS" in table
    fig = report.plot(tmp_path / "localizer.png")
    labels = [t.get_text() for t in fig.axes[2].get_yticklabels()]
    assert labels == list(reversed(names))


def test_localizer_can_be_turned_off_or_narrowed():
    loss_fn, variables, batch = _middle_case()
    off = lsj.diagnose(loss_fn, variables, [batch], print_table=False, localize=False)
    assert off.taps == () and "middle" not in off.verdict
    only = lsj.diagnose(
        loss_fn,
        variables,
        [batch],
        print_table=False,
        modules=lambda m: m.name in ("embed", "middle"),
    )
    assert [t.name for t in only.taps] == ["embed", "middle"]
    with pytest.raises(TypeError, match="modules must be a bool or a predicate"):
        lsj.diagnose(loss_fn, variables, [batch], print_table=False, modules="all")
