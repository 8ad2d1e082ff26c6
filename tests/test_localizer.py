"""``diagnose``'s localizer: an overflow in a module's own code between two sub-modules, and a
``jnp.where`` mask whose constant is beyond float16's range.

The references are independent of ``diagnose``: the float16 values at the module boundaries,
captured with Flax's ``intercept_methods``, and the float16 loss of the model with the advice
applied, computed here.
"""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale_jax as lsj
from lossscale_jax.diagnosis import _constants

# Slow (make test-fast leaves it out): each test compiles the diagnosis of a model.
pytestmark = pytest.mark.slow


class Attention(nn.Module):
    """Scores, a softmax in this module's own code, then a head: in float16 the ``exp`` of
    the sharp scores overflows between the two sub-modules (inf / inf is nan); in float32
    it does not (e^30 is below float32's 3.4e38, above float16's 65504)."""

    sharpness: float = 10.0
    # "float16"; "float32": the advice, the exp and the normalisation in float32; "stable":
    # the max subtracted first (jax.nn.softmax)
    mode: str = "float16"

    @nn.compact
    def __call__(self, x):
        s = nn.Dense(16, dtype=jnp.float16, name="scores")(x) * self.sharpness
        if self.mode == "stable":
            p = jax.nn.softmax(s, axis=-1)
        else:
            e = jnp.exp(s.astype(jnp.float32) if self.mode == "float32" else s)
            p = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(jnp.float16)
        return nn.Dense(4, dtype=jnp.float16, name="head")(p)


class Net(nn.Module):
    mode: str = "float16"
    sharpness: float = 10.0

    @nn.compact
    def __call__(self, x):
        attn = Attention(self.sharpness, self.mode, name="attn")
        return nn.Dense(1, dtype=jnp.float16, name="out")(attn(x.astype(jnp.float16)))


X = jax.random.normal(jax.random.key(0), (32, 8))
BATCH = (X, jnp.zeros((32, 1)))
VARIABLES = Net().init(jax.random.key(1), X)


def net_loss(mode: str = "float16", sharpness: float = 10.0):
    def loss_fn(variables, batch):
        pred = Net(mode, sharpness).apply(variables, batch[0]).astype(jnp.float32)
        return jnp.mean((pred - batch[1]) ** 2)

    return loss_fn


