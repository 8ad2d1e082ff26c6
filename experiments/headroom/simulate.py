"""Replays the headroom rule (``model.py``) on the ceilings ``measure_ceiling.py`` recorded.

Each probe is one step: the rule's scale overflows when it exceeds that step's real ceiling
``2**c``; otherwise the rule sees ``amax = m / 65504``. Prints, per variant, the overflows
and the mean distance below the ceiling (octaves; the underflow side of the trade).

Run: ``python experiments/headroom/simulate.py /tmp/ceiling.json``
"""

from __future__ import annotations

import json
import math
import sys

import model
import numpy as np

F16_MAX = 65504.0

VARIANTS = {
    "m0 fixed w100": model.Headroom(min_margin=0, grow_margin=False),
    "m1 fixed w100": model.Headroom(min_margin=1, grow_margin=False),
    "m2 fixed w100": model.Headroom(min_margin=2, grow_margin=False),
    "m0 adapt w100": model.Headroom(min_margin=0),
    "m1 adapt w100": model.Headroom(min_margin=1),
    "m0 adapt w25": model.Headroom(min_margin=0, window=25),
    "m1 adapt w25": model.Headroom(min_margin=1, window=25),
    "m0 adapt w400": model.Headroom(min_margin=0, window=400),
    "m1 adapt w400": model.Headroom(min_margin=1, window=400),
    "m1 fixed w400": model.Headroom(min_margin=1, window=400, grow_margin=False),
    "m1 adapt w10": model.Headroom(min_margin=1, window=10),
}


def replay(h: model.Headroom, m: np.ndarray, c: np.ndarray, init_scale: float):
    h = model.Headroom(**{**h.__dict__, "init_scale": init_scale, "max_scale": math.inf})
    s = dict(h.init())
    over, below = 0, []
    for mt, ct in zip(m, c, strict=True):
        e = math.log2(float(s["scale"]))
        ovf = e > ct
        over += ovf
        if not ovf:
            below.append(ct - e)
        s = model.step(h, s, ovf, mt / F16_MAX)
    return over, float(np.mean(below))


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    for name, h in VARIANTS.items():
        parts = []
        for r in rows:
            init = 2.0**19 if r["setting"] == "mean" else 2.0**19
            o, b = replay(h, np.array(r["m"]), np.array(r["c"]), init)
            parts.append((r["setting"], o, b))
        by = {}
        for s, o, b in parts:
            by.setdefault(s, []).append((o, b))
        txt = "  ".join(
            f"{s}: over {sum(o for o, _ in v)}/{len(v) * len(rows[0]['m'])} "
            f"below {np.mean([b for _, b in v]):.2f}"
            for s, v in by.items()
        )
        print(f"{name:22s} {txt}")


if __name__ == "__main__":
    main(sys.argv[1])
