"""``lossscale_jax.integrations.tunix``: Tunix's trainers in float16 with loss scaling.

Run where google-tunix is installed (``make test-tunix``: a venv of its own); elsewhere the
module is skipped, saying so, but for the error an import without Tunix raises. The model,
the tokenizer and the data are the Tunix example's (``examples/train_tunix_grpo.py``, its
"quick" size). The references: the same trainer in float32 without the integration
(stock Tunix), a skipped step's parameters bit for bit against those before it, the window
of Tunix's own accumulation, a run resumed in a fresh process against the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT, load_script  # tests/ is on sys.path under pytest

import lossscale_jax as lsj
from lossscale_jax.errors import IntegrationError

HAVE_TUNIX = importlib.util.find_spec("tunix") is not None


def test_without_tunix_the_import_says_how_to_install_it():
    if HAVE_TUNIX:
        pytest.skip("google-tunix is installed here: make test-tunix's venv runs the rest")
    with pytest.raises(IntegrationError, match=r"pip install 'lossscale_jax\[tunix\]'"):
        import lossscale_jax.integrations.tunix  # noqa: F401


if not HAVE_TUNIX:
    pytest.skip(
        "google-tunix is not installed (an optional integration: make test-tunix installs it "
        "in a venv of its own and runs this module)",
        allow_module_level=True,
    )

# Tunix 0.1.7 on this JAX and Flax: its modules warn of the APIs they use that JAX and Flax
# deprecated (jax.experimental.shard_map, Variable.value, ...). Those warnings are Tunix's,
# not the library's.
TUNIX_WARNINGS = (
    "ignore::DeprecationWarning:tunix",
    "ignore::DeprecationWarning:qwix",  # the LoRA library Tunix uses, the same
    "ignore:scatter inputs have incompatible types:FutureWarning",  # Tunix's PPO data prep
    "ignore:optax.global_norm is deprecated:DeprecationWarning",  # Tunix's own step calls it
    # Tunix's cluster enters its meshes with `with mesh:` (it reads them from there)
    "ignore:.with mesh.. context manager has been deprecated:DeprecationWarning",
    "ignore:'sharding' is deprecated, use 'out_sharding':DeprecationWarning",
    "ignore:'.value' (access|setter) is now deprecated:DeprecationWarning",
)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Tunix's imports
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3_lib
    from tunix.sft import hooks, peft_trainer

    from lossscale_jax.integrations import tunix as lsj_tunix

    EX = load_script("examples/train_tunix_grpo.py")

pytestmark = [pytest.mark.slow, *(pytest.mark.filterwarnings(f) for f in TUNIX_WARNINGS)]
SIZE = EX.SIZES["quick"]
STOCK_K_MASK = -2.3819763e38
BAD = SIZE.vocab - 1  # a batch starting with this token gets an inf loss


def loss_with_fault(model, input_tokens, input_mask, positions, attention_mask):
    """Tunix's default SFT loss, times inf on a batch whose first token is ``BAD`` (a factor,
    not a where: the backward of a where would make every step's gradient nan)."""
    loss = peft_trainer._default_loss_fn(model, input_tokens, input_mask, positions, attention_mask)
    factor = jnp.where(input_tokens[0, -1] == BAD, jnp.inf, 1.0)
    if hasattr(loss, "primary_loss"):  # Tunix's main branch: a LossOutput, a sum over tokens
        total = loss.primary_loss.replace(unreduced_sum=loss.primary_loss.unreduced_sum * factor)
        return loss.replace(primary_loss=total)
    return loss * factor


def batches(n, bad=()):
    out = EX.sft_batches(SIZE, n, seed=3)
    for i in bad:
        tokens = out[i].input_tokens.copy()
        tokens[0, -1] = BAD
        out[i] = peft_trainer.TrainingInput(input_tokens=tokens, input_mask=tokens != EX.PAD)
    return out


