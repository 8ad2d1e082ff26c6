"""What a benchmark case trains: the models, their parameters, batches and gradients.

A case is ``workload/layout/pattern/step``:

- workload: ``mlp_20m`` (4 dense layers, 18.9M params, 8 leaves), ``deep_300`` (150 residual
  layers of width 140, 2.96M params, 300 leaves); ``mlp_1m``, ``tiny``, ``tiny_deep``: smaller;
  ``lm_185m``, a decoder-only transformer language model the size GPU users train (d 1024,
  12 layers, 16 heads, vocabulary 32768, sequence 1024, batch 8: 185.6M params, 75 leaves;
  the embedding tied to the output), and ``lm_tiny``, the same code small enough for the
  test suite on CPU (in_out layout only: ``x @ w``);
- layout: ``in_out`` (kernels ``[in, out]``, ``h @ kernel``: Flax's ``nn.Dense``) or
  ``out_in`` (``[out, in]``, ``h @ kernel.T``: torch's ``nn.Linear``);
- pattern: ``fp16grad`` (gradients w.r.t. the float16 copy of float32 master weights) or
  ``fp32grad`` (w.r.t. the float32 params, cast inside the loss: what Flax's
  ``dtype=float16, param_dtype=float32`` modules give);
- step: ``full`` (forward, backward, scaler, Adam, apply) or ``post`` (scaler, Adam, apply on
  precomputed scaled gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale_jax as lsj

F16 = jnp.float16
F32 = jnp.float32
INIT_SCALE = 2.0**12
LR = 1e-4
BATCH = 32

WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp_1m": {"kind": "mlp", "widths": [384, 1024, 512, 256, 16]},
    "mlp_20m": {"kind": "mlp", "widths": [2048, 4096, 2048, 1024, 16]},
    "deep_300": {"kind": "resnet", "width": 140, "depth": 150},
    "tiny": {"kind": "mlp", "widths": [32, 64, 32, 16, 8]},
    "tiny_deep": {"kind": "resnet", "width": 16, "depth": 20},
    "lm_185m": {
        "kind": "lm",
        **{"vocab": 32768, "d": 1024, "layers": 12, "heads": 16, "seq": 1024, "batch": 8},
    },
    "lm_tiny": {
        "kind": "lm",
        **{"vocab": 256, "d": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 2},
    },
}
LAYOUTS = ("in_out", "out_in")
PATTERNS = ("fp16grad", "fp32grad")
KINDS = ("full", "post")

# The default run: the four headline cases (targets), the other layout and the fp32
# gradient pattern on the 20M model.
DEFAULT_CASES = (
    "mlp_20m/in_out/fp16grad/full",
    "mlp_20m/in_out/fp16grad/post",
    "deep_300/in_out/fp16grad/full",
    "deep_300/in_out/fp16grad/post",
    "mlp_20m/out_in/fp16grad/full",
    "mlp_20m/in_out/fp32grad/full",
)
QUICK_CASES = ("tiny/in_out/fp16grad/full", "tiny/in_out/fp16grad/post")
# The GPU results (``--gpu-results``): the language model, full and post step.
GPU_CASES = ("lm_185m/in_out/fp16grad/full", "lm_185m/in_out/fp16grad/post")


def check_case(case: str) -> None:
    """Raises ``ValueError`` unless ``case`` names a workload, layout, pattern and step."""
    parts = case.split("/")
    if (
        len(parts) != 4
        or parts[0] not in WORKLOADS
        or parts[1] not in LAYOUTS
        or parts[2] not in PATTERNS
        or parts[3] not in KINDS
    ):
        raise ValueError(
            f"--cases: {case!r} is not workload/layout/pattern/step with "
            f"workload in {list(WORKLOADS)}, layout in {LAYOUTS}, pattern in "
            f"{PATTERNS}, step in {KINDS}."
        )
    if WORKLOADS[parts[0]]["kind"] == "lm" and parts[1] != "in_out":
        raise ValueError(f"--cases: {case!r}: the language models have the in_out layout only.")


def dense_shapes(widths: list[int], layout: str) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        shapes += [(a, b) if layout == "in_out" else (b, a), (b,)]
    return shapes


def lm_shapes(spec: dict[str, Any]) -> dict[str, Any]:
    """The language model's parameter shapes, ``{name: shape}`` (blocks as sub-dicts)."""
    d, v = spec["d"], spec["vocab"]
    shapes: dict[str, Any] = {"emb": (v, d), "pos": (spec["seq"], d), "lnf": (d,)}
    for i in range(spec["layers"]):
        shapes[f"b{i:02d}"] = {
            "ln1": (d,),
            "qkv": (d, 3 * d),
            "proj": (d, d),
            "ln2": (d,),
            "fc": (d, 4 * d),
            "out": (4 * d, d),
        }
    return shapes


