"""The comparison table from the runs' JSON rows (``run_gpt.py`` outputs under ``results/``).

``fp32`` and ``fp16_dynamic`` come from the run that holds them (``results/gpt_w50m1``); each
headroom variant is a row group of its own. Val loss - fp32 is taken seed by seed.

Run: ``python experiments/headroom/compare.py`` (prints markdown)
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent / "results"
RUNS = {  # label: (directory, config name in it)
    "fp16_dynamic": ("gpt_w50m1", "fp16_dynamic"),
    "headroom proto, init 2^19, window 50": ("gpt_w50m1", "fp16_headroom"),
    "headroom proto, init 2^15, window 50": ("gpt_i15w50", "fp16_headroom"),
    "headroom proto, init 2^19, window 100": ("gpt_i19w100", "fp16_headroom"),
    "headroom proto, init 2^15, window 100": ("gpt_i15w100", "fp16_headroom"),
}
STEPS = 250


def rows(directory: str) -> list[dict]:
    return json.loads((HERE / directory / "gpt_results.json").read_text())


def ms(v) -> str:
    v = np.asarray(v, np.float64)
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}"


def main() -> None:
    ref = {
        (r["setting"], r["seed"]): r["val_loss"] for r in rows("gpt_w50m1") if r["config"] == "fp32"
    }
    print(
        "| config | setting | skipped steps | entries lost (mean, min-max) | val loss | "
        "val loss - fp32 (same seed) | final scale |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, (d, name) in RUNS.items():
        for setting in ("mean", "update_2^19"):
            rs = [r for r in rows(d) if r["config"] == name and r["setting"] == setting]
            skipped = sum(round(r["skipped_fraction"] * STEPS) for r in rs)
            lost = [100 * r["lost_fraction"] for r in rs]
            delta = [r["val_loss"] - ref[(setting, r["seed"])] for r in rs]
            exps = sorted({round(math.log2(r["final_scale"])) for r in rs})
            scale = f"2^{exps[0]}" + (f"-2^{exps[-1]}" if len(exps) > 1 else "")
            print(
                f"| {label} | {setting} | {skipped} of {STEPS * len(rs)} | "
                f"{np.mean(lost):.4f}% ({min(lost):.4f}-{max(lost):.4f}) | "
                f"{ms([r['val_loss'] for r in rs])} | "
                f"{np.mean(delta):+.3f} ± {np.std(delta, ddof=1):.3f} | "
                f"{scale} |"
            )


if __name__ == "__main__":
    main()