def sft(
    dtype,
    *,
    enable=True,
    steps=4,
    bad=(),
    accumulate=None,
    lora=None,
    root=None,
    policy=None,
    optimizer=None,
    mesh=None,
    loss=None,
    compute_dtype=jnp.float16,
):
    """A Tunix SFT run of the example's Qwen3 on left-padded batches (``lora``: qwix's LoRA
    on the projections that module path matches; ``mesh``: the model resharded onto it by
    Tunix's ``reshard_model_to_mesh``, the run inside it); the trainer."""
    model = EX.qwen3(SIZE, dtype if not enable else jnp.float32)
    if lora:
        model = with_lora(model, lora)
    if mesh is not None:
        from tunix.rl import reshard

        model = reshard.reshard_model_to_mesh(model, mesh)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9,
        max_steps=steps,
        gradient_accumulation_steps=accumulate,
        checkpoint_root_directory=root,
    )
    initial = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    with EX.entered(mesh or EX.mesh()):
        trainer = peft_trainer.PeftTrainer(model, optimizer or optax.adamw(1e-2), config)
        trainer.initial_params = initial  # the test's own note: the parameters before training
        trainer.with_gen_model_input_fn(EX.model_inputs)
        trainer.with_loss_fn(loss or loss_with_fault)
        trainer.moved = []  # the test's own note: whether each step changed the parameters
        trainer.with_training_hooks(ParamsPerStep(trainer.moved))
        if enable:
            policy = policy or lsj.DynamicScale(init_scale=2.0**10)
            lsj_tunix.enable(trainer, policy, compute_dtype=compute_dtype)
        trainer.train(batches(steps * (accumulate or 1), bad))
    return trainer


class ParamsPerStep(hooks.TrainingHooks):
    """Notes into ``moved``, for each step the trainer takes (each micro-batch), whether the
    model's parameters changed in it (a digest of their bytes before and after)."""

    def __init__(self, moved):
        self.moved, self.before = moved, None

    def _digest(self, trainer):
        state = nnx.state(trainer.model, nnx.Param)
        return hash(b"".join(np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(state)))

    def on_train_step_start(self, train_ctx):
        now = self._digest(train_ctx)
        if self.before is not None:
            self.moved.append(now != self.before)
        self.before = now

    def on_train_end(self, train_ctx):
        self.on_train_step_start(train_ctx)

    def on_train_start(self, train_ctx):
        pass

    def on_train_step_end(self, train_ctx, train_step, train_loss):
        pass

    def on_eval_step_start(self, train_ctx):
        pass

    def on_eval_step_end(self, train_ctx, eval_loss):
        pass


def with_lora(model, module_path):
    """``model`` with qwix's LoRA (rank 4, as Tunix's examples apply it) on the projections
    ``module_path`` matches."""
    import qwix

    provider = qwix.LoraProvider(module_path=module_path, rank=4, alpha=8.0)
    return qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1), **model.get_model_input())


def history(trainer, name, prefix=""):
    return [float(v) for v in trainer.metrics_logger.get_metric_history(prefix, name, "train")]


def test_float16_with_padded_batches_trains_like_float32(monkeypatch):
    # Stock Tunix in float16: the mask constant is -inf there, a fully padded row is nan.
    monkeypatch.setattr(qwen3_lib, "K_MASK", STOCK_K_MASK)
    jax.clear_caches()
    stock16 = history(sft(jnp.float16, enable=False), "loss")
    assert np.all(np.isnan(stock16))
    stock32 = sft(jnp.float32, enable=False)
    want, want_norm = history(stock32, "loss"), history(stock32, "grad_norm")
    trainer = sft(jnp.float16)
    got = history(trainer, "loss")
    assert qwen3_lib.K_MASK == float(jnp.finfo(jnp.float16).min)  # enable() patched it
    assert history(trainer, "loss_scale/skipped") == [0.0] * 4 and np.all(np.isfinite(got))
    # Step 1, the same weights: float16 rounds each op's result to 2**-11 relative (the
    # matmuls sum in float32); the loss of this 2-layer model agrees to well within 0.5%,
    # and the norm Tunix logs is the unscaled one, the float32 run's to a few percent.
    np.testing.assert_allclose(got[0], want[0], rtol=5e-3)
    np.testing.assert_allclose(history(trainer, "grad_norm")[0], want_norm[0], rtol=0.05)
    # Adam at lr 1e-2 moves every weight by ~lr whatever its gradient's size, so the two runs
    # part from step 2 on; float16 trains as float32 does: the same fall, within 5%.
    assert got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=0.05)


def test_an_overflowing_step_is_skipped_and_the_parameters_kept():
    before = sft(jnp.float16, steps=2)
    params = jax.tree_util.tree_map(np.asarray, nnx.state(before.model, nnx.Param))
    trainer = sft(jnp.float16, steps=3, bad=(2,))
    after = jax.tree_util.tree_map(np.asarray, nnx.state(trainer.model, nnx.Param))
    jax.tree_util.tree_map(np.testing.assert_array_equal, after, params)  # bit for bit
    assert history(trainer, "loss_scale/skipped") == [0.0, 0.0, 1.0]
    # The scale each step's loss was multiplied by, and the scale after its adjustment.
    assert history(trainer, "loss_scale/scale_used") == [2.0**10] * 3
    assert history(trainer, "loss_scale/loss_scale") == [2.0**10, 2.0**10, 2.0**9]
    assert int(trainer.optimizer.step[...]) == 2 and trainer.train_steps == 3
    assert not np.isfinite(history(trainer, "grad_norm")[-1])  # logged as it was


