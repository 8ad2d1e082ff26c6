"""The main job (``examples/train_gpt.py``) with the headroom prototype as one more configuration.

Runs the job's own ``run``/``result_rows``/``format_table`` (same seeds, weights, batches,
probes and table) on ``fp32``, ``fp16_dynamic`` and ``fp16_headroom``; the only change to the
job is its optimizer step, which first writes the step's gradient range into a prototype
state (``proto.measure``) and otherwise is the job's ``apply_gradients``.

Run: ``python experiments/headroom/run_gpt.py --out /tmp/headroom_gpt [--steps N --seeds K]
[--margin 1 --window 100 --init-scale 19]``
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import model  # noqa: E402
import proto  # noqa: E402
import train_gpt as gpt  # noqa: E402

import lossscale_jax as lsj  # noqa: E402


@jax.jit
def apply_gradients(state: lsj.TrainState, grads):
    """The job's step, with the gradient range measured first (prototype states only)."""
    state = state.replace(opt_state=proto.measure(state.opt_state, grads))
    scale = lsj.get_loss_scale_state(state.opt_state).scale
    state = state.apply_gradients(grads=grads)
    return state, scale, lsj.get_loss_scale_state(state.opt_state).last_skipped


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--steps", type=int, default=gpt.STEPS)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--margin", type=int, default=1)
    p.add_argument("--window", type=float, default=100.0)
    p.add_argument("--margin-interval", type=int, default=2000)
    p.add_argument("--init-scale", type=int, default=19, help="log2 of the initial scale")
    p.add_argument("--configs", default="fp32,fp16_dynamic,fp16_headroom")
    a = p.parse_args(argv)
    h = model.Headroom(
        init_scale=2.0**a.init_scale,
        min_margin=a.margin,
        window=a.window,
        margin_interval=a.margin_interval,
        max_scale=math.inf,
    )
    headroom = gpt.Config("fp16_headroom", gpt.F16, proto.HeadroomProto(h))
    known = {c.name: c for c in gpt.CONFIGS} | {headroom.name: headroom}
    gpt.CONFIGS = tuple(known[n] for n in a.configs.split(","))
    gpt.apply_gradients = apply_gradients
    out = gpt.main(
        ["--out", str(a.out), "--steps", str(a.steps), "--seeds", str(a.seeds), "--no-progress"]
    )
    # Per-row scale and skip traces, for the report.
    traces = []
    for name, r in out["job"]["results"].items():
        for i, (setting, seed) in enumerate(out["job"]["rows"]):
            hist = r["history"][i]
            traces.append(
                dict(
                    config=name,
                    setting=setting.name,
                    seed=seed,
                    scale=[float(x) for x in hist["scale"]],
                    skipped=[bool(x) for x in hist["skipped"]],
                )
            )
    (a.out / "traces.json").write_text(json.dumps(traces) + "\n")


if __name__ == "__main__":
    main()
