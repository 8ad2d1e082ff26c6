"""``lossscale_jax.integrations.tunix`` on Tunix's main branch: a gradient accumulator of
Tunix's own (``_train_step(model, optimizer, grad_accumulator, inputs, is_update_step)``, the
update under ``nnx.cond``) and losses returned as a ``LossOutput`` (a sum over tokens and its
count).

Run wherever the installed Tunix has those seams (tested at Tunix's commit
``_tunix_seams.MAIN_COMMIT``, installed from its source with ``--no-deps`` into a venv of its
own with JAX 0.10.2; docs/rl.md says how); skipped elsewhere, saying so, so that
``make test-tunix`` runs it the day pip resolves a release with them. The references: stock
Tunix of that commit in float32 (its losses, gradient norms, parameters, the steps at which
it moves them), and a loss whose sum runs over 1000 times the tokens with the same mean.
"""

from __future__ import annotations

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale_jax as lsj
from lossscale_jax.errors import IntegrationError, IntegrationWarning

if importlib.util.find_spec("tunix") is None:
    pytest.skip("google-tunix is not installed", allow_module_level=True)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Tunix's imports
    from lossscale_jax.integrations.tunix import _seams as _tunix_seams

    if _tunix_seams.kind() != "accumulator":
        pytest.skip(
            f"the installed google-tunix ({_tunix_seams.version()}) has 0.1.7's step, not the "
            "gradient accumulator of Tunix's main branch (tests/test_integration_tunix.py "
            "covers it)",
            allow_module_level=True,
        )
    from flax import nnx
    from test_integration_tunix import (
        EX,
        SIZE,
        TUNIX_WARNINGS,
        history,
        loss_with_fault,
        multi_steps,
        resumes_bit_for_bit,
        sft,
        stock_checkpoint_carries_over,
    )
    from test_integration_tunix_rl import make_cluster, rl_history, train
    from tunix.rl import utils as rl_utils
    from tunix.rl.ppo import ppo_learner

    from lossscale_jax.integrations import tunix as lsj_tunix

pytestmark = [
    pytest.mark.slow,
    *(pytest.mark.filterwarnings(f) for f in TUNIX_WARNINGS),
    # Tunix's main branch reports 0.1.8, not a release: enable() says it was tested at the
    # commit, and warns.
    pytest.mark.filterwarnings("ignore:lossscale_jax.integrations.tunix was tested with"),
]


def params(trainer):
    return nnx.to_pure_dict(nnx.state(trainer.model, nnx.Param))


def test_this_tunix_is_taken_with_a_warning_naming_the_commit_tested():
    with pytest.warns(IntegrationWarning, match=_tunix_seams.MAIN_COMMIT):
        _tunix_seams.check()


def test_float16_sft_tracks_float32():
    stock = sft(jnp.float32, enable=False, steps=3)
    trainer = sft(jnp.float16, steps=3)
    want, got = history(stock, "loss"), history(trainer, "loss")
    assert history(trainer, "loss_scale/skipped") == [0.0] * 3
    assert history(trainer, "loss_scale/scale_used") == [2.0**10] * 3
    np.testing.assert_allclose(got[0], want[0], rtol=5e-3)  # the same weights: rounding
    np.testing.assert_allclose(history(trainer, "grad_norm"), history(stock, "grad_norm"), rtol=0.1)
    np.testing.assert_allclose(got, want, rtol=0.05)
    assert got[-1] < got[0]


def test_accumulation_updates_once_per_window_as_tunix_weights_it():
    stock = sft(jnp.float32, enable=False, steps=2, accumulate=2)
    assert stock.moved == [False, True, False, True]
    # float32 with no scale: Tunix's window (its token-weighted mean) reproduced.
    same = sft(jnp.float32, steps=2, accumulate=2, policy=lsj.NoScale(), compute_dtype=None)
    assert same.moved == stock.moved
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
        params(same),
        params(stock),
    )
    np.testing.assert_allclose(history(same, "loss"), history(stock, "loss"), rtol=1e-4)
    # float16: an inf in the second window's first micro-batch skips the window whole.
    trainer = sft(jnp.float16, steps=2, accumulate=2, bad=(2,))
    assert trainer.moved == [False, True, False, False]
    assert history(trainer, "loss_scale/skipped") == [0.0, 1.0]
    assert history(trainer, "loss_scale/loss_scale") == [2.0**10, 2.0**9]
    assert int(trainer.optimizer.step[...]) == 1 and trainer.train_steps == 2


def sum_over_more_tokens(model, input_tokens, input_mask, positions, attention_mask):
    """Tunix's SFT loss with its sum and its count both 1000 times larger: the same mean, the
    gradients of the sum 1000 times those of a real batch's (~3e6 here, past float16's
    65504), as over a long batch."""
    out = loss_with_fault(model, input_tokens, input_mask, positions, attention_mask)
    loss = out.primary_loss
    big = loss.replace(unreduced_sum=loss.unreduced_sum * 1000, denominator=loss.denominator * 1000)
    return out.replace(primary_loss=big)