def param_count(workload: str) -> int:
    """The parameters of ``workload``, counted from its shapes (nothing is built)."""
    spec = WORKLOADS[workload]
    if spec["kind"] == "lm":
        shapes = jax.tree_util.tree_leaves(lm_shapes(spec), is_leaf=lambda s: isinstance(s, tuple))
    elif spec["kind"] == "mlp":
        shapes = dense_shapes(spec["widths"], "in_out")
    else:
        shapes = [(spec["width"], spec["width"]), (spec["width"],)] * spec["depth"]
    return int(sum(np.prod(s) for s in shapes))


def _init_lm(spec: dict[str, Any], rng: np.random.Generator) -> dict:
    """GPT-2's initialisation: normal(0.02), the residual projections scaled down by
    sqrt(2 * layers), layer-norm gains one."""
    small = 0.02 / np.sqrt(2 * spec["layers"])

    def init(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name.startswith("ln"):
            return jnp.ones(shape, F32)
        std = small if name in ("proj", "out") else 0.02
        return jnp.asarray(rng.normal(0.0, std, shape).astype(np.float32))

    return {
        k: {n: init(n, s) for n, s in v.items()} if isinstance(v, dict) else init(k, v)
        for k, v in lm_shapes(spec).items()
    }


def init_params(spec: dict[str, Any], layout: str, rng: np.random.Generator) -> dict:
    params = {}
    if spec["kind"] == "lm":
        return _init_lm(spec, rng)
    if spec["kind"] == "mlp":
        for i, shape in enumerate(dense_shapes(spec["widths"], layout)):
            fan_in = spec["widths"][i // 2]
            std = np.sqrt(2.0 / fan_in) if len(shape) == 2 else 0.01
            params[f"{i:03d}"] = jnp.asarray(rng.normal(0.0, std, shape), F32)
    else:
        w = spec["width"]
        for i in range(spec["depth"]):
            params[f"{2 * i:03d}"] = jnp.asarray(rng.normal(0.0, 0.02, (w, w)), F32)
            params[f"{2 * i + 1:03d}"] = jnp.asarray(rng.normal(0.0, 0.01, (w,)), F32)
    return params


def _layernorm(x, gain):
    """Layer norm computed in float32, the result in ``x``'s dtype (float16)."""
    x32 = x.astype(F32)
    mu = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mu).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * gain.astype(F32)).astype(x.dtype)


def _attention(q, k, v):
    """Causal attention, ``[batch, seq, heads, head_dim]``. On an accelerator
    ``jax.nn.dot_product_attention`` (what a GPU user calls: cuDNN's fused kernel where it
    applies); on CPU the same written out, since XLA:CPU refuses float16 dots that
    accumulate in float32."""
    if jax.default_backend() != "cpu":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(q.dtype), v)


def make_lm_forward(spec: dict[str, Any]) -> Callable:
    """The language model: ``forward(p16, tokens)``, the logits in float16, a decoder-only
    transformer (pre-norm blocks, GELU MLP of width 4d, the embedding tied to the output).
    Each block's output is a layer tap (``lsj.tap``)."""
    heads = spec["heads"]

    def forward(p, tokens):
        b, t = tokens.shape
        d = p["emb"].shape[1]
        h = p["emb"][tokens] + p["pos"][:t]
        for i in range(spec["layers"]):
            blk = p[f"b{i:02d}"]
            x = _layernorm(h, blk["ln1"])
            qkv = (x @ blk["qkv"]).reshape(b, t, 3, heads, d // heads)
            a = _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, t, d)
            h = h + a @ blk["proj"]
            x = _layernorm(h, blk["ln2"])
            h = h + jax.nn.gelu(x @ blk["fc"]) @ blk["out"]
            h = lsj.tap(h, f"block{i:02d}")
        return _layernorm(h, p["lnf"]) @ p["emb"].T

    return forward


