"""``lossscale_jax.integrations.easydel``: EasyDeL's trainers in float16 with loss scaling.

Run where easydel is installed (``make test-easydel``: a venv of its own); elsewhere the
module is skipped, saying so, but for the error an import without EasyDeL raises. The model,
the tokenizer and the data are the example's (``examples/train_easydel_sft.py``: a tiny
Llama from ``LlamaConfig``, EasyDeL's ``SFTTrainer``). The references: the same trainer in
float32 without the integration (stock EasyDeL), stock EasyDeL in float16, a skipped step's
parameters bit for bit against those before it, and the softmax for JAX's categorical draw.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import load_script  # tests/ is on sys.path under pytest

import lossscale_jax as lsj
from lossscale_jax.errors import IntegrationError, IntegrationWarning

HAVE_EASYDEL = importlib.util.find_spec("easydel") is not None


def test_without_easydel_the_import_says_how_to_install_it():
    if HAVE_EASYDEL:
        pytest.skip("easydel is installed here: make test-easydel's venv runs the rest")
    with pytest.raises(IntegrationError, match=r"pip install 'lossscale_jax\[easydel\]'"):
        import lossscale_jax.integrations.easydel  # noqa: F401


if not HAVE_EASYDEL:
    pytest.skip(
        "easydel is not installed (an optional integration: make test-easydel installs it "
        "in a venv of its own and runs this module)",
        allow_module_level=True,
    )

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # EasyDeL's and its dependencies' imports
    EX = load_script("examples/train_easydel_sft.py")
    from flax import nnx

    from lossscale_jax.integrations import easydel as lsj_easydel
    from lossscale_jax.integrations._host import _dtype
    from lossscale_jax.integrations.easydel import _seams

pytestmark = [
    pytest.mark.slow,
    # EasyDeL 0.3.0 on this JAX and Flax: what its own modules use that JAX, Flax and its
    # dependencies deprecated. Those warnings are EasyDeL's, not the library's.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:easydel"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]
STEPS = 5


def trainer(tmp_path, dtype=jnp.float32, steps=STEPS, **config):
    return EX.sft_trainer(EX.tiny_llama(dtype), steps, str(tmp_path), **config)


def params(state):
    return jax.tree_util.tree_map(np.asarray, state.graphstate)


def test_the_example_float16_tracks_float32_step_for_step():
    runs = EX.main(STEPS)
    f32, f16 = runs["float32"], runs["float16"]
    assert len(f32) == len(f16) == STEPS
    for a, b in zip(f32, f16, strict=True):
        # float16 compute (float32 norms and loss): its rounding, measured ~3e-5 relative.
        assert abs(b["train/loss"] - a["train/loss"]) < 1e-3 * a["train/loss"]
        norm32, norm16 = a["train/train/max_grad_norm"], b["train/train/max_grad_norm"]
        assert abs(norm16 - norm32) < 0.02 * norm32  # unscaled: the scale is 2^15
        assert b["train/loss_scale/loss_scale"] == 2.0**15
        assert b["train/loss_scale/skipped"] == 0.0
    assert f16[-1]["train/loss_scale/skipped_steps"] == 0.0


def test_stock_easydel_in_float16_has_nan_gradients_and_stops(tmp_path):
    # What enable() fixes: EasyDeL's RMSNorm upcasts only float8/float4, and its backward
    # overflows in float16; the gradient norm is nan at the first step and the run stops.
    logged, _ = EX.train(trainer(tmp_path, jnp.float16))
    assert np.isnan(logged[0]["train/train/max_grad_norm"])
    assert len(logged) < STEPS


def test_enable_switches_the_compute_dtype_norms_and_loss_in_float32(tmp_path):
    t = trainer(tmp_path)
    before = params(t.model_state)
    lsj_easydel.enable(t)
    model = t.model_state.model
    own = {type(m).__name__: np.dtype(m.dtype) for m in _dtype.own_dtype_modules(model)}
    assert own["RMSNorm"] == np.float32
    assert {d for n, d in own.items() if "Norm" not in n} == {np.dtype(np.float16)}
    assert t.arguments.loss_config.compute_dtype == "fp32"
    after = params(t.model_state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)  # float32 kept
    state = lsj.get_loss_scale_state(t.model_state.opt_state)
    assert float(state.scale) == 2.0**15  # DynamicScale()'s default for float16
    assert t.tx is t.model_state.tx


def test_an_overflow_skips_the_window_with_the_parameters_bit_for_bit(tmp_path, caplog):
    # A scale float16 cannot hold the gradients at: every step overflows and is skipped,
    # the whole accumulation window's update with it (2 micro-batches a step). A static
    # scale does not lower itself: the third skip in a row is said to be stuck.
    t = trainer(tmp_path, steps=3, gradient_accumulation_steps=2)
    lsj_easydel.enable(t, lsj.StaticScale(2.0**40))
    before = params(t.model_state)
    with caplog.at_level(logging.WARNING, "lossscale_jax.integrations.easydel"):
        logged, state = EX.train(t)
    assert [m["train/loss_scale/skipped"] for m in logged] == [1.0, 1.0, 1.0]
    assert logged[-1]["train/loss_scale/skipped_steps"] == 3.0
    assert all(m["train/loss_scale/scale_used"] == 2.0**40 for m in logged)
    assert not any(k.endswith("loss_scale/why") for m in logged for k in m)  # taken out
    assert np.isfinite(logged[-1]["train/loss"])  # the loss, in float32, is finite
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, params(state))
    inner = state.opt_state.inner_state  # Adam's count: no update was applied
    counts = [c for c in jax.tree_util.tree_leaves(inner) if np.issubdtype(c.dtype, np.integer)]
    assert counts and all(int(c) == 0 for c in counts)
    assert int(state.step) == 3  # EasyDeL's own counter counts skipped steps
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("lossscale_jax")]
    first, stuck = ours  # each said once
    assert "the SFTTrainer skipped an optimizer step: its gradients, scaled by 1.0995116e+12," in (
        first
    )
    assert "overflowed (inf or nan): the gradient of " in first  # a leaf, by its path
    assert "stayed at 1.0995116e+12" in first and "does not lower it" in first
    assert "its last 3 optimizer steps were all skipped" in stuck


def test_one_micro_batch_with_an_inf_skips_its_whole_window(tmp_path, caplog):
    # Token VOCAB (the data never holds it) gets an embedding of 1e6, inf in float16
    # compute; one row of the second window holds it (no shuffle; EasyDeL's window: 2
    # micro-batches of total_batch_size rows, 8 rows). That window's loss is nan (EasyDeL's
    # break_on_nan off, or EasyDeL itself stops the run) and its update is skipped whole: the
    # parameters after it bit for bit as after the first window, Adam's count 1.
    rows = EX.dataset().to_list()
    rows[2 * EX.BATCH + 1]["input_ids"][3] = EX.VOCAB
    model = EX.tiny_llama()
    embed = model.model.embed_tokens.embedding
    embed.value = embed.value.at[EX.VOCAB].set(1e6)
    t = EX.sft_trainer(
        model,
        2,
        str(tmp_path),
        type(EX.dataset()).from_list(rows),
        gradient_accumulation_steps=2,
        shuffle_train_dataset=False,
        loss_config={"break_on_nan": False},
    )
    lsj_easydel.enable(t)
    seen = []
    hook = t.on_step_end

    def on_step_end(state, metrics, step):
        seen.append(params(state))
        return hook(state=state, metrics=metrics, step=step)

    t.on_step_end = on_step_end
    with caplog.at_level(logging.WARNING, "lossscale_jax.integrations.easydel"):
        logged, state = EX.train(t)
    assert [m["train/loss_scale/skipped"] for m in logged] == [0.0, 1.0]
    assert np.isfinite(logged[0]["train/loss"]) and not np.isfinite(logged[1]["train/loss"])
    jax.tree_util.tree_map(np.testing.assert_array_equal, seen[0], seen[1])
    inner = state.opt_state.inner_state
    counts = [c for c in jax.tree_util.tree_leaves(inner) if np.issubdtype(c.dtype, np.integer)]
    assert counts and all(int(c) == 1 for c in counts)
    # The dynamic scale backed off (2^15 to 2^14), which the line says cannot help a nan loss.
    assert [m["train/loss_scale/loss_scale"] for m in logged] == [2.0**15, 2.0**14]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("lossscale_jax")]
    assert len(ours) == 1 and "its loss itself was not finite" in ours[0]
    assert "backed off from 32768 to 16384" in ours[0] and "cannot help" in ours[0]


def test_accumulation_tracks_float32(tmp_path):
    # EasyDeL accumulates in its step (a lax.scan over micro-batches): each scaled, summed,
    # one update; against stock float32 with the same window.
    f32, _ = EX.train(trainer(tmp_path / "a", steps=2, gradient_accumulation_steps=2))
    t = trainer(tmp_path / "b", steps=2, gradient_accumulation_steps=2)
    f16, _ = EX.train(lsj_easydel.enable(t))
    for a, b in zip(f32, f16, strict=True):
        assert abs(b["train/loss"] - a["train/loss"]) < 1e-3 * a["train/loss"]
        assert b["train/loss_scale/skipped"] == 0.0


def test_tiny_gradients_are_kept_by_the_scale_where_unscaled_float16_loses_them(tmp_path):
    # A loss divided by 2^20 (a constant normaliser): its gradients are ~1e-9, under
    # float16's smallest subnormal (6e-8). Stock float32 is the reference.
    config = {"steps": 1, "loss_config": {"loss_normalizing_factor": 2.0**20}}
    f32, _ = EX.train(trainer(tmp_path / "a", **config))
    runs = {}
    for name, policy in (("unscaled", lsj.NoScale()), ("scaled", lsj.DynamicScale())):
        t = lsj_easydel.enable(trainer(tmp_path / name, **config), policy)
        runs[name] = EX.train(t)[0][0]
    leaves = [k for k in f32[0] if k.startswith("train/grad_norm/")]
    errors = {
        name: max(abs(run[k] - f32[0][k]) / f32[0][k] for k in leaves) for name, run in runs.items()
    }
    assert errors["scaled"] < 0.02
    assert errors["unscaled"] > 0.5


def test_float16_parameters_get_float32_masters(tmp_path):
    # A model built with float16 parameters: the optimizer keeps float32 masters
    # (lsj.master_weights inside the loss scaling), and each float16 parameter is its
    # master rounded, bit for bit.
    config = EX.tiny_llama().config
    model = EX.ed.LlamaForCausalLM(
        config=config, dtype=jnp.float16, param_dtype=jnp.float16, rngs=nnx.Rngs(0)
    )
    t = lsj_easydel.enable(EX.sft_trainer(model, 2, str(tmp_path)))
    logged, state = EX.train(t)
    assert [m["train/loss_scale/skipped"] for m in logged] == [0.0, 0.0]
    assert all(np.isfinite(m["train/train/max_grad_norm"]) for m in logged)
    params16 = jax.tree_util.tree_leaves(state.graphstate)
    masters = jax.tree_util.tree_leaves(state.opt_state.inner_state.master)
    assert {p.dtype for p in params16} == {np.dtype(np.float16)}
    assert {m.dtype for m in masters} == {np.dtype(np.float32)}
    for p, m in zip(params16, masters, strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m).astype(np.float16))


def dpo_trainer(tmp_path, dtype=jnp.float32, steps=3):
    """EasyDeL's DPOTrainer on the example's tiny Llama (its reference model a copy of the
    policy, as built) over random 4-word prompts and 4-word chosen and rejected replies."""
    rng = np.random.default_rng(0)

    def words(n):
        return " ".join(f"t{int(t)}" for t in rng.integers(0, EX.VOCAB, n))

    rows = [
        {"prompt": words(4), "chosen": " " + words(4), "rejected": " " + words(4)}
        for _ in range(32)
    ]
    arguments = EX.ed.DPOConfig(
        max_length=16,
        max_prompt_length=8,
        max_completion_length=8,
        total_batch_size=4,
        **EX.run_arguments(steps, str(tmp_path)),
    )
    return EX.ed.DPOTrainer(
        arguments=arguments,
        model=EX.tiny_llama(dtype),
        reference_model=EX.tiny_llama(dtype),
        processing_class=EX.tokenizer(),
        train_dataset=type(EX.dataset()).from_list(rows),
    )


def one_device(trainer, where):
    """Skips a test where this run has more than one device: stock EasyDeL 0.3.0's
    ``trainer`` fails on a multi-device CPU mesh (``where``), without enable() too."""
    return pytest.mark.skipif(
        jax.device_count() > 1,
        reason=f"stock EasyDeL 0.3.0's {trainer} fails on a multi-device CPU mesh, in float32 "
        f"without enable() too ({where}: 'Received incompatible devices for jitted "
        "computation'); make test-easydel runs this test on one device",
    )


@one_device("DPO", "its batch on one device, its state on all")
def test_dpo_tracks_float32(tmp_path):
    # DPO's step takes its gradients through the same seam as SFT's. Its reference model
    # stays as built (float32): at step 1 the policy equals it, the loss log 2 in float32,
    # float16 compute's log-probs off by its rounding.
    f32, _ = EX.train(dpo_trainer(tmp_path / "a"))
    f16, _ = EX.train(lsj_easydel.enable(dpo_trainer(tmp_path / "b")))
    assert len(f32) == len(f16) == 3
    assert f32[0]["train/loss"] == pytest.approx(np.log(2.0), rel=1e-6)
    for a, b in zip(f32, f16, strict=True):
        assert abs(b["train/loss"] - a["train/loss"]) < 1e-4 * a["train/loss"]  # ~2e-5
        norm32, norm16 = a["train/train/max_grad_norm"], b["train/train/max_grad_norm"]
        assert abs(norm16 - norm32) < 0.02 * norm32  # unscaled
        assert b["train/loss_scale/skipped"] == 0.0
        assert b["train/loss_scale/scale_used"] == 2.0**15


def rl_trainer(tmp_path, kind="GRPO", steps=2):
    """EasyDeL's ``GRPOTrainer`` (or ``PPOTrainer``: ``kind``) on the example's tiny Llama:
    4-word prompts, 8-word completions (2 per prompt), the reward the count of ``t7``; on a
    CPU without eSurge's engine (its generation, as EasyDeL's CPU path needs), with a
    generation config set on the model."""
    from transformers import GenerationConfig

    model = EX.tiny_llama(jnp.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=EX.VOCAB, eos_token_id=EX.VOCAB + 1, max_new_tokens=8, do_sample=True
    )
    prompts = [" ".join(f"t{(i + j) % EX.VOCAB}" for j in range(4)) for i in range(16)]

    def reward(prompts, completions, **kwargs):
        return [float(str(c).count("t7")) for c in completions]

    config = {"GRPO": EX.ed.GRPOConfig, "PPO": EX.ed.PPOConfig}[kind]
    arguments = config(
        max_prompt_length=8,
        max_completion_length=8,
        total_batch_size=2,
        num_return_sequences=2,
        use_esurge_generation=False,
        skip_apply_chat_template=True,
        **EX.run_arguments(steps, str(tmp_path)),
    )
    data = EX.Dataset.from_list([{"prompt": p} for p in prompts])
    return getattr(EX.ed, f"{kind}Trainer")(
        arguments=arguments,
        model=model,
        reward_funcs=reward,
        train_dataset=data,
        processing_class=EX.tokenizer(),
    )


def test_float16_logits_truncate_jaxs_categorical_draw():
    # Why enable() gives EasyDeL's compiled generation float32 logits (_sampling): JAX draws
    # the Gumbel noise in the logits' dtype. 63 tokens `gap` nats below the first: the
    # softmax gives them 63 e^-gap / (1 + 63 e^-gap) of the draws. From float16 logits
    # none 10 nats below is ever drawn (the noise's spread is at most 6.93 + 2.27 = 9.2
    # nats) and too few 5 below (measured 27.8% for 29.8%); from bfloat16's (7 bits) far
    # too few 7 below (measured 0.8% for 5.4%). Float32 within 5 standard errors.
    keys = jax.random.split(jax.random.PRNGKey(0), 200_000)
    draw = jax.vmap(jax.random.categorical, in_axes=(0, None))

    def share(gap, dtype):
        logits = jnp.zeros(64).at[1:].set(-gap).astype(dtype)
        return float(jnp.mean(draw(keys, logits) != 0))

    for gap in (10.0, 7.0, 5.0):
        want = 63 * np.exp(-gap) / (1 + 63 * np.exp(-gap))
        assert abs(share(gap, jnp.float32) - want) < 5 * np.sqrt(want * (1 - want) / len(keys))
    assert share(10.0, jnp.float16) == 0.0
    assert share(5.0, jnp.float16) < 0.29  # 0.298 wanted, 0.001 its standard error
    assert share(7.0, jnp.bfloat16) < 0.02  # 0.054 wanted


def float32_and_float16(tmp_path, kind, steps=4):
    """``kind``'s run (``rl_trainer``) in stock float32 and with ``enable()``: what each
    logged. Checks that ``enable()`` rebuilt the sampling function and switched the model
    to float16, that the two runs sampled the same completions (the draw from float32
    logits, as eSurge draws, and EasyDeL's sampling key fixed: float16's rounding of the
    logits moves no argmax of logits plus Gumbel noise here), and that the float16 run
    neither skipped nor moved its scale."""
    logged, seen = {}, {}
    for name in ("float32", "float16"):
        t = rl_trainer(tmp_path / name, kind, steps=steps)
        count, seen[name] = t.reward_funcs[0], []

        def reward(prompts, completions, _seen=seen[name], _count=count, **kwargs):
            _seen.append([str(c) for c in completions])
            return _count(prompts, completions, **kwargs)

        t.reward_funcs[0] = reward
        if name == "float16":
            sampler = t.generate_function
            lsj_easydel.enable(t)
            assert t.generate_function is not sampler
            own = _dtype.own_dtype_modules(t.model_state.model)
            assert {np.dtype(m.dtype) for m in own if not _dtype.is_norm(m)} == {
                np.dtype(np.float16)
            }
        logged[name], state = EX.train(t)
    assert len(seen["float32"]) == len(logged["float32"]) == len(logged["float16"]) == steps
    assert seen["float16"] == seen["float32"]
    for m in logged["float16"]:
        assert m["train/loss_scale/scale_used"] == m["train/loss_scale/loss_scale"] == 2.0**15
        assert m["train/loss_scale/skipped"] == 0.0
    assert int(lsj.get_loss_scale_state(state.opt_state).total_steps) == steps
    return logged["float32"], logged["float16"]


@one_device("GRPO", "its reference model's log-probs")
def test_grpo_samples_as_float32_does_and_tracks_it(tmp_path):
    # GRPO builds its step (grpo_step) and its sampling function in configure_functions:
    # both rebuilt, from the float16 graph. The same completions: the same rewards, and
    # the float32 reference model's log-probs of them bit for bit. The KL to the reference
    # and the loss (mostly beta times that KL) within 5%: float16's log-probs are off by
    # ~1e-3 (its rounding of logits of size ~1) on policy/reference gaps of ~0.1
    # (measured: 2.2%); the unscaled gradient norm within 2% (measured: 0.4%).
    f32, f16 = float32_and_float16(tmp_path, "GRPO")
    for a, b in zip(f32, f16, strict=True):
        assert b["train/reward"] == a["train/reward"]
        assert b["train/ref_per_token_logps"] == a["train/ref_per_token_logps"]
        assert abs(b["train/mean_kl"] - a["train/mean_kl"]) <= 0.05 * a["train/mean_kl"]
        assert abs(b["train/loss"] - a["train/loss"]) <= 0.05 * abs(a["train/loss"])
        norm32, norm16 = a["train/train/max_grad_norm"], b["train/train/max_grad_norm"]
        assert abs(norm16 - norm32) < 0.02 * norm32
    assert f32[-1]["train/mean_kl"] > 0.0  # the policy moved from its reference


@one_device("PPO", "its reference model's log-probs")
def test_ppo_samples_as_float32_does_and_tracks_it(tmp_path):
    # PPO wraps the policy with a value head (its loss the clipped surrogate plus the value
    # head's squared error, one step through the same seam): the head computes in float16
    # too. The same completions and rewards; the loss and the value head's within 1e-3
    # relative (measured: 5e-5); the mean KL estimate (signed, near 0) within 5e-4: the
    # mean over ~26 tokens of log-prob errors of ~1e-3 each (measured: 6e-5); the
    # unscaled gradient norm within 2% (measured: 0.02%).
    f32, f16 = float32_and_float16(tmp_path, "PPO")
    for a, b in zip(f32, f16, strict=True):
        assert b["train/reward"] == a["train/reward"]
        for key in ("train/loss", "train/value_loss"):
            assert abs(b[key] - a[key]) <= 1e-3 * abs(a[key])
        assert abs(b["train/mean_kl"] - a["train/mean_kl"]) <= 5e-4
        norm32, norm16 = a["train/train/max_grad_norm"], b["train/train/max_grad_norm"]
        assert abs(norm16 - norm32) < 0.02 * norm32


def test_bfloat16_gets_no_scale_and_a_scale_given_warns(tmp_path):
    t = trainer(tmp_path)
    lsj_easydel.enable(t, compute_dtype=jnp.bfloat16)
    assert float(lsj.get_loss_scale_state(t.model_state.opt_state).scale) == 1.0
    with pytest.warns(IntegrationWarning, match="needs none"):
        lsj_easydel.enable(trainer(tmp_path / "b"), lsj.DynamicScale(), compute_dtype="bfloat16")


def _unchanged(t, before_state, before_tx):
    assert t.model_state is before_state
    assert t.tx is before_tx
    assert t.arguments.loss_config.compute_dtype is None


def test_enable_twice_is_refused(tmp_path):
    t = trainer(tmp_path)
    lsj_easydel.enable(t)
    state, tx = t.model_state, t.tx
    with pytest.raises(IntegrationError, match="called on this SFTTrainer before"):
        lsj_easydel.enable(t)
    assert t.model_state is state and t.tx is tx


def test_a_trainer_whose_step_is_not_easydels_is_refused_with_nothing_changed(tmp_path):
    t = trainer(tmp_path)
    state, tx = t.model_state, t.tx

    class OwnStep(type(t)):
        def configure_functions(self):  # builds its step some other way
            raise NotImplementedError

    t.__class__ = OwnStep
    with pytest.raises(IntegrationError, match="builds no step that takes its gradients"):
        lsj_easydel.enable(t)
    _unchanged(t, state, tx)


def test_an_accumulating_optimizer_is_refused_with_nothing_changed(tmp_path):
    t = trainer(tmp_path)
    t.model_state = t.model_state.replace(tx=optax.MultiSteps(optax.adam(1e-3), 2))
    state, tx = t.model_state, t.tx
    with pytest.raises(IntegrationError, match="accumulates"):
        lsj_easydel.enable(t)
    _unchanged(t, state, tx)


def test_not_a_trainer_is_refused():
    with pytest.raises(IntegrationError, match="takes a built EasyDeL trainer"):
        lsj_easydel.enable(object())


def test_the_seams_are_checked_by_name_not_by_version(monkeypatch):
    assert lsj_easydel.check_release() == "0.3.0"
    with pytest.warns(IntegrationWarning, match="not 9.9.9"):
        assert lsj_easydel.check_release("9.9.9") == "9.9.9"
    names = {**_seams.NAMES, "easydel.trainers.training_utils": ("minibatch_call", "gone")}
    monkeypatch.setattr(_seams, "NAMES", names)
    with pytest.raises(IntegrationError, match=r"training_utils\.gone"):
        lsj_easydel.check_release()
    monkeypatch.undo()
    from easydel.infra.mixins.generation import EasyGenerationMixin

    monkeypatch.setattr(EasyGenerationMixin, "generate", lambda self, input_ids, **kwargs: None)
    with pytest.raises(IntegrationError, match=r"generate\(logits_processor=\.\.\.\)"):
        lsj_easydel.check_release()