def test_tunix_accumulation_skips_the_whole_window():
    # gradient_accumulation_steps=2: Tunix wraps the optimizer in optax.MultiSteps, which
    # enable() unwraps into loss_scaling_multi_steps; an inf in the second window's first
    # micro-batch skips that window.
    trainer = sft(jnp.float16, steps=3, accumulate=2, bad=(2,))
    state = nnx.as_pure(trainer.optimizer.opt_state)
    assert isinstance(state, lsj.LossScalingMultiStepsState)
    skipped = history(trainer, "loss_scale/skipped")  # one value per window
    assert len(skipped) == 3 and skipped[1] == 1.0  # (another may overflow by itself)
    assert int(trainer.optimizer.step[...]) == 3 - sum(skipped) and trainer.train_steps == 3


def multi_steps(k=2, **kwargs):
    """The user's own accumulation: an ``optax.MultiSteps`` given to the trainer as its
    optimizer (Tunix's ``gradient_accumulation_steps`` unset)."""
    return optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=k, **kwargs)


def test_a_users_own_multisteps_keeps_its_window():
    # Stock Tunix (float32, no enable) updates the parameters on every second step.
    stock = sft(jnp.float32, enable=False, steps=4, optimizer=multi_steps())
    assert stock.moved == [False, True, False, True]
    # enable() keeps that window: in float32 with no scale, the same parameters as stock.
    same = sft(
        jnp.float32, steps=4, optimizer=multi_steps(), policy=lsj.NoScale(), compute_dtype=None
    )
    assert same.moved == stock.moved
    assert isinstance(nnx.as_pure(same.optimizer.opt_state), lsj.LossScalingMultiStepsState)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),  # Adam: ~1e-2 a step
        nnx.to_pure_dict(nnx.state(same.model, nnx.Param)),
        nnx.to_pure_dict(nnx.state(stock.model, nnx.Param)),
    )
    # In float16, an inf in the second window's first micro-batch skips that window whole.
    trainer = sft(jnp.float16, steps=4, optimizer=multi_steps(), bad=(2,))
    assert trainer.moved == [False, True, False, False]
    # Each step logs the last completed window's decision: the second's at step 4.
    assert history(trainer, "loss_scale/skipped") == [0.0, 0.0, 0.0, 1.0]
    assert int(trainer.optimizer.step[...]) == 1 and trainer.train_steps == 4


def test_a_users_multisteps_restored_mid_window_carries_its_micro_batches(tmp_path):
    stock = sft(jnp.float32, enable=False, steps=3, optimizer=multi_steps(), root=str(tmp_path))
    plain = nnx.as_pure(stock.optimizer.opt_state)
    assert int(plain.mini_step) == 1  # a window in progress: one micro-batch seen
    # Built again on the checkpoint (Tunix restores step 3), then enable(): nothing to train.
    trainer = sft(jnp.float16, steps=3, optimizer=multi_steps(), root=str(tmp_path))
    state = nnx.as_pure(trainer.optimizer.opt_state)
    assert trainer.train_steps == 3 and int(state.mini_step) == 1
    # MultiSteps keeps the window's mean, the loss-scaled window its sum: one micro-batch,
    # the same numbers.
    jax.tree_util.tree_map(np.testing.assert_array_equal, state.acc_grads, plain.acc_grads)
    jax.tree_util.tree_map(np.testing.assert_array_equal, state.inner_state, plain.inner_opt_state)


def test_accumulating_twice_or_what_a_window_cannot_keep_is_refused_naming_the_fix():
    with pytest.raises(IntegrationError, match=r"gradient_accumulation_steps=6 \(Tunix"):
        sft(jnp.float16, steps=1, accumulate=2, optimizer=multi_steps(3))
    with pytest.raises(IntegrationError, match=r"every_k_schedule=k"):
        sft(jnp.float16, steps=1, optimizer=multi_steps(lambda step: 2))
    with pytest.raises(IntegrationError, match=r"optax.scale\(2\)"):
        sft(jnp.float16, steps=1, optimizer=multi_steps(use_grad_mean=False))
    with pytest.raises(IntegrationError, match="Drop should_skip_update_fn"):
        sft(
            jnp.float16, steps=1, optimizer=multi_steps(should_skip_update_fn=optax.skip_not_finite)
        )
    # Tunix's own accumulation of 1 around the user's window: the user's window is kept.
    kept = sft(jnp.float16, steps=2, accumulate=1, optimizer=multi_steps())
    assert kept.moved == [False, True]


