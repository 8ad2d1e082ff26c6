"""The worked example of the mixed-precision literature, in lossscale_jax.

A one-feature linear regression ``y_hat = w * x + b`` with a squared error,
one sample ``x = 1e-4, y = 0``, starting at ``w = 0, b = 1e-4``. The weight
gradient ``dL/dw = 2 (y_hat - y) x`` is 2e-8: below half of float16's
smallest subnormal (5.96e-8), it rounds to 0 when the backward pass runs in
float16, and the weight never moves. Multiplying the loss by S = 2**14
lifts the gradient into float16's
normal range; dividing by S in float32 (never in float16, which would
underflow again) recovers the float32 value to float16's precision.

Run: ``python examples/linear_regression_underflow.py``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import lossscale_jax as lsj

X, Y = 1e-4, 0.0  # one sample: a small input, target 0
W0, B0 = 0.0, 1e-4  # initial weight and bias
SCALE = 2.0**14  # large enough to lift 2e-8 into fp16's normal range, small enough
# that the scaled loss cotangent (SCALE) and gradients stay below 65504
LR = 0.1
STEPS = 3


def loss_fn(params, dtype):
    """Squared error computed in ``dtype`` from the float32 master weights."""
    w, b = params["w"].astype(dtype), params["b"].astype(dtype)
    err = w * jnp.asarray(X, dtype) + b - jnp.asarray(Y, dtype)
    return err * err


def fp32_gradient(params):
    return jax.grad(lambda p: loss_fn(p, jnp.float32))(params)


def fp16_gradient(params, scale):
    """Gradient taken in float16 of ``scale * loss``, w.r.t. the float16 copy."""
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
    return jax.grad(
        lambda p: loss_fn(p, jnp.float16) * jnp.asarray(scale, jnp.float16)
    )(p16)


def initial_params():
    return {"w": jnp.array(W0, jnp.float32), "b": jnp.array(B0, jnp.float32)}


def train(policy):
    """A few SGD steps through lsj.loss_scaling; returns the trajectory of w."""
    params = initial_params()
    tx = lsj.loss_scaling(optax.sgd(LR), policy)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        # Gradients w.r.t. the float16 copy of the float32 master weights;
        # the update is applied to the float32 weights.
        p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
        grads = jax.grad(lambda p: lsj.scale_loss(loss_fn(p, jnp.float16), opt_state))(
            p16
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ws = []
    for _ in range(STEPS):
        params, opt_state = step(params, opt_state)
        ws.append(float(params["w"]))
    return ws


def main() -> dict[str, float]:
    params = initial_params()
    scale = SCALE
    g32 = fp32_gradient(params)["w"]
    g16 = fp16_gradient(params, 1.0)["w"]
    scaled = fp16_gradient(params, scale)["w"]
    recovered = lsj.unscale({"w": scaled}, scale)["w"]  # float32
    in_fp16 = (scaled / jnp.asarray(scale, jnp.float16)).astype(jnp.float16)

    rows = {
        "fp32 reference": float(g32),
        "fp16, no scaling": float(g16),
        f"fp16 x {scale:g}, unscaled in fp32": float(recovered),
        f"fp16 x {scale:g}, unscaled in fp16": float(in_fp16),
    }
    print(f"dL/dw for x={X:g}, y={Y:g}, w={W0:g}, b={B0:g}")
    for name, value in rows.items():
        rel = abs(value - float(g32)) / abs(float(g32))
        print(f"  {name:<36} {value: .6e}   rel. error {rel:.1e}")

    print(f"\nw after each of {STEPS} SGD steps (lr={LR}):")
    ref = params
    ref_ws = []
    for _ in range(STEPS):
        g = fp32_gradient(ref)
        ref = jax.tree_util.tree_map(lambda p, d: p - LR * d, ref, g)
        ref_ws.append(float(ref["w"]))
    for name, ws in [
        ("fp32 reference", ref_ws),
        ("fp16, no scaling", train(lsj.NoScale())),
        (f"fp16, StaticScale({scale:g})", train(lsj.StaticScale(scale))),
    ]:
        rows[f"w: {name}"] = ws[-1]
        print(f"  {name:<36} " + "  ".join(f"{w: .6e}" for w in ws))
    return rows


if __name__ == "__main__":
    main()