def test_a_loss_summed_over_many_tokens_is_normalised_before_the_backward_pass():
    stock = sft(jnp.float32, enable=False, steps=1)
    trainer = sft(jnp.float16, steps=1, loss=sum_over_more_tokens)
    assert history(trainer, "loss_scale/skipped") == [0.0]
    np.testing.assert_allclose(history(trainer, "loss"), history(stock, "loss"), rtol=5e-3)
    np.testing.assert_allclose(history(trainer, "grad_norm"), history(stock, "grad_norm"), rtol=0.1)


def test_grpo_and_ppo_train_in_float16_with_their_losses_as_loss_outputs(monkeypatch):
    # GRPO (the example's: its rewards vary within a group, so its gradients are not zero):
    # its loss a LossOutput (a sum over the completion tokens), the mismatch logged.
    weights = nnx.state(EX.qwen3(SIZE, jnp.float32), nnx.Param)
    want = EX.grpo(SIZE, weights, "float32", seed=0)  # float32, NoScale(): the reference
    monkeypatch.setattr(EX, "policy_of", lambda dtype: lsj.DynamicScale(init_scale=2.0**10))
    got = EX.grpo(SIZE, weights, "float16", seed=0)
    assert got["skipped"] == [0.0] * SIZE.steps and got["loss_scale"] == [2.0**10] * SIZE.steps
    assert np.all(np.isfinite(got["grad_norm"])) and min(want["grad_norm"]) > 1.0
    # The same weights at step 1 (float16's rollout may sample other tokens later on).
    np.testing.assert_allclose(got["grad_norm"][0], want["grad_norm"][0], rtol=0.05)
    assert 1e-6 < np.mean(got["mismatch_abs"]) < 0.1
    # PPO: the actor and the critic, each its own scale, both losses LossOutputs.
    cluster = make_cluster(EX.qwen3(SIZE), critic=rl_utils.create_critic_model(EX.qwen3(SIZE)))
    learner = ppo_learner.PPOLearner(  # on this Tunix: algo_config (ppo_config on 0.1.7)
        rl_cluster=cluster, algo_config=ppo_learner.PPOConfig(beta=0.0), reward_fns=EX.reward
    )
    lsj_tunix.enable(
        learner, lsj.DynamicScale(init_scale=2.0**10), critic_policy=lsj.StaticScale(16.0)
    )
    train(learner)
    for role, scale in (("actor", 2.0**10), ("critic", 16.0)):
        assert rl_history(cluster, "loss_scale/skipped", role) == [0.0, 0.0]
        assert rl_history(cluster, "loss_scale/loss_scale", role) == [scale] * 2
        assert np.all(np.isfinite(rl_history(cluster, "loss", role)))


def test_lora_and_a_users_own_window():
    # LoRA (qwix's, on q and v as Tunix's examples put it): the LoRA parameters alone move.
    trainer = sft(jnp.float16, steps=2, lora=".*q_proj|.*v_proj")
    assert trainer.optimizer.wrt is nnx.LoRAParam
    assert history(trainer, "loss_scale/skipped") == [0.0, 0.0]
    assert trainer.moved == [True, True]
    flat = dict(jax.tree_util.tree_flatten_with_path(params(trainer))[0])
    before = dict(jax.tree_util.tree_flatten_with_path(trainer.initial_params)[0])
    lora = {
        p
        for p, _ in jax.tree_util.tree_flatten_with_path(
            nnx.to_pure_dict(nnx.state(trainer.model, nnx.LoRAParam))
        )[0]
    }
    assert lora and lora < set(flat)
    for path, value in before.items():  # a LoRA parameter moved, no other
        assert (not np.array_equal(np.asarray(flat[path]), value)) == (path in lora)
    # The user's optax.MultiSteps (Tunix's accumulation unset) moves the parameters on every
    # second step, as stock Tunix does; with Tunix's accumulation too, refused.
    assert sft(jnp.float16, steps=4, optimizer=multi_steps()).moved == [False, True] * 2
    with pytest.raises(IntegrationError, match="accumulates twice"):
        sft(jnp.float16, steps=1, accumulate=2, optimizer=multi_steps())


def test_a_checkpoint_resumes_in_a_fresh_process_bit_for_bit(tmp_path):
    # Tunix's Orbax v1 checkpointer: the loss-scaled optimizer's state saved under a name of
    # its own, which the next run's constructor leaves alone and enable() restores.
    resumes_bit_for_bit(tmp_path)


def test_a_stock_checkpoint_carries_its_optimizer_over(tmp_path):
    stock_checkpoint_carries_over(tmp_path)
