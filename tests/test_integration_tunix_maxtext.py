"""``lossscale_jax.integrations.tunix`` on MaxText's post-training (maxtext 0.2.5).

Run where google-tunix and maxtext are installed (``make test-tunix`` installs both in its
venv); elsewhere the module is skipped, saying which is missing. The model is MaxText's own
(``from_pretrained`` of a Qwen3 config cut to 2 layers of width 32, float32 weights, on one
CPU device); it is trained as MaxText's ``train_sft`` and ``train_dpo`` train it: SFT by
``MaxTextPeftTrainer`` with MaxText's loss on the bare Transformer, DPO by Tunix's
``DPOTrainer`` on the ``TunixMaxTextAdapter``. The references: the same run in float32
without the integration; the model MaxText builds with ``dtype=float16``, bit for bit; the
model and the trainer before a refused ``enable()``.

MaxText is imported by a fixture, not when the module is collected (about 25 s). Importing
its Tunix adapter replaces ``jax.lax.with_sharding_constraint`` and ``jax.lax.top_k``
process-wide with shims that call the originals and fall back only where those raise.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale_jax as lsj
from lossscale_jax.errors import IntegrationError

MISSING = [m for m in ("tunix", "maxtext") if importlib.util.find_spec(m) is None]
if MISSING:
    pytest.skip(
        f"{' and '.join(MISSING)} not installed (optional: make test-tunix installs "
        "google-tunix and maxtext in a venv of its own and runs this module)",
        allow_module_level=True,
    )

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Tunix's imports
    from flax import nnx
    from tunix.sft import peft_trainer
    from tunix.sft.dpo import dpo_trainer

    from lossscale_jax.integrations import tunix as lsj_tunix

# Deprecations on this JAX and Flax of the APIs Tunix and MaxText call (theirs, not the
# library's), and the logger lines MaxText's imports print as warnings.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning"),
]

VOCAB, LENGTH, ROWS, STEPS = 64, 16, 2, 4
BAD = VOCAB - 1  # a batch whose first token is this gets an inf loss
LR = 1e-2
POLICY = functools.partial(lsj.DynamicScale, init_scale=2.0**10)


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    """MaxText's modules, and its config of the tiny Qwen3 by compute dtype."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import maxtext.configs
        from maxtext.configs import pyconfig
        from maxtext.trainers.post_train.sft import train_sft
        from maxtext.utils import model_creation_utils

    base = os.path.join(os.path.dirname(maxtext.configs.__file__), "base.yml")
    out = str(tmp_path_factory.mktemp("maxtext"))

    def config(dtype: str):
        return pyconfig.initialize(
            ["", base],
            model_name="qwen3-0.6b",  # its architecture (and the adapter's weight names)
            override_model_config=True,
            base_num_decoder_layers=2,
            base_emb_dim=32,
            base_num_query_heads=4,
            base_num_kv_heads=2,
            head_dim=8,
            base_mlp_dim=64,
            vocab_size=VOCAB,
            max_target_length=LENGTH,
            per_device_batch_size=ROWS,
            dtype=dtype,  # the compute dtype
            weight_dtype="float32",
            attention="dot_product",
            run_name="tiny",
            base_output_directory=out,
            enable_checkpointing=False,
            skip_jax_distributed_system=True,
            dataset_type="synthetic",
            hardware="cpu",
        )

    def build(dtype: str, **kwargs):
        cfg = config(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            model, mesh = model_creation_utils.from_pretrained(
                cfg, devices=jax.devices()[:1], **kwargs
            )
        return cfg, model, mesh

    return types.SimpleNamespace(config=config, build=build, train_sft=train_sft)


def history(trainer, name):
    return [float(v) for v in trainer.metrics_logger.get_metric_history("", name, "train")]


# --------------------------------------------------------------------------
# SFT: MaxTextPeftTrainer, MaxText's loss, the bare Transformer.


def sft_batches(n, bad=()):
    """Packed-style MaxText batches (inputs, targets, positions, segment ids): rows of 8-16
    real tokens, the rest padding (segment 0)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        tokens = np.zeros((ROWS, LENGTH + 1), np.int32)
        segments = np.zeros((ROWS, LENGTH), np.int32)
        for row in range(ROWS):
            k = int(rng.integers(8, LENGTH + 2))
            tokens[row, :k] = rng.integers(1, BAD, k)
            segments[row, : k - 1] = 1
        if i in bad:
            tokens[0, 0] = BAD
        positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH)).copy()
        out.append(
            {
                "inputs": tokens[:, :-1],
                "inputs_position": positions,
                "inputs_segmentation": segments,
                "targets": tokens[:, 1:],
                "targets_position": positions,
                "targets_segmentation": segments,
            }
        )
    return out


def with_fault(loss_fn):
    """MaxText's loss, times inf on a batch whose first token is ``BAD``."""

    def loss(model, **inputs):
        value, aux = loss_fn(model, **inputs)
        return value * jnp.where(inputs["inputs"][0, 0] == BAD, jnp.inf, 1.0), aux

    return loss


def sft_trainer(mt, dtype, *, accumulate=None, cls=None):
    """A MaxTextPeftTrainer as MaxText's train_sft builds it (loss included); its mesh."""
    cfg, model, mesh = mt.build(dtype)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9, max_steps=STEPS + 1, gradient_accumulation_steps=accumulate
    )
    with jax.set_mesh(mesh):
        cls = cls or mt.train_sft.MaxTextPeftTrainer
        trainer = mt.train_sft.use_maxtext_loss_function(cls(model, optax.adamw(LR), config), cfg)
    trainer.with_loss_fn(with_fault(trainer.loss_fn), has_aux=True)
    return trainer, mesh