def _boundaries(loss_fn, names):
    """The float16 input and output of each named module's call (Flax's interceptor)."""
    seen = {}

    def capture(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.module.name in names and context.method_name == "__call__":
            seen[context.module.name] = (np.asarray(args[0]), np.asarray(out))
        return out

    with nn.intercept_methods(capture):
        loss = loss_fn(VARIABLES, BATCH)
    return float(loss), seen


def test_overflow_between_two_modules_is_named_in_the_parents_code():
    loss, seen = _boundaries(net_loss(), {"scores", "head"})
    # The case: scores' float16 output is in range, head's input is already nan, so head's
    # output is nan although its float32 output is below 1.
    assert not np.isfinite(loss)
    assert np.isfinite(seen["scores"][1]).all() and not np.isfinite(seen["head"][0]).all()

    report = lsj.diagnose(net_loss(), VARIABLES, [BATCH], scales=[1.0], print_table=False)
    assert [t.name for t in report.taps] == ["attn/scores", "attn/head", "attn", "out", "Net"]
    rows = {t.name: t for t in report.taps}
    assert not rows["attn/scores"].forward_overflows
    head = rows["attn/head"]
    assert head.forward_overflows and head.input_overflows and head.forward_max == np.inf
    assert head.forward_max_reference < 65504
    assert rows["attn"].forward_overflows and not rows["attn"].input_overflows
    assert "input inf/nan" in report.table()

    # The verdict names the code between the taps, in the parent's own code, and not head.
    assert report.verdict.startswith(
        "the float16 loss is not finite: the float16 forward pass overflows first between "
        "attn/scores and attn/head, in attn's own code (attn/head's input is already inf or "
        "nan in float16"
    )
    assert "keep that code of attn in float32" in report.verdict
    assert "overflows first at attn/head" not in report.verdict
    assert "keep attn/head in float32" not in report.verdict


def test_the_advice_makes_the_loss_finite():
    """The parent's exp and normalisation in float32, as the verdict says: the float16 loss
    is finite, and the diagnosis finds no overflow left."""
    loss, seen = _boundaries(net_loss("float32"), {"head"})
    assert np.isfinite(loss) and np.isfinite(seen["head"][0]).all()
    fixed = lsj.diagnose(net_loss("float32"), VARIABLES, [BATCH], scales=[1.0], print_table=False)
    assert fixed.loss_finite and "overflows" not in fixed.verdict
    assert not any(t.forward_overflows or t.input_overflows for t in fixed.taps)


def test_an_exp_that_overflows_float32_too_gets_the_stable_form():
    """e^(40 x) overflows float32 as well: float32 would not fix it, the stable softmax does."""
    report = lsj.diagnose(
        net_loss(sharpness=40.0), VARIABLES, [BATCH], scales=[1.0], print_table=False
    )
    assert "between attn/scores and attn/head, in attn's own code" in report.verdict
    assert "already inf or nan in float16, and in float32 too" in report.verdict
    assert "make that code of attn stable (subtract the largest value" in report.verdict
    assert np.isfinite(float(net_loss("stable", 40.0)(VARIABLES, BATCH)))


def test_overflow_before_the_model_is_in_the_loss_function():
    def loss_fn(variables, batch):
        x = jnp.exp(batch[0].astype(jnp.float16) * 20)  # e^(20 x) leaves float16 at x > 0.55
        pred = Net("float32").apply(variables, x / jnp.sum(x, -1, keepdims=True))
        return jnp.mean((pred.astype(jnp.float32) - batch[1]) ** 2)

    report = lsj.diagnose(loss_fn, VARIABLES, [BATCH], scales=[1.0], print_table=False)
    assert "overflows first before Net, in the loss function's own code" in report.verdict
    assert "keep that code of the loss function in float32" in report.verdict
    assert all(t.input_overflows for t in report.taps)  # nan from the start


# --------------------------------------------------------------------------
# A mask whose constant float16 cannot hold.

NEG = -2.3819763e38  # a "large negative" written for float32


class Masked(nn.Module):
    neg: float = NEG

    @nn.compact
    def __call__(self, x, mask):
        s = nn.Dense(8, dtype=jnp.float16, name="scores")(x)
        s = jnp.where(mask, s, self.neg)  # the mask
        return nn.Dense(1, dtype=jnp.float16, name="head")(jax.nn.softmax(s, axis=-1))


MASK = jnp.ones((32, 8), bool).at[3].set(False)  # row 3 fully masked
MASKED = Masked().init(jax.random.key(2), X, MASK)


def masked_loss(neg: float):
    def loss_fn(variables, batch):
        out = Masked(neg=neg).apply(variables, batch[0].astype(jnp.float16), batch[1])
        return jnp.mean(out.astype(jnp.float32) ** 2)

    return loss_fn


def _mask_line() -> str:
    lines, first = inspect.getsourcelines(Masked.__call__)
    return f"test_localizer.py:{first + next(i for i, s in enumerate(lines) if 'the mask' in s)}"


def test_a_mask_constant_beyond_float16_is_named_with_its_fix():
    assert not np.isfinite(float(masked_loss(NEG)(MASKED, (X, MASK))))
    report = lsj.diagnose(masked_loss(NEG), MASKED, [(X, MASK)], scales=[1.0], print_table=False)
    assert "overflows first between scores and head, in Masked's own code" in report.verdict
    assert (
        f"which no loss scale fixes: a `jnp.where` (masking) at {_mask_line()} in Masked uses "
        "the constant -2.38e+38, outside float16's finite range: it becomes -inf in float16, "
        "and the softmax of a fully masked row is then nan; use jnp.finfo(x.dtype).min "
        "(-65504 in float16) or a large finite negative value such as -1e4 instead"
    ) in report.verdict
    assert "keep head in float32" not in report.verdict

    # Applied, the fix makes the loss finite (the masked row's softmax is uniform).
    for neg in (-1e4, float(jnp.finfo(jnp.float16).min)):
        assert np.isfinite(float(masked_loss(neg)(MASKED, (X, MASK))))
        fixed = lsj.diagnose(masked_loss(neg), MASKED, [(X, MASK)], scales=[1.0], print_table=False)
        assert fixed.loss_finite and "overflows" not in fixed.verdict
        assert "jnp.where" not in fixed.verdict


def test_mask_constant_without_taps():
    """No taps (a function of arrays, localize off): the verdict still names the mask."""

    def loss_fn(w, batch):
        x, mask = batch
        s = x.astype(jnp.float16) @ w.astype(jnp.float16)
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        return jnp.sum(p.astype(jnp.float32))

    w = jnp.full((8, 8), 0.1)
    for localize in (True, False):
        report = lsj.diagnose(
            loss_fn, w, [(X, MASK)], scales=[1.0], print_table=False, localize=localize
        )
        assert report.verdict.startswith(
            "the float16 loss is not finite, which no loss scale fixes: a `jnp.where` "
            "(masking) at test_localizer.py:"
        )
        assert "uses the constant -1e+09" in report.verdict


def test_constants_scan_finds_only_constants_float16_cannot_hold():
    x = jnp.ones((2, 3), jnp.float16)
    m = jnp.array([[True, False, True]] * 2)

    def found(fn):
        return _constants.out_of_range(fn, (x, m), jnp.float16)

    (c,) = found(lambda x, m: jnp.where(m, x, -2.3819763e38))
    assert c.masking and c.value == pytest.approx(-2.3819763e38) and c.line
    (c,) = found(lambda x, m: jnp.where(m, x, -jnp.inf))  # an inf written as such
    assert c.masking and c.value == -np.inf
    # In range, or computed in float32 (the where promotes to float32's constant): nothing.
    assert found(lambda x, m: jnp.where(m, x, -1e4)) == []
    assert found(lambda x, m: jnp.where(m, x, jnp.finfo(jnp.float16).min)) == []
    assert found(lambda x, m: jnp.where(m, x, jnp.finfo(jnp.float32).min)) == []
    # Inside a scan's body, a jit and a remat too.
    body = jax.checkpoint(jax.jit(lambda x, m: jnp.where(m, x, -1e30)))
    (c,) = found(lambda x, m: jax.lax.scan(lambda c, r: (c, body(*r)), 0, (x, m))[1])
    assert c.masking and c.value == pytest.approx(-1e30)
