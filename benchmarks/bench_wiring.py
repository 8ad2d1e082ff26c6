"""The wiring check's share of a step's trace: the README's step traced with the check on and
off, on a GPT of 23M parameters (6 layers, width 512, vocabulary 8192, sequence 256).

  python benchmarks/bench_wiring.py [--rounds 7] [--layers 6] [--width 512]

Each round traces the step twice, check on and check off (``lsj.no_wiring_check()``), in an
order that alternates between rounds, each time from a fresh function (``jax.jit`` keeps no
trace of it). Tracing is Python on one thread: the process's CPU time is measured (a busy
machine stretches wall time, not that), the same process measures both, and the ratio of the
two is what the check adds. Printed: the median trace time of each, and the median over
rounds of the round's ratio (with its range). The bar: the check's own time within 10% of
the step's trace.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.workloads import init_params, lm_shapes, make_batch, make_lm_loss, to16  # noqa: E402

import lossscale_jax as lsj  # noqa: E402


def build(layers: int, width: int) -> tuple:
    spec = {
        "kind": "lm",
        **{"vocab": 8192, "d": width, "layers": layers, "heads": 8, "seq": 256, "batch": 4},
    }
    rng = np.random.default_rng(0)
    params = init_params(spec, "in_out", rng)
    tokens, targets = make_batch(spec, rng)
    loss = make_lm_loss(spec)
    tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale(init_scale=2.0**12))
    state = tx.init(params)
    count = sum(
        int(np.prod(s))
        for s in jax.tree_util.tree_leaves(lm_shapes(spec), is_leaf=lambda s: isinstance(s, tuple))
    )

    def step(params, opt_state, tokens, targets):  # the README's step
        def scaled(p):
            return lsj.scale_loss(loss(to16(p), tokens, targets), opt_state)

        grads = jax.grad(scaled)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, state, tokens, targets), count


def trace_seconds(step, args, checked: bool) -> float:
    fresh = lambda *a: step(*a)  # noqa: E731 - a new function: no cached trace
    start = time.process_time()  # this process's CPU time: tracing is Python, on one thread
    if checked:
        jax.jit(fresh).trace(*args)
    else:
        with lsj.no_wiring_check():
            jax.jit(fresh).trace(*args)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    step, inputs, count = build(args.layers, args.width)
    trace_seconds(step, inputs, True)  # warm: imports, caches of jnp functions
    on, off, ratios = [], [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {checked: trace_seconds(step, inputs, checked) for checked in order}
        on.append(got[True])
        off.append(got[False])
        ratios.append(got[True] / got[False])
    print(f"jax {jax.__version__}, GPT {count / 1e6:.1f}M params, {args.rounds} rounds")
    print(f"trace, check off: {statistics.median(off) * 1e3:.0f} ms CPU (median)")
    print(f"trace, check on:  {statistics.median(on) * 1e3:.0f} ms CPU (median)")
    print(
        f"on / off: {statistics.median(ratios):.3f}x "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}): the check adds "
        f"{(statistics.median(ratios) - 1) * 100:.1f}% to the step's trace"
    )


if __name__ == "__main__":
    main()
