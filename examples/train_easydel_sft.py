"""SFT in EasyDeL in float32 and in float16, the second with one line added.

EasyDeL (``easydel``) trains its own models with its own trainers. In float16 (float32
parameters, the model computing in float16) stock EasyDeL's gradient norms are nan at
the first step and the run stops on a nan loss: its ``RMSNorm`` upcasts only float8 and
float4, and the backward pass of its ``rsqrt`` overflows in float16. One line after the
trainer is built::

    lsj_easydel.enable(trainer)

makes the model compute in float16 with its norms and its loss in float32, wraps the
optimizer with loss scaling and rebuilds EasyDeL's step to take scaled gradients and
skip a step whose gradients overflow (``lossscale_jax.integrations.easydel``). This
script trains a tiny Llama (``LlamaConfig``, no download: token ``i`` is the word
``t{i}``) on random token sequences both ways and prints each step's loss, the loss
scale and the gradient norm; the float16 losses track the float32 ones.

On a CPU without torch: EasyDeL's model modules import Hugging Face's torch models to
patch them (``without_torch`` marks those as having nothing to patch), and its
``EASYDEL_AUTO`` setup adds GPU flags to ``XLA_FLAGS`` that a CPU-only jaxlib refuses
(set to ``0`` here).

Run: ``python examples/train_easydel_sft.py`` (about a minute on 2 CPU cores;
``--steps`` to change the length). Needs EasyDeL: ``docs/easydel.md`` says how to
install it beside this package.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import tempfile
import types
from typing import Any

os.environ.setdefault(
    "EASYDEL_AUTO", "0"
)  # before EasyDeL is imported (see the docstring)

# Hugging Face's torch modules EasyDeL 0.3.0's model modules patch at import.
TORCH_PATCHED = ("dbrx", "llama4", "qwen3_next", "qwen3_5_moe", "phimoe", "glm4v_moe")


def without_torch() -> None:
    """Where torch is not installed: each Hugging Face torch module EasyDeL patches at
    import is an empty module, so EasyDeL finds nothing to patch (it patches what it
    finds)."""
    if importlib.util.find_spec("torch") is not None:
        return
    for name in TORCH_PATCHED:
        package = importlib.import_module(f"transformers.models.{name}")
        setattr(package, f"modeling_{name}", types.ModuleType(f"modeling_{name}"))


without_torch()

import easydel as ed  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from datasets import Dataset  # noqa: E402
from flax import nnx  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import lossscale_jax as lsj  # noqa: E402
from lossscale_jax.integrations import easydel as lsj_easydel  # noqa: E402

VOCAB, LENGTH, BATCH = 64, 16, 4


def tokenizer() -> Any:
    """A word-level tokenizer: token ``i`` is ``t{i}``; then ``<pad>``, ``<eos>``."""
    vocab = {f"t{i}": i for i in range(VOCAB)} | {"<pad>": VOCAB, "<eos>": VOCAB + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def tiny_llama(dtype: Any = jnp.float32, seed: int = 0) -> Any:
    """A 2-layer Llama with float32 parameters computing in ``dtype``."""
    config = ed.LlamaConfig(
        vocab_size=VOCAB + 2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return ed.LlamaForCausalLM(
        config=config,
        dtype=dtype,
        param_dtype=jnp.float32,
        precision=None,
        rngs=nnx.Rngs(seed),
    )


def dataset(rows: int = 64, seed: int = 0) -> Any:
    """Pre-tokenised random sequences (EasyDeL's SFT trainer takes ``input_ids`` as
    they are)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (rows, LENGTH))
    return Dataset.from_list(
        [
            {"input_ids": [int(t) for t in row], "attention_mask": [1] * LENGTH}
            for row in ids
        ]
    )


def run_arguments(steps: int, directory: str) -> dict[str, Any]:
    """What every trainer's config here takes: ``steps`` steps, a log line each, no
    saves, no wandb."""
    return {
        "learning_rate": 1e-3,
        "max_training_steps": steps,
        "num_train_epochs": 1,
        "do_last_save": False,
        "save_steps": None,
        "use_wandb": False,
        "report_steps": 1,
        "log_steps": 1,
        "save_directory": directory,
    }


def sft_trainer(
    model: Any, steps: int, directory: str, data: Any = None, **config: Any
) -> Any:
    """EasyDeL's ``SFTTrainer`` over ``data`` (default :func:`dataset`), ``steps``
    steps, no saves; ``config``: more of its ``SFTConfig``."""
    arguments = ed.SFTConfig(
        **{
            "max_length": LENGTH,
            "total_batch_size": BATCH,
            "packing": False,
            "dataset_text_field": None,
            **run_arguments(steps, directory),
            **config,
        }
    )
    return ed.SFTTrainer(
        arguments=arguments,
        processing_class=tokenizer(),
        model=model,
        train_dataset=dataset() if data is None else data,
    )


def train(trainer: Any) -> tuple[list[dict[str, float]], Any]:
    """Trains ``trainer``: the metrics EasyDeL logged each step (``log_metrics``) and
    the final state (EasyDeL donates the state it starts from)."""
    logged: list[dict[str, float]] = []
    log = trainer.log_metrics

    def log_metrics(metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if "train/loss" in metrics:
            numbers = {k: _number(v) for k, v in metrics.items()}
            logged.append({k: v for k, v in numbers.items() if v is not None})
        return log(metrics, *args, **kwargs)

    trainer.log_metrics = log_metrics
    return logged, trainer.train().state


def _number(value: Any) -> float | None:
    """``value`` as a float, where it is a number (a host or device scalar)."""
    if isinstance(value, bool | str) or value is None or np.ndim(value) != 0:
        return None
    return float(np.asarray(value))


def main(steps: int = 8) -> dict[str, list[dict[str, float]]]:
    runs = {}
    with tempfile.TemporaryDirectory() as directory:
        plain = sft_trainer(
            tiny_llama(jnp.float32), steps, str(pathlib.Path(directory, "f32"))
        )
        runs["float32"] = train(plain)[0]
        half = sft_trainer(
            tiny_llama(jnp.float32), steps, str(pathlib.Path(directory, "f16"))
        )
        lsj_easydel.enable(half, lsj.DynamicScale(init_scale=2.0**15))  # the one line
        runs["float16"] = train(half)[0]
    print("step  loss f32  loss f16     scale  grad norm f16")
    for a, b in zip(runs["float32"], runs["float16"], strict=False):
        step, scale = int(b["train/train_step"]), b["train/loss_scale/loss_scale"]
        loss32, loss16 = a["train/loss"], b["train/loss"]
        norm = b["train/train/max_grad_norm"]
        print(f"{step:>4} {loss32:>9.5f} {loss16:>9.5f} {scale:>9.0f} {norm:>14.5f}")
    return runs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    main(parser.parse_args().steps)
