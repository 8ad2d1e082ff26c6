"""The digits job (``examples/train_digits.py``) with the headroom prototype as a configuration.

The job's own ``run``/``summarize``/``format_table``; its train step is the job's with the
step's gradient range written into the prototype state first (``proto.measure``).

Run: ``python experiments/headroom/run_digits.py --out /tmp/headroom_digits [--loss-weight W]``
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import model  # noqa: E402
import proto  # noqa: E402
import train_digits as digits  # noqa: E402

import lossscale_jax as lsj  # noqa: E402


@jax.jit
def train_step(state, x, y, weight):
    """The job's step, with the gradient range measured first (prototype states only)."""
    grads, stats, loss = digits.grads_of(
        state.apply_fn, state.params, state.batch_stats, x, y, state.opt_state, weight
    )
    scale = lsj.get_loss_scale_state(state.opt_state).scale
    state = state.replace(opt_state=proto.measure(state.opt_state, grads))
    state = state.apply_gradients(grads=grads, batch_stats=stats)
    return state, dict(loss=loss, scale=scale, skipped=lsj.metrics(state.opt_state)["skipped"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--margin", type=int, default=1)
    p.add_argument("--window", type=float, default=100.0)
    p.add_argument(
        "--library", action="store_true", help="lossscale_jax.HeadroomScale, not the prototype"
    )
    a, rest = p.parse_known_args(argv)
    if a.library:
        policy = lsj.HeadroomScale(min_margin=a.margin, window=int(a.window))
    else:
        h = model.Headroom(init_scale=2.0**15, min_margin=a.margin, window=a.window)
        policy = proto.HeadroomProto(h)
        digits.train_step = train_step
    digits.CONFIGS = {
        "fp32": digits.CONFIGS["fp32"],
        "fp16, dynamic": digits.CONFIGS["fp16, dynamic"],
        "fp16, headroom": (digits.F16, policy),
    }
    digits.main(rest + ["--no-progress"])


if __name__ == "__main__":
    main()
