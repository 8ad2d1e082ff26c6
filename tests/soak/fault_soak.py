"""Fault-injection soak: jit-compiled training steps with faults injected into the gradients.

A small float16 MLP (float32 master weights, Adam) trains under
``loss_scaling(..., DynamicScale)`` (or ``HeadroomScale``, ``--policy headroom``); before each
update, faults are written into
the scaled float16 gradients at random leaves and elements: ``inf``, ``-inf``,
``nan``, ``+65504`` and ``-65504``, alone or in bursts of consecutive steps.
Every step is checked on the device (one ``lax.scan``, no host sync):

- params and the whole optimizer state hold only finite values;
- a skipped step leaves params and the inner optimizer state bit-identical;
- the scale stays in ``[min_scale, max_scale]`` (never 0 nor inf) and follows a
  plain-Python model of the policy's rule driven by the injected faults (for
  ``HeadroomScale`` also by each step's gradient range, measured separately with
  ``jnp.max(jnp.abs(g))``);
- each step's overflow flag, and the telemetry counters, equal the faults the
  overflow mode is meant to see (ieee: inf/nan; saturating: |g| >= 65504,
  inf included; both: all of them).

A saturating device never writes nan, and ``"saturating"`` mode does not look
for it, so nan is not injected in that mode (``"both"`` covers mixed devices).

Usage::

    python tests/soak/fault_soak.py --steps 10000          # every mode
    python tests/soak/fault_soak.py --steps 10000 --policy headroom
    python tests/soak/fault_soak.py --steps 10000 --policy headroom_taps   # uncapped, taps
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lossscale_jax as lsj

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, as pytest has it
from reference_scalers import ReferenceHeadroom  # noqa: E402

KINDS = ("inf", "-inf", "nan", "+65504", "-65504")
VALUES = np.array([np.inf, -np.inf, np.nan, 65504.0, -65504.0], np.float16)
SEEN = {
    "ieee": {"inf", "-inf", "nan"},
    "saturating": {"inf", "-inf", "+65504", "-65504"},
    "both": set(KINDS),
}
INJECTED = {
    "ieee": KINDS,
    "saturating": ("inf", "-inf", "+65504", "-65504"),
    "both": KINDS,
}
POLICIES = {
    "ieee": dict(hysteresis=1),
    "saturating": dict(hysteresis=2, consecutive_hysteresis=True),
    "both": dict(hysteresis=3, consecutive_hysteresis=False),
}
MAX_FAULTS = 3  # faults per faulty step, at most
SHAPES = {"b1": (16,), "b2": (4,), "w1": (8, 16), "w2": (16, 4)}  # sorted, as jax flattens


POLICY_NAMES = ("dynamic", "headroom", "headroom_taps")


def make_policy(mode: str, name: str = "dynamic") -> lsj.LossScalePolicy:
    if name == "headroom_taps":
        # The same, uncapped (max_scale 2**24): the step hands it the taps (the float16
        # loss, tapped by scale_loss), whose range shows the ceiling the parameter
        # gradients do not, so no cap is needed to keep the backward pass finite.
        return lsj.HeadroomScale(
            init_scale=2.0**10, min_margin=3, max_margin=6, margin_interval=25, window=10
        )
    if name == "headroom":
        # A short memory and margin interval, so bursts widen the margin, drive the scale to
        # its floor, and it recovers within the run. The cap keeps this MLP's own float16
        # backward far from its overflow, as DynamicScale's does: its intermediate gradients
        # overflow (to inf, then nan) well below the room its parameter gradients show (2
        # octaves at the start, more as it trains), and in "saturating" mode nothing would
        # catch that nan (a saturating device never writes one; this CPU does).
        return lsj.HeadroomScale(
            init_scale=2.0**10,
            min_margin=3,
            max_margin=6,
            margin_interval=25,
            window=10,
            max_scale=2.0**12,
        )
    return lsj.DynamicScale(
        init_scale=2.0**10, growth_interval=25, min_scale=1.0, max_scale=2.0**12, **POLICIES[mode]
    )


def fault_schedule(steps: int, mode: str, seed: int) -> dict[str, np.ndarray]:
    """Per step: up to MAX_FAULTS (leaf, flat position, kind) triples; leaf -1 = none."""
    rng = np.random.default_rng(seed)
    leaf = np.full((steps, MAX_FAULTS), -1, np.int32)
    pos = rng.integers(0, 2**20, (steps, MAX_FAULTS)).astype(np.int32)
    allowed = np.array([KINDS.index(k) for k in INJECTED[mode]], np.int32)
    kind = allowed[rng.integers(0, len(allowed), (steps, MAX_FAULTS))]
    t = 0
    while t < steps:
        r = rng.random()
        if r < 0.04:  # a fault alone
            length = 1
        elif r < 0.05:  # a burst of consecutive faulty steps
            length = int(rng.integers(2, 30))
        else:
            t += 1
            continue
        for s in range(t, min(t + length, steps)):
            n = int(rng.integers(1, MAX_FAULTS + 1))
            leaf[s, :n] = rng.integers(0, len(SHAPES), n)
        t += length + 1
    return {"leaf": leaf, "pos": pos, "kind": kind}


def expected_overflow(schedule: dict[str, np.ndarray], mode: str) -> np.ndarray:
    """What the mode must see at each step: the faults as written (last write wins)."""
    sizes = [math.prod(s) for s in SHAPES.values()]
    out = np.zeros(len(schedule["leaf"]), bool)
    for t, (leaves, poss, kinds) in enumerate(
        zip(schedule["leaf"], schedule["pos"], schedule["kind"], strict=True)
    ):
        written: dict[tuple[int, int], str] = {}
        for lf, p, k in zip(leaves, poss, kinds, strict=True):
            if lf >= 0:
                written[(int(lf), int(p) % sizes[lf])] = KINDS[k]
        out[t] = any(k in SEEN[mode] for k in written.values())
    return out


def reference_scales(policy: lsj.DynamicScale, overflow: np.ndarray) -> np.ndarray:
    """The scale after each step, by the DynamicScale rule written in plain Python (float32)."""
    f32 = np.float32
    scale, growth, hyst = f32(policy.init_scale), 0, 0
    out = np.empty(len(overflow), np.float32)
    for t, bad in enumerate(overflow):
        if bad:
            growth, hyst = 0, hyst + 1
            if hyst >= policy.hysteresis:
                scale, hyst = max(f32(scale * f32(policy.backoff_factor)), f32(policy.min_scale)), 0
        else:
            growth += 1
            if policy.consecutive_hysteresis:
                hyst = 0
            if growth >= policy.growth_interval:
                grown = f32(scale * f32(policy.growth_factor))
                if np.isfinite(grown):
                    scale = min(grown, f32(policy.max_scale))
                growth, hyst = 0, 0
        out[t] = scale
    return out


def _bits_equal(a: jax.Array, b: jax.Array) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.floating):
        uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[a.dtype.itemsize]
        a, b = lax.bitcast_convert_type(a, uint), lax.bitcast_convert_type(b, uint)
    return jnp.all(a == b)


def _tree_all(fn: Any, *trees: Any) -> jax.Array:
    flags = jax.tree_util.tree_leaves(jax.tree_util.tree_map(fn, *trees))
    return jnp.all(jnp.stack(flags)) if flags else jnp.ones([], jnp.bool_)


def _all_finite(tree: Any) -> jax.Array:
    return _tree_all(
        lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else True,
        tree,
    )


def reference_headroom_scales(
    policy: lsj.HeadroomScale, overflow: np.ndarray, amax: np.ndarray
) -> np.ndarray:
    """(scale, range_peak, margin) after each step, by ``ReferenceHeadroom`` (float32 rule)."""
    model = ReferenceHeadroom(policy)
    out = np.empty((len(overflow), 3), np.float64)
    for t, (o, a) in enumerate(zip(overflow, amax, strict=True)):
        out[t] = (model.step(bool(o), float(a))[0], model.peak, model.margin)
    return out


def build(mode: str, steps: int, seed: int = 0, policy_name: str = "dynamic"):
    """The jitted scan over ``steps`` steps and its inputs."""
    policy = make_policy(mode, policy_name)
    use_taps = policy_name == "headroom_taps"
    tx = lsj.loss_scaling(optax.adam(1e-3), policy, overflow=mode)
    key = jax.random.PRNGKey(seed)
    params = {
        name: 0.3 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
        for i, (name, shape) in enumerate(SHAPES.items())
    }
    opt_state = tx.init(params)
    values = jnp.asarray(VALUES)

    def loss_fn(p16, x, y):
        h = jnp.tanh(x @ p16["w1"] + p16["b1"])
        loss16 = jnp.mean((h @ p16["w2"] + p16["b2"] - y) ** 2)
        # With taps, scale_loss is given the float16 loss itself (it promotes it), so its
        # tap sees the float16 cotangent, the scale.
        return loss16 if use_taps else loss16.astype(jnp.float32)

    def inject(grads, leaf, pos, kind):
        names = list(SHAPES)
        for j in range(MAX_FAULTS):
            for i, name in enumerate(names):
                g = grads[name]
                flat = g.reshape(-1)
                hit = flat.at[pos[j] % flat.size].set(values[kind[j]]).reshape(g.shape)
                grads[name] = jnp.where(leaf[j] == i, hit, g)
        return grads

    def step(carry, xs):
        params, opt_state = carry
        t, leaf, pos, kind = xs
        k = jax.random.fold_in(key, t)
        x = jax.random.normal(k, (32, 8), jnp.float16)
        y = jnp.sin(x[:, :4])
        p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)

        def scaled(p):
            return lsj.scale_loss(loss_fn(p, x, y), opt_state)

        extra = {}
        if use_taps:
            _, grads, extra["taps"] = lsj.taps.value_and_grad(scaled)(p16)
        else:
            grads = jax.grad(scaled)(p16)
        natural = lsj.check_overflow(grads, mode)
        grads = inject(dict(grads), leaf, pos, kind)
        scale = opt_state.loss_scale.scale
        # The range HeadroomScale reads, measured here on its own (not the library's pass):
        # with taps, also the loss's cotangent, the scale in float16.
        parts = [jnp.max(jnp.abs(g.astype(jnp.float32))) for g in grads.values()]
        if use_taps:
            parts.append(jnp.abs(scale.astype(jnp.float16).astype(jnp.float32)))
            natural = jnp.logical_or(natural, jnp.logical_not(scale < 65520.0))
        amax = jnp.max(jnp.stack(parts)) / (scale * jnp.float32(65504.0))
        updates, new_opt = tx.update(grads, opt_state, params, **extra)
        new_params = optax.apply_updates(params, updates)
        ls = new_opt.loss_scale
        out = {
            "overflow": ls.last_overflow,
            "skipped": ls.last_skipped,
            "stuck": ls.stuck,
            "natural": natural,
            "scale": ls.scale,
            "amax": amax,
            "range_peak": ls.range_peak,
            "margin": ls.margin,
            "finite": jnp.logical_and(_all_finite(new_params), _all_finite(new_opt)),
            "params_same": _tree_all(_bits_equal, params, new_params),
            "inner_same": _tree_all(_bits_equal, opt_state.inner_state, new_opt.inner_state),
        }
        return (new_params, new_opt), out

    schedule = fault_schedule(steps, mode, seed)
    xs = (
        jnp.arange(steps, dtype=jnp.int32),
        jnp.asarray(schedule["leaf"]),
        jnp.asarray(schedule["pos"]),
        jnp.asarray(schedule["kind"]),
    )
    run = jax.jit(lambda carry, xs: lax.scan(step, carry, xs))
    return run, (params, opt_state), xs, schedule, policy


def run_soak(mode: str, steps: int, seed: int = 0, policy_name: str = "dynamic") -> dict[str, Any]:
    """Runs the soak and returns its per-step record, the expectations and summary figures."""
    run, carry, xs, schedule, policy = build(mode, steps, seed, policy_name)
    t0 = time.perf_counter()
    compiled = run.lower(carry, xs).compile()
    t1 = time.perf_counter()
    (params, opt_state), rec = jax.block_until_ready(compiled(carry, xs))
    wall = time.perf_counter() - t1
    rec = {k: np.asarray(v) for k, v in rec.items()}
    expected = expected_overflow(schedule, mode) | rec["natural"]
    faults = schedule["leaf"] >= 0
    counts = {k: int(np.sum(faults & (schedule["kind"] == i))) for i, k in enumerate(KINDS)}
    m = {k: np.asarray(v) for k, v in lsj.metrics(opt_state).items()}
    state_mismatch = 0
    if isinstance(policy, lsj.HeadroomScale):
        ref = reference_headroom_scales(policy, expected, rec["amax"])
        reference = ref[:, 0].astype(np.float32)
        state_mismatch = int(
            np.sum(
                (rec["range_peak"] != ref[:, 1].astype(np.float32)) | (rec["margin"] != ref[:, 2])
            )
        )
    else:
        reference = reference_scales(policy, expected)
    return {
        "mode": mode,
        "steps": steps,
        "wall_s": wall,
        "compile_s": t1 - t0,
        "record": rec,
        "expected_overflow": expected,
        "reference_scale": reference,
        "policy": policy,
        "final_params": params,
        "final_opt_state": opt_state,
        "metrics": m,
        "summary": {
            "mode": mode,
            "steps": steps,
            "faulty_steps": int(np.sum(faults.any(axis=1))),
            **_runs(faults.any(axis=1)),
            "faults": counts,
            "faults_total": int(faults.sum()),
            "expected_overflow_steps": int(expected.sum()),
            "natural_overflow_steps": int(rec["natural"].sum()),
            "overflow_steps": int(m["overflow_steps"]),
            "skipped_steps": int(m["skipped_steps"]),
            "stuck_steps": int(rec["stuck"].sum()),
            "non_finite_steps": int(np.sum(~rec["finite"])),
            "skips_not_bit_identical": int(
                np.sum(rec["skipped"] & ~(rec["params_same"] & rec["inner_same"]))
            ),
            "scale_min": float(rec["scale"].min()),
            "scale_max": float(rec["scale"].max()),
            "scale_mismatch_steps": int(np.sum(rec["scale"] != reference)),
            "state_mismatch_steps": state_mismatch,  # HeadroomScale: range_peak and margin
        },
    }


def _runs(faulty: np.ndarray) -> dict[str, int]:
    """Faulty steps alone and in bursts (runs of consecutive faulty steps)."""
    edges = np.diff(np.concatenate([[0], faulty.astype(np.int8), [0]]))
    lengths = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    return {
        "alone": int(np.sum(lengths == 1)),
        "bursts": int(np.sum(lengths > 1)),
        "longest_burst": int(lengths.max(initial=0)),
    }


def check(result: dict[str, Any]) -> None:
    """Asserts every property of the soak on its record."""
    rec, s, policy = result["record"], result["summary"], result["policy"]
    expected = result["expected_overflow"]
    assert s["non_finite_steps"] == 0, s
    assert s["skips_not_bit_identical"] == 0, s
    # Every fault the mode is meant to see was seen, step by step, and nothing else.
    np.testing.assert_array_equal(rec["overflow"], expected)
    np.testing.assert_array_equal(rec["skipped"], expected)
    assert s["overflow_steps"] == s["skipped_steps"] == s["expected_overflow_steps"], s
    assert int(result["metrics"]["total_steps"]) == s["steps"]
    # The scale: bounded, never 0 or inf, and exactly the reference rule's.
    assert np.all(np.isfinite(rec["scale"])) and np.all(rec["scale"] > 0)
    assert policy.min_scale <= s["scale_min"] and s["scale_max"] <= policy.max_scale, s
    np.testing.assert_array_equal(rec["scale"], result["reference_scale"])
    assert s["state_mismatch_steps"] == 0, s
    # Stuck exactly when a step overflows at the floor.
    before = np.concatenate([[policy.init_scale], rec["scale"][:-1]])
    np.testing.assert_array_equal(rec["stuck"], expected & (before <= policy.min_scale))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=["ieee", "saturating", "both"])
    parser.add_argument("--policy", choices=POLICY_NAMES, default="dynamic")
    args = parser.parse_args()
    for mode in args.modes:
        t0 = time.perf_counter()
        result = run_soak(mode, args.steps, args.seed, args.policy)
        check(result)
        s = result["summary"]
        print(
            f"{args.policy} {mode:10s} steps={s['steps']} faulty_steps={s['faulty_steps']} "
            f"(alone={s['alone']} bursts={s['bursts']} longest={s['longest_burst']}) "
            f"faults={s['faults_total']} {s['faults']} "
            f"expected_overflow={s['expected_overflow_steps']} "
            f"overflow={s['overflow_steps']} skipped={s['skipped_steps']} stuck={s['stuck_steps']} "
            f"natural={s['natural_overflow_steps']} non_finite={s['non_finite_steps']} "
            f"skips_not_bit_identical={s['skips_not_bit_identical']} "
            f"scale=[{s['scale_min']:g}, {s['scale_max']:g}] "
            f"compile={result['compile_s']:.1f}s run={result['wall_s']:.2f}s "
            f"total={time.perf_counter() - t0:.1f}s  OK"
        )


if __name__ == "__main__":
    main()