def sft(mt, dtype, *, enable, steps=STEPS, bad=(), compute_dtype=jnp.float16):
    trainer, mesh = sft_trainer(mt, dtype)
    trainer.config.max_steps = steps
    with jax.set_mesh(mesh):
        if enable:
            lsj_tunix.enable(trainer, POLICY(), compute_dtype=compute_dtype)
        trainer.train(sft_batches(steps, bad), cache_nnx_graph=True)  # as train_sft does
    return trainer


def test_sft_trains_in_float16_through_maxtexts_config_and_its_own_step(mt, monkeypatch):
    stock = sft(mt, "float32", enable=False)
    want, want_norm = history(stock, "loss"), history(stock, "grad_norm")
    # MaxText's own step, counted: enable() keeps it (built by MaxText's method).
    cls, built = mt.train_sft.MaxTextPeftTrainer, []
    own = cls.create_train_step_fn
    monkeypatch.setattr(cls, "create_train_step_fn", lambda self: built.append(1) or own(self))
    # Built computing in float32 and switched by enable(); built by MaxText in float16.
    switched = sft(mt, "float32", enable=True, steps=STEPS + 1, bad=(STEPS,))
    assert built, "MaxText's create_train_step_fn was not called"
    native = sft(mt, "float16", enable=True, steps=STEPS + 1, bad=(STEPS,))
    config = switched.model.config
    assert np.dtype(config.dtype) == np.float16 and np.dtype(config.weight_dtype) == np.float32
    params = nnx.state(switched.model, nnx.Param)
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {np.dtype(np.float32)}
    # The switched model is the one MaxText builds for dtype=float16: the same program, the
    # same numbers bit for bit (one process, one host; nan where the last step overflows).
    for name in ("loss", "grad_norm", "loss_scale/loss_scale"):
        np.testing.assert_array_equal(history(switched, name), history(native, name), name)
    got = history(switched, "loss")[:STEPS]
    assert np.all(np.isfinite(got)) and history(switched, "loss_scale/skipped")[:STEPS] == [0.0] * 4
    # Step 1, the same weights: float16 rounds each op's result to 2**-11 relative (MaxText's
    # matmuls and its softmax and cross-entropy sum in float32): a 2-layer model's loss
    # agrees well within 0.5%, the unscaled gradient norm within a few percent. Adam at lr
    # 1e-2 moves every weight by about lr whatever its gradient's size, so the runs part
    # from step 2 on; float16 follows float32 within 5%.
    np.testing.assert_allclose(got[0], want[0], rtol=5e-3)
    np.testing.assert_allclose(history(switched, "grad_norm")[0], want_norm[0], rtol=0.05)
    np.testing.assert_allclose(got, want, rtol=0.05)
    # The last batch overflows: skipped by MaxText's step, the scale backed off.
    assert history(switched, "loss_scale/skipped") == [0.0] * STEPS + [1.0]
    assert history(switched, "loss_scale/loss_scale")[-1] == 2.0**9
    assert not np.isfinite(history(switched, "grad_norm")[-1])
    assert int(switched.optimizer.step[...]) == STEPS and switched.train_steps == STEPS + 1


# --------------------------------------------------------------------------
# DPO: Tunix's DPOTrainer on MaxText's TunixMaxTextAdapter.


def dpo_batches(n):
    """Tokenized DPO inputs: prompts left-padded, chosen and rejected right-padded (6 each)."""
    rng = np.random.default_rng(1)

    def side(left):
        ids = np.zeros((ROWS, 6), np.int32)
        for row in range(ROWS):
            k = int(rng.integers(3, 7))
            if left:
                ids[row, 6 - k :] = rng.integers(1, VOCAB, k)
            else:
                ids[row, :k] = rng.integers(1, VOCAB, k)
        return ids, (ids != 0).astype(np.int32)

    out = []
    for _ in range(n):
        (p, pm), (c, cm), (r, rm) = side(True), side(False), side(False)
        out.append(
            dpo_trainer.TrainingInput(
                prompt_ids=p,
                prompt_mask=pm,
                chosen_ids=c,
                chosen_mask=cm,
                rejected_ids=r,
                rejected_mask=rm,
            )
        )
    return out