def lm_loss_of_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of the next token, in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), targets).mean()


def make_lm_loss(spec: dict[str, Any]) -> Callable:
    """The language model's loss (``make_lm_forward``): the mean cross-entropy of the next
    token in float32."""
    forward = make_lm_forward(spec)

    def loss(p16, tokens, targets):
        return lm_loss_of_logits(forward(p16, tokens), targets)

    return loss


def make_loss(spec: dict[str, Any], layout: str) -> Callable:
    """A float16 forward pass; the loss comes back in float32.

    Each hidden layer's output (the residual stream after each block) is a layer tap
    (``lsj.tap``): the identity for every step but the per-layer one, which scales there."""

    def dense(h, kernel, bias):
        return (h @ kernel if layout == "in_out" else h @ kernel.T) + bias

    def forward(p, x):
        leaves = [p[k] for k in sorted(p)]
        h = x
        if spec["kind"] == "mlp":
            n = len(leaves) // 2
            for i in range(n):
                h = dense(h, leaves[2 * i], leaves[2 * i + 1])
                if i < n - 1:
                    h = lsj.tap(jax.nn.relu(h), f"layer{i:03d}")
        else:
            for i in range(len(leaves) // 2):
                h = h + jnp.tanh(dense(h, leaves[2 * i], leaves[2 * i + 1]))
                h = lsj.tap(h, f"block{i:03d}")
        return h

    def loss(p16, x, y):
        return jnp.mean(jnp.square(forward(p16, x) - y).astype(F32))

    return loss


def make_batch(spec: dict[str, Any], rng: np.random.Generator) -> tuple[jax.Array, jax.Array]:
    if spec["kind"] == "lm":  # tokens and the next tokens
        tokens = rng.integers(0, spec["vocab"], size=(spec["batch"], spec["seq"] + 1))
        return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)
    d_in, d_out = (
        (spec["widths"][0], spec["widths"][-1]) if spec["kind"] == "mlp" else (spec["width"],) * 2
    )
    x = jnp.asarray(rng.normal(size=(BATCH, d_in)), F16)
    y = jnp.asarray(rng.normal(size=(BATCH, d_out)) * 0.1, F16)
    return x, y


def to16(tree):
    return jax.tree_util.tree_map(lambda a: a.astype(F16), tree)


def cast_like(grads, params):
    return jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)


def value_and_grads(loss, params, x, y, pattern, scale):
    """The (unscaled) loss and the gradients of ``loss * scale`` in the user's pattern."""

    def scaled(p):
        value = loss(to16(p) if pattern == "fp32grad" else p, x, y)
        return (value if scale is None else value * scale), value

    target = params if pattern == "fp32grad" else to16(params)
    (_, value), grads = jax.value_and_grad(scaled, has_aux=True)(target)
    return value, grads


class Case(NamedTuple):
    """One case, built: ``args`` are what its step takes after ``(params, state)``: the batch
    ``(x, y)`` for a full step, the scaled gradients ``(grads,)`` for a post step."""

    workload: str
    layout: str
    pattern: str
    kind: str
    params: dict
    loss: Callable
    args: tuple


def build_case(case: str) -> Case:
    """Parameters, loss and step arguments of ``case``, from one seeded generator."""
    workload, layout, pattern, kind = case.split("/")
    spec = WORKLOADS[workload]
    rng = np.random.default_rng(0)
    params = init_params(spec, layout, rng)
    x, y = make_batch(spec, rng)
    if kind == "post":
        gdtype = F16 if pattern == "fp16grad" else F32
        # Scaled gradients as the backward pass would give them (|g| ~ 0.5 * 2**12 / 2**12).
        args = (
            jax.tree_util.tree_map(
                lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.5, gdtype), params
            ),
        )
    else:
        args = (x, y)
    loss = make_lm_loss(spec) if spec["kind"] == "lm" else make_loss(spec, layout)
    loss.example_batch = (x, y)  # pyright: ignore  # what lsj_layerwise finds its taps with
    return Case(workload, layout, pattern, kind, params, loss, args)
