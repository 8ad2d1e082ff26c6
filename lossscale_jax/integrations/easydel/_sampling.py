# pyright: reportMissingImports=false
# (EasyDeL is an optional dependency: the type check runs without it installed.)
"""EasyDeL's compiled generation sampling from float32 logits.

``jax.random.categorical`` draws its Gumbel noise in the logits' dtype. In float16 that
noise is a float16 uniform's (10 bits) through two logarithms: it never exceeds about 6.9
and never falls below about -2.3, so a token more than about 9.2 nats below the most likely
one is never sampled, and those a few nats below are sampled too rarely (5 nats below:
27.8% where the softmax says 29.8%; ``tests/test_integration_easydel.py`` measures it). An
RL trainer's rollouts then come from a truncated policy, which its loss takes for the
softmax. bfloat16's noise (7 bits) is coarser still: 7 nats below, 0.8% for 5.4%.
EasyDeL's eSurge engine, and Tunix's sampler, upcast the logits to float32 before
sampling; EasyDeL's compiled ``generate`` (its path without eSurge, a CPU's) samples in the
model's compute dtype. :func:`float32_sampling` gives that path a logits processor that
upcasts first: processors run before the warpers (temperature, top-k, top-p) and the draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from easydel.inference.logits_process import LogitsProcessor, LogitsProcessorList


class Float32Logits(LogitsProcessor):
    """The next token's logits in float32 (as EasyDeL's eSurge sampler takes them)."""

    def __call__(self, input_ids: Any, scores: Any, cur_len: int) -> Any:
        return scores.astype(jnp.float32)


def float32_sampling(kwargs: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """The trainer's ``_default_generation_kwargs`` (``kwargs``: what every generation
    function it compiles is given) with :class:`Float32Logits` last among its logits
    processors."""

    def with_float32_logits() -> dict[str, Any]:
        out = dict(kwargs())
        own = out.get("logits_processor")
        out["logits_processor"] = LogitsProcessorList([*(own or ()), Float32Logits()])
        return out

    return with_float32_logits