def test_lora_trains_the_lora_params_only():
    trainer = sft(jnp.float16, steps=2, lora=".*q_proj|.*v_proj")
    assert trainer.optimizer.wrt is nnx.LoRAParam
    now = nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))
    flat_now = dict(jax.tree_util.tree_flatten_with_path(now)[0])
    flat_before = dict(jax.tree_util.tree_flatten_with_path(trainer.initial_params)[0])
    lora = {
        p
        for p, _ in jax.tree_util.tree_flatten_with_path(
            nnx.to_pure_dict(nnx.state(trainer.model, nnx.LoRAParam))
        )[0]
    }
    assert lora and lora < set(flat_now)
    for path, before in flat_before.items():
        moved = not np.array_equal(np.asarray(flat_now[path]), before)
        assert moved == (path in lora), jax.tree_util.keystr(path)
    assert history(trainer, "loss_scale/skipped") == [0.0, 0.0]


def test_grpo_logs_the_scale_and_the_rollout_mismatch():
    weights = nnx.state(EX.qwen3(SIZE, jnp.float32), nnx.Param)
    run = EX.grpo(SIZE, weights, "float16", seed=0)
    assert len(run["mismatch_kl"]) == SIZE.steps and len(run["loss_scale"]) == SIZE.steps
    assert all(np.isfinite(run["mismatch_kl"])) and all(k >= 0 for k in run["mismatch_kl"])
    # float16 rounds each logit to 2**-11: the log-probs of the two paths differ by far less
    # than 0.1 on average, and by more than float32's rounding (1e-6).
    assert 1e-6 < np.mean(run["mismatch_abs"]) < 0.1
    assert run["loss_scale"][0] <= 2.0**16


