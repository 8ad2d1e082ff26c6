"""The overflow check alone vs the check with the maximum in the same reductions (timing).

Gradients shaped like the benchmark's ``mlp_20m`` (18.9M float16 entries, 8 leaves) and
``deep_300`` (300 leaves); the two jitted functions run interleaved, 9 rounds of 20 calls, the
order alternating; reported: the median over rounds of the ratio check+max / check.

Run: ``python experiments/headroom/time_check.py``
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import fused_check  # noqa: E402

import lossscale_jax as lsj  # noqa: E402


def grads_of(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s), jnp.float16) for s in shapes]


CASES = {
    "mlp_20m": [
        (784, 2048),
        (2048,),
        (2048, 4096),
        (4096,),
        (4096, 2048),
        (2048,),
        (2048, 10),
        (10,),
    ],
    "deep_300": [(140, 140), (140,)] * 150,
}


def main() -> None:
    for name, shapes in CASES.items():
        g = grads_of(shapes)
        fns = {
            "check": jax.jit(lambda g: lsj.check_overflow(g)),
            "check+max": jax.jit(lambda g: fused_check.check_and_amax(g)),
        }
        for f in fns.values():
            jax.block_until_ready(f(g))
        ratios = []
        for r in range(9):
            t = {}
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for k in order:
                t0 = time.perf_counter()
                for _ in range(20):
                    out = fns[k](g)
                jax.block_until_ready(out)
                t[k] = time.perf_counter() - t0
            ratios.append(t["check+max"] / t["check"])
        n = sum(int(np.prod(s)) for s in shapes)
        print(
            f"{name}: {n / 1e6:.1f}M entries, {len(shapes)} leaves: check+max / check = "
            f"{np.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
            f"check {t['check'] / 20 * 1e3:.2f} ms/call in the last round"
        )


if __name__ == "__main__":
    main()