def dpo_trainer_of(mt, dtype):
    """Tunix's DPOTrainer as MaxText's train_dpo builds it: the adapter, its clone as the
    reference; its mesh."""
    _, model, mesh = mt.build(dtype, wrap_with_tunix_adapter=True, tokenizer_pad_id=0)
    config = dpo_trainer.DPOTrainingConfig(eval_every_n_steps=10**9, max_steps=STEPS)
    trainer = dpo_trainer.DPOTrainer(
        model=model, ref_model=nnx.clone(model), optimizer=optax.adamw(LR), training_config=config
    )
    return trainer, mesh


def dpo(mt, *, enable):
    trainer, mesh = dpo_trainer_of(mt, "float32")
    with jax.set_mesh(mesh):
        if enable:
            lsj_tunix.enable(trainer, POLICY())
        trainer.train(dpo_batches(STEPS))
    return trainer


def test_dpo_on_maxtexts_adapter_trains_in_float16(mt):
    stock = dpo(mt, enable=False)
    trainer = dpo(mt, enable=True)
    # The adapter holds no config: its Transformer's is switched; the reference (a clone)
    # keeps computing as built.
    assert np.dtype(trainer.model.base.config.dtype) == np.float16
    assert np.dtype(trainer.ref_model.base.config.dtype) == np.float32
    got, want = history(trainer, "loss"), history(stock, "loss")
    assert history(trainer, "loss_scale/skipped") == [0.0] * STEPS and np.all(np.isfinite(got))
    assert len(history(trainer, "rewards/margin")) == STEPS  # DPOTrainer's own aux, logged
    # Step 1: the stock loss is log 2 (policy = reference); in float16 the policy's
    # log-probs are rounded (2**-11 relative per op, over 6 completion tokens), the
    # reference's are not: the margin is a few 1e-3 and the loss within 0.5% of log 2. The
    # runs then part as SFT's do (Adam at lr 1e-2): within 5%.
    np.testing.assert_allclose(want[0], np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=5e-3)
    np.testing.assert_allclose(
        history(trainer, "grad_norm")[0], history(stock, "grad_norm")[0], rtol=0.05
    )
    np.testing.assert_allclose(got, want, rtol=0.05)


# --------------------------------------------------------------------------
# What enable() refuses on MaxText's trainers, and what a refusal leaves.


def snapshot(trainer):
    """The trainer's attributes, and its model's: every module's own attributes (config,
    dtypes, submodules), by identity, and its arrays, by value."""
    attributes = dict(vars(trainer))
    modules = {
        (path, name): value
        for path, module in nnx.iter_graph(trainer.model)
        if isinstance(module, nnx.Module)
        for name, value in vars(module).items()
    }
    arrays = jax.tree_util.tree_map(_numpy, nnx.to_pure_dict(nnx.state(trainer.model)))
    return attributes, modules, arrays


def _numpy(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # the model's RNG keys
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_untouched(before, after):
    (attrs, modules, arrays), (attrs2, modules2, arrays2) = before, after
    assert attrs.keys() == attrs2.keys()
    assert [k for k in attrs if attrs[k] is not attrs2[k]] == []
    assert modules.keys() == modules2.keys()
    assert [k for k in modules if modules[k] is not modules2[k]] == []
    jax.tree_util.tree_map(np.testing.assert_array_equal, arrays, arrays2)


def refusals(mt):
    """(what is refused, the trainer, the message): each with a compute dtype to switch."""
    cls = mt.train_sft.MaxTextPeftTrainer
    overriding = type("Overriding", (cls,), {"create_train_step_fn": lambda self: None})
    trainer, _ = sft_trainer(mt, "float32", cls=overriding)
    yield trainer, r"Overriding overrides PeftTrainer\.create_train_step_fn"
    trainer, _ = sft_trainer(mt, "float32", accumulate=2)
    yield trainer, r"grad_accumulator.*gradient_accumulation_steps=1 \(it has 2\)"
    # A layer that kept its compute dtype in a function: the switch would miss it.
    trainer, _ = sft_trainer(mt, "float32")
    layer = trainer.model.decoder.layers.mlp
    layer.cast = functools.partial(jnp.asarray, dtype=layer.dtype)
    yield trainer, r"decoder/layers/mlp\.cast holds its float32 in a function.*dtype=float16"


def test_a_refusal_leaves_the_model_and_the_trainer_untouched(mt):
    for trainer, message in refusals(mt):
        before = snapshot(trainer)
        with pytest.raises(IntegrationError, match=message):
            lsj_tunix.enable(trainer, POLICY())
        assert_untouched(before, snapshot(trainer))
        assert not isinstance(trainer.optimizer, lsj.LossScaleOptimizer)


def test_compute_dtype_none_reads_maxtexts_config(mt):
    # The adapter has no config of its own: the default policy follows its Transformer's
    # dtype (a loss scale for float16, none for float32).
    for dtype, scale in (("float16", 2.0**15), ("float32", 1.0)):
        trainer, _ = dpo_trainer_of(mt, dtype)
        lsj_tunix.enable(trainer, compute_dtype=None)
        state = nnx.as_pure(trainer.optimizer.opt_state)
        assert float(lsj.metrics(state)["loss_scale"]) == scale, dtype
        assert np.dtype(trainer.model.base.config.dtype) == np.dtype(dtype)  # as built
