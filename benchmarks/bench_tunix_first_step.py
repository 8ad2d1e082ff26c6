"""The first step of Tunix's SFT trainer: ``enable()`` against stock Tunix, both in float16.

Tunix's trainer traces, compiles and runs its step on the first ``train`` call; that wait is
what a user feels at every start. Each measurement runs in a fresh process (no trace or
compilation cache warm from another), the two alternated (stock, then enabled, then stock,
...), and the ratio taken per round: the first step's wall time (trace, compile and run,
from one step's start to the next's, as Tunix's hooks see it) and a later step's (the median
of five compiled ones), enabled over stock. Stock Tunix's float16 is the baseline a user
would run instead: Tunix's Qwen3 built computing in float16 (its
``ModelConfig(dtype=float16)``), float32 parameters, no loss scale.

    python benchmarks/bench_tunix_first_step.py                  # width 256, 3 rounds
    python benchmarks/bench_tunix_first_step.py --width 32 --rounds 1   # a smoke run

Needs google-tunix (make test-tunix's venv: .venv-tunix/bin/python).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ("stock", "enabled")
STEPS = 6  # the first, then five compiled ones (their median is "a later step")


def child(variant: str, width: int) -> dict[str, float]:
    """One run in this process: the first step's and a later step's wall time."""
    import warnings

    warnings.simplefilter("ignore")
    sys.path.insert(0, str(ROOT))
    import importlib.util

    import jax.numpy as jnp
    import optax
    from tunix.sft import hooks, peft_trainer

    spec = importlib.util.spec_from_file_location("ex", ROOT / "examples/train_tunix_grpo.py")
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    sys.modules["ex"] = ex  # its dataclasses look their module up
    spec.loader.exec_module(ex)
    size = ex.Size(2, width, 4, max(width // 4, 8), 256, 0, 8, 32, 0, 0, 0, 0)
    batches = ex.sft_batches(size, STEPS, seed=3)
    with ex.entered(ex.mesh()):
        if variant == "stock":
            model = ex.qwen3(size, jnp.float16)  # computes in float16, float32 parameters
        else:
            model = ex.qwen3(size, jnp.float32)
        config = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=STEPS)
        trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-3), config)
        trainer.with_gen_model_input_fn(ex.model_inputs)
        starts: list[float] = []

        class Clock(hooks.TrainingHooks):
            def on_train_step_start(self, train_ctx: Any) -> None:
                # The previous step's outputs are on the host by the next step's start (its
                # loss is read to log it): a step's time is from one start to the next.
                starts.append(time.perf_counter())

            def on_train_start(self, train_ctx: Any) -> None:
                pass

            def on_train_step_end(self, train_ctx: Any, train_step: Any, train_loss: Any) -> None:
                pass

            def on_train_end(self, train_ctx: Any) -> None:
                pass

            def on_eval_step_start(self, train_ctx: Any) -> None:
                pass

            def on_eval_step_end(self, train_ctx: Any, eval_loss: Any) -> None:
                pass

        trainer.with_training_hooks(Clock())
        if variant == "enabled":
            from lossscale_jax.integrations import tunix as lsj_tunix

            lsj_tunix.enable(trainer, compute_dtype=jnp.float16)
        trainer.train(batches)
        end = time.perf_counter()
        steps = [b - a for a, b in zip(starts, [*starts[1:], end], strict=True)]
        first, later = steps[0], statistics.median(steps[1:])
    return {"first_step_s": first, "later_step_s": later}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256, help="the model's width (default 256)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh-process rounds (default 3)")
    ap.add_argument("--json", type=pathlib.Path, help="write the rows and ratios here")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.width < 8 or args.rounds < 1:
        ap.error(f"--width must be >= 8 and --rounds >= 1, got {args.width} and {args.rounds}")
    if args.child:
        print(json.dumps(child(args.child, args.width)))
        return []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    rows = []
    for r in range(args.rounds):
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--child", variant, "--width", str(args.width)]
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            row = {"round": r, "variant": variant, **json.loads(out.stdout.splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    ratios = {}
    for key in ("first_step_s", "later_step_s"):
        per_round = [
            next(x[key] for x in rows if x["round"] == r and x["variant"] == "enabled")
            / next(x[key] for x in rows if x["round"] == r and x["variant"] == "stock")
            for r in range(args.rounds)
        ]
        ratios[key] = statistics.median(per_round)
    print(
        f"Tunix SFT, width {args.width}, median of {args.rounds} fresh-process rounds: first "
        f"step {ratios['first_step_s']:.2f}x stock float16, a later step "
        f"{ratios['later_step_s']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