def test_ppo_enables_the_actor_and_the_critic():
    from tunix.rl import rl_cluster as rl
    from tunix.rl import utils as rl_utils
    from tunix.rl.ppo import ppo_learner
    from tunix.rl.rollout import base_rollout

    grid = EX.mesh()
    roles = (rl.Role.ACTOR, rl.Role.CRITIC, rl.Role.ROLLOUT, rl.Role.REFERENCE)
    cluster = rl.RLCluster(
        actor=EX.qwen3(SIZE),
        critic=rl_utils.create_critic_model(EX.qwen3(SIZE)),  # a value head on a copy
        reference=None,
        tokenizer=EX.WordTokenizer(),
        cluster_config=rl.ClusterConfig(
            role_to_mesh={role: grid for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl.RLTrainingConfig(
                actor_optimizer=optax.adamw(1e-3),
                critic_optimizer=optax.adamw(1e-3),
                eval_every_n_steps=100,
                max_steps=2,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=6,
                max_prompt_length=6,
                kv_cache_size=16,
                temperature=1.0,
                top_p=1.0,
                top_k=None,
                eos_tokens=[EX.EOS, EX.PAD],
                seed=0,
            ),
        ),
    )
    learner = ppo_learner.PPOLearner(
        rl_cluster=cluster, ppo_config=ppo_learner.PPOConfig(beta=0.0), reward_fns=EX.reward
    )
    lsj_tunix.enable(learner, lsj.DynamicScale(init_scale=2.0**10))
    for trainer in (cluster.actor_trainer, cluster.critic_trainer):
        assert isinstance(trainer.optimizer, lsj.LossScaleOptimizer)
    with EX.entered(grid):
        learner.train([{"prompts": np.array(["t3 t4", "t9 t10 t11"])}] * 2)
    log = cluster.actor_trainer.metrics_logger  # the cluster's, shared by both
    for role in ("actor", "critic"):  # each its own scale, logged under its own prefix
        assert len(log.get_metric_history(role, "loss_scale/loss_scale", "train")) == 2
        assert np.all(np.isfinite(log.get_metric_history(role, "loss", "train")))
    assert len(log.get_metric_history("actor", "mismatch/kl", "train")) == 2


RESUME = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {tests!r})
    import test_integration_tunix as t
    policy = t.lsj.DynamicScale(init_scale=2.0**10, growth_interval=2)
    trainer = t.sft(jnp.float16, steps=8, policy=policy, bad=(3,), root={root!r})
    params = jax.tree_util.tree_map(lambda a: np.asarray(a).tolist(),
                                    t.nnx.to_pure_dict(t.nnx.state(trainer.model, t.nnx.Param)))
    print(json.dumps({{"loss": t.history(trainer, "loss"), "step": int(trainer.optimizer.step[...]),
                      "scale": t.history(trainer, "loss_scale/loss_scale"), "params": params}}))
    """
)


def test_a_checkpoint_resumes_in_a_fresh_process_bit_for_bit(tmp_path):
    resumes_bit_for_bit(tmp_path)


def resumes_bit_for_bit(tmp_path):
    """4 steps with checkpoints, then a fresh process that builds the run again and calls
    enable(): steps 5-8 as one run of 8 has them, bit for bit (the installed Tunix's
    checkpointer, whichever it is)."""
    policy = lsj.DynamicScale(init_scale=2.0**10, growth_interval=2)
    whole = sft(jnp.float16, steps=8, policy=policy, bad=(3,))
    first = sft(jnp.float16, steps=4, policy=policy, bad=(3,), root=str(tmp_path))
    assert history(first, "loss") == history(whole, "loss")[:4]
    code = RESUME.format(tests=str(ROOT / "tests"), root=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    resumed = json.loads(out.strip().splitlines()[-1])
    assert resumed["loss"] == history(whole, "loss")[4:]  # steps 5-8, bit for bit
    assert resumed["scale"] == history(whole, "loss_scale/loss_scale")[4:]
    assert resumed["step"] == int(whole.optimizer.step[...]) <= 7  # the fault skipped
    want = jax.tree_util.tree_map(
        lambda a: np.asarray(a).tolist(), nnx.to_pure_dict(nnx.state(whole.model, nnx.Param))
    )
    assert resumed["params"] == json.loads(json.dumps(want))  # JSON's keys are strings


def test_a_stock_checkpoint_carries_its_optimizer_over(tmp_path):
    stock_checkpoint_carries_over(tmp_path)


def stock_checkpoint_carries_over(tmp_path):
    """A stock float32 checkpoint's optimizer state becomes the loss-scaled one's inner."""
    stock = sft(jnp.float32, enable=False, steps=2, root=str(tmp_path))
    plain = nnx.as_pure(stock.optimizer.opt_state)
    trainer = sft(jnp.float16, steps=2, root=str(tmp_path))  # restores step 2, then enable()
    assert trainer.train_steps == 2 and int(trainer.optimizer.step[...]) == 2
    inner = nnx.as_pure(trainer.optimizer.opt_state).inner_state
    jax.tree_util.tree_map(np.testing.assert_array_equal, inner, plain)


def test_the_tested_release_has_every_seam():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no IntegrationWarning for the tested release
        assert lsj_tunix.check_release() == "0.1.7" == lsj_tunix.TESTED_VERSIONS[-1]


def test_what_enable_refuses():
    trainer = sft(jnp.float16, steps=1)
    with pytest.raises(IntegrationError, match="already loss-scaled"):
        lsj_tunix.enable(trainer)
    with pytest.raises(IntegrationError, match="takes a Tunix PeftTrainer"):
        lsj_tunix.enable(object())
    with pytest.raises(IntegrationError, match="needs the RL learner"):
        lsj_tunix.enable(sft(jnp.float16, enable=False, steps=1), rollout_mismatch=True)


def test_the_first_step_benchmark_runs_both_trainers_in_fresh_processes(tmp_path):
    # benchmarks/bench_tunix_first_step.py at its smoke size: a row per variant and round,
    # each with a first step and a later one, and the ratios of the two. Nothing is timed
    # against a bar here.
    out = tmp_path / "first_step.json"
    script = ROOT / "benchmarks" / "bench_tunix_first_step.py"
    subprocess.run(
        [sys.executable, str(script), "--width", "32", "--rounds", "1", "--json", str(out)],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    doc = json.loads(out.read_text())
    assert [r["variant"] for r in doc["rows"]] == ["stock", "enabled"]
    for row in doc["rows"]:
        assert row["first_step_s"] > row["later_step_s"] > 0  # the first one compiles
    assert set(doc["ratios"]) == {"first_step_s", "later_step_s"}
    assert all(r > 0 for r in doc["ratios"].values())
