"""``lossscale_jax.integrations.tunix`` the way Tunix's users set RL up: LoRA on every
projection, a scale per role, roles on meshes of their own, the mismatch metrics, and what
``enable`` refuses (a release lacking a seam, one trainer of a cluster) with nothing changed.

Run where google-tunix is installed (``make test-tunix``); skipped elsewhere, saying so. The
model, tokenizer and reward are the Tunix example's (``examples/train_tunix_grpo.py``, its
"quick" size); LoRA targets are Tunix's examples' (``module_path`` over Qwen3's projections).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale_jax as lsj
from lossscale_jax.errors import IntegrationError, IntegrationWarning

if importlib.util.find_spec("tunix") is None:
    pytest.skip(
        "google-tunix is not installed (an optional integration: make test-tunix installs it "
        "in a venv of its own and runs this module)",
        allow_module_level=True,
    )

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Tunix's imports
    from flax import nnx
    from test_integration_tunix import EX, SIZE, TUNIX_WARNINGS, history, sft, with_lora
    from tunix.rl import rl_cluster as rl
    from tunix.rl import utils as rl_utils
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.ppo import ppo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import peft_trainer

    from lossscale_jax.integrations import tunix as lsj_tunix
    from lossscale_jax.integrations.tunix import _seams as _tunix_seams

pytestmark = [pytest.mark.slow, *(pytest.mark.filterwarnings(f) for f in TUNIX_WARNINGS)]

# Tunix's examples put LoRA on every projection of Qwen3 (and Llama):
# ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj"; one target each here.
TARGETS = {
    "q_proj": ".*q_proj",
    "k_proj": ".*k_proj",
    "v_proj": ".*v_proj",
    "o_proj": ".*o_proj",
    "mlp": ".*gate_proj|.*down_proj|.*up_proj",
}
EVERY_PROJECTION = "|".join(TARGETS.values())
ROLES = (rl.Role.ACTOR, rl.Role.REFERENCE, rl.Role.ROLLOUT)


def make_cluster(actor, *, critic=None, meshes=None, steps=2, optimizer=None, gen=6):
    """An RLCluster of the example's roles on one device (or ``meshes``, role -> mesh)."""
    grid = EX.mesh()
    roles = (*ROLES, rl.Role.CRITIC) if critic is not None else ROLES
    return rl.RLCluster(
        actor=actor,
        critic=critic,
        reference=None,
        tokenizer=EX.WordTokenizer(),
        cluster_config=rl.ClusterConfig(
            role_to_mesh=meshes or {role: grid for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl.RLTrainingConfig(
                actor_optimizer=optimizer or optax.adamw(1e-3),
                critic_optimizer=optax.adamw(1e-3) if critic is not None else None,
                eval_every_n_steps=100,
                max_steps=steps,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=gen,
                max_prompt_length=6,
                kv_cache_size=6 + gen + 4,
                temperature=1.0,
                top_p=1.0,
                top_k=None,
                eos_tokens=[EX.EOS, EX.PAD],
                seed=0,
            ),
        ),
    )


def grpo(cluster, **config):
    return grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=EX.reward,
        algo_config=grpo_learner.GRPOConfig(num_generations=4, beta=0.0, **config),
    )


def ppo(cluster):
    return ppo_learner.PPOLearner(
        rl_cluster=cluster, ppo_config=ppo_learner.PPOConfig(beta=0.0), reward_fns=EX.reward
    )


PROMPTS = [{"prompts": np.array(["t3 t4", "t9 t10 t11"])}]


def train(learner, steps=2, mesh=None):
    with EX.entered(mesh or EX.mesh()):
        learner.train(PROMPTS * steps)


def rl_history(cluster, name, role="actor"):
    return [
        float(v)
        for v in cluster.actor_trainer.metrics_logger.get_metric_history(role, name, "train")
    ]


def params(model, kind=nnx.Param):
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, kind)))[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}


def dot_dtypes(model, width=None):
    """``(lhs, rhs, out)`` dtypes of every matmul of ``model``'s forward on a left-padded batch
    (no cache), read off its jaxpr (``width``: those whose output has that last dimension)."""
    tokens = jnp.asarray(EX.sft_batches(SIZE, 1)[0].input_tokens[:2])
    inputs = EX.model_inputs(peft_trainer.TrainingInput(input_tokens=tokens, input_mask=None))
    graph, state = nnx.split(model)

    def forward(state):
        out = nnx.merge(graph, state)(tokens, inputs["positions"], None, inputs["attention_mask"])
        return out[0]

    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            out = eqn.outvars[0].aval
            if eqn.primitive.name == "dot_general" and width in (None, out.shape[-1]):
                found.add(tuple(str(v.aval.dtype) for v in (*eqn.invars[:2], eqn.outvars[0])))
            for sub in jcore.jaxprs_in_params(eqn.params):  # pjit, remat, scan: their bodies
                walk(sub)

    walk(jax.make_jaxpr(forward)(state).jaxpr)
    return found


# LoRA on any projection, float16, rollout included.


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_lora_on_each_projection_computes_samples_and_trains_in_float16(target):
    # Stock Tunix with float32 parameters computing in float16 (or bfloat16): a LoRA on
    # v_proj yields float32 into the float16 key/value cache, and the first rollout dies in
    # lax.dynamic_update_slice; on o_proj or the MLP the residual stream turns float32.
    actor = with_lora(EX.qwen3(SIZE), TARGETS[target])
    before, base_before = params(actor, nnx.LoRAParam), params(actor)
    cluster = make_cluster(actor)
    learner = grpo(cluster)
    lsj_tunix.enable(learner, lsj.DynamicScale(init_scale=2.0**10))
    # Every matmul of the actor's forward and of the rollout's model is float16, LoRA's
    # included, as without LoRA.
    for model in (cluster.actor_trainer.model, cluster.rollout.model()):
        assert dot_dtypes(model) == {("float16", "float16", "float16")}
    train(learner)
    assert rl_history(cluster, "loss_scale/skipped") == [0.0, 0.0]
    assert np.all(np.isfinite(rl_history(cluster, "grad_norm")))
    after, base_after = (
        params(cluster.actor_trainer.model, nnx.LoRAParam),
        params(cluster.actor_trainer.model),
    )
    assert any(not np.array_equal(before[k], after[k]) for k in before)  # the LoRA trained
    for k, v in base_before.items():  # and nothing else
        if k not in before:
            np.testing.assert_array_equal(base_after[k], v, err_msg=k)


def test_lora_sft_on_every_projection_tracks_float32():
    # Tunix's example layout (LoRA on every projection): float16 under enable() against stock
    # Tunix in float32, the same LoRA initialisation.
    want = history(sft(jnp.float32, enable=False, steps=4, lora=EVERY_PROJECTION), "loss")
    trainer = sft(jnp.float16, steps=4, lora=EVERY_PROJECTION)
    got = history(trainer, "loss")
    assert history(trainer, "loss_scale/skipped") == [0.0] * 4
    # float16 rounds each op's result to 2**-11 relative (the matmuls sum in float32): the
    # first loss agrees to well within 0.5%; Adam's steps of ~lr per weight keep the two
    # runs together within 5%, as for the full model (test_integration_tunix).
    np.testing.assert_allclose(got[0], want[0], rtol=5e-3)
    np.testing.assert_allclose(got, want, rtol=0.05)
    assert got[-1] < got[0]
    assert dot_dtypes(trainer.model) == {("float16", "float16", "float16")}


def test_ppo_with_lora_everywhere_and_a_scale_per_role():
    # The critic's gradients have another range than the actor's (a value head's squared
    # error): critic_policy gives it its own scale, and each is the one in force.
    actor = with_lora(EX.qwen3(SIZE), EVERY_PROJECTION)
    lora_before = params(actor, nnx.LoRAParam)
    cluster = make_cluster(actor, critic=rl_utils.create_critic_model(EX.qwen3(SIZE)))
    learner = ppo(cluster)
    # One trainer of a cluster with a critic: refused, naming critic_policy (PPO takes it).
    with pytest.raises(IntegrationError, match=r"enable\(learner, policy, critic_policy="):
        lsj_tunix.enable(cluster.actor_trainer)
    lsj_tunix.enable(
        learner, lsj.DynamicScale(init_scale=2.0**10), critic_policy=lsj.StaticScale(16.0)
    )
    train(learner)
    assert rl_history(cluster, "loss_scale/loss_scale") == [2.0**10] * 2
    assert rl_history(cluster, "loss_scale/loss_scale", "critic") == [16.0] * 2
    for role in ("actor", "critic"):
        assert rl_history(cluster, "loss_scale/skipped", role) == [0.0, 0.0]
        assert np.all(np.isfinite(rl_history(cluster, "loss", role)))
    lora_after = params(cluster.actor_trainer.model, nnx.LoRAParam)
    assert any(not np.array_equal(lora_before[k], lora_after[k]) for k in lora_before)
    assert dot_dtypes(cluster.actor_trainer.model) == {("float16", "float16", "float16")}
    # The critic is the actor's model with a value head (Tunix's create_critic_model): an
    # nnx.Linear without a dtype, which computes in the float32 its kernel promotes to; the
    # rest of it in float16.
    critic = cluster.critic_trainer.model
    assert dot_dtypes(critic, width=1) == {("float32", "float32", "float32")}
    assert dot_dtypes(critic) - dot_dtypes(critic, width=1) == {("float16",) * 3}


# What enable() refuses, with nothing changed.


def snapshot(trainer):
    """What ``enable`` would change in a trainer and its model: the trainer's attributes
    (by identity) and the model's graph (its modules' dtypes among its static attributes)."""
    return {k: id(v) for k, v in vars(trainer).items()}, nnx.graphdef(trainer.model)


def test_one_trainer_of_a_cluster_is_refused_naming_the_learner():
    cluster = make_cluster(EX.qwen3(SIZE))
    learner = grpo(cluster)
    before = snapshot(cluster.actor_trainer)
    rollout_graph = cluster.rollout._sampler._transformer_graphdef
    # GRPO has no critic: the message does not suggest critic_policy, which GRPO refuses.
    with pytest.raises(IntegrationError, match=r"enable\(learner, policy\) on the RL") as e:
        lsj_tunix.enable(cluster.actor_trainer, lsj.DynamicScale())
    assert "critic_policy" not in str(e.value)
    with pytest.raises(IntegrationError, match=r"critic_policy=\.\.\.\) is for PPO's critic"):
        lsj_tunix.enable(learner, critic_policy=lsj.DynamicScale())
    assert snapshot(cluster.actor_trainer) == before
    assert cluster.rollout._sampler._transformer_graphdef is rollout_graph
    lsj_tunix.enable(learner, lsj.DynamicScale(init_scale=2.0**10))  # the way that works
    train(learner, steps=1)
    assert rl_history(cluster, "loss_scale/skipped") == [0.0]


def plain_sft_trainer():
    with EX.entered(EX.mesh()):
        trainer = peft_trainer.PeftTrainer(
            EX.qwen3(SIZE),
            optax.adamw(1e-2),
            peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=2),
        )
    return trainer.with_gen_model_input_fn(EX.model_inputs)


def test_a_release_lacking_a_seam_is_refused_by_name_with_nothing_changed(monkeypatch):
    from tunix.rl import rl_learner

    def another_step(self, model, inputs):
        raise AssertionError("never called")

    def main_branchs_step(self, model, optimizer, grad_accumulator, inputs, is_update_step):
        raise AssertionError("never called")

    trainer = plain_sft_trainer()
    before = snapshot(trainer)
    monkeypatch.setattr(peft_trainer.PeftTrainer, "_train_step", another_step)
    monkeypatch.delattr(rl_learner.RLLearner, "_generate_and_compute_advantage")
    with pytest.raises(IntegrationError) as refused:
        lsj_tunix.enable(trainer)
    message = str(refused.value)
    assert (
        "tunix.sft.peft_trainer.PeftTrainer._train_step(self, model, inputs): the integration "
        "needs tunix.sft.peft_trainer.PeftTrainer._train_step(self, model, optimizer, inputs)"
    ) in message
    assert "tunix.rl.rl_learner.RLLearner._generate_and_compute_advantage: missing" in message
    assert message.count("\n- ") == 2  # those two, and no other
    assert snapshot(trainer) == before
    # The step of Tunix's main branch, on a release without the rest of its seams (0.1.7's):
    # refused, naming what the main branch's step also relies on.
    monkeypatch.setattr(peft_trainer.PeftTrainer, "_train_step", main_branchs_step)
    with pytest.raises(IntegrationError) as refused:
        lsj_tunix.enable(trainer)
    message = str(refused.value)
    assert "tunix.sft.peft_trainer.GradientAccumulator.add: missing" in message
    assert "tunix.sft.utils.LossOutput: missing" in message
    assert "_train_step" not in message  # that one is there as used
    assert snapshot(trainer) == before


def test_a_trainer_lacking_what_enable_relies_on_is_refused_by_name():
    # Tunix's next checkpoint manager has no Orbax manager under `_checkpoint_manager` (the
    # one enable()'s saves through), and its accumulation is no optax.MultiSteps.
    trainer = plain_sft_trainer()
    del trainer.checkpoint_manager._checkpoint_manager
    before = snapshot(trainer)
    with pytest.raises(IntegrationError, match=r"checkpoint_manager\._checkpoint_manager \(the"):
        lsj_tunix.enable(trainer)
    assert snapshot(trainer) == before
    accumulating = plain_sft_trainer()
    accumulating.config.gradient_accumulation_steps = 2  # but no MultiSteps around its tx
    before = snapshot(accumulating)
    with pytest.raises(IntegrationError, match="would accumulate a second time"):
        lsj_tunix.enable(accumulating)
    assert snapshot(accumulating) == before


def test_a_release_with_every_seam_and_another_version_works(monkeypatch):
    monkeypatch.setattr(_tunix_seams, "version", lambda: "0.1.8")
    trainer = plain_sft_trainer()
    with pytest.warns(
        IntegrationWarning,
        match=r"tested with google-tunix 0\.1\.7 and Tunix's main branch at c7d8950 \(0\.1\.8\); "
        r"this environment has 0\.1\.8",
    ):
        lsj_tunix.enable(trainer, lsj.DynamicScale(init_scale=2.0**10))
    with EX.entered(EX.mesh()):
        trainer.train(EX.sft_batches(SIZE, 2, seed=3))
    assert history(trainer, "loss_scale/skipped") == [0.0, 0.0]
    assert np.all(np.isfinite(history(trainer, "loss")))


def test_a_trainer_that_overrides_tunixs_step_is_refused_by_name():
    class OwnStep(peft_trainer.PeftTrainer):
        def create_train_step_fn(self):
            return self._train_step

    with EX.entered(EX.mesh()):
        trainer = OwnStep(
            EX.qwen3(SIZE), optax.adamw(1e-2), peft_trainer.TrainingConfig(eval_every_n_steps=9)
        )
    before = snapshot(trainer)
    with pytest.raises(
        IntegrationError, match=r"OwnStep overrides PeftTrainer\.create_train_step_fn"
    ):
        lsj_tunix.enable(trainer)
    assert snapshot(trainer) == before


# The mismatch as RL practitioners read it.


def test_the_mismatch_metrics_by_hand():
    nan = np.nan
    trainer = jnp.asarray([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -4.0]], jnp.float32)
    # Ratios exp(trainer - rollout): row 0: 1 (bit for bit), e^-0.5 (clipped below 0.8),
    # e^0.1 (inside), no rollout log-prob (left out); row 1: e^0.25 (clipped above 1.2),
    # 1 (bit for bit), 1 (bit for bit) but masked out, e^-1e-3 (inside).
    rollout = jnp.asarray([[-1.0, -1.5, -0.6, nan], [-1.25, -1.0, -1.0, -3.999]], jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 1]], jnp.int32)
    got = {
        k: float(v)
        for k, v in lsj_tunix_mismatch().mismatch(trainer, rollout, mask, (0.2, 0.2)).items()
    }
    d = np.array([0.0, -0.5, 0.1, 0.25, 0.0, -0.001])  # the 6 tokens seen
    np.testing.assert_allclose(got["mismatch/kl"], np.mean(np.expm1(d) - d), rtol=1e-5)
    np.testing.assert_allclose(got["mismatch/abs_log_ratio"], np.mean(np.abs(d)), rtol=1e-5)
    np.testing.assert_allclose(got["mismatch/max_abs_log_ratio"], 0.5, rtol=1e-6)
    third = float(np.float32(2) / np.float32(6))  # the shares are float32
    assert got["mismatch/clip_fraction"] == third
    assert got["mismatch/exact_fraction"] == third
    # DAPO's asymmetric range [1 - 0.2, 1 + 0.28]: e^0.25 = 1.284 is still clipped, and with
    # a range of 0.3 on both sides neither is.
    assert (
        float(
            lsj_tunix_mismatch().mismatch(trainer, rollout, mask, (0.2, 0.28))[
                "mismatch/clip_fraction"
            ]
        )
        == third
    )
    assert (
        float(
            lsj_tunix_mismatch().mismatch(trainer, rollout, mask, (0.4, 0.3))[
                "mismatch/clip_fraction"
            ]
        )
        == 0.0
    )


def lsj_tunix_mismatch():
    from lossscale_jax.integrations.tunix import _mismatch as _tunix_mismatch

    return _tunix_mismatch


# Rollout log-probs shifted per completion, by how much the test decides: 0 (the ratio exactly
# 1), +-1 (e^-+1: outside any clip range the learners use), 1e-3 (inside it, not exact).
SHIFTS = (0.0, 1.0, 1e-3, -1.0)


def test_clip_and_exact_fractions_of_a_run_whose_true_shares_are_known():
    # A policy whose every log-prob is exactly -log(vocab) in both paths (its output
    # projection is zero: all logits are 0 in float16 and float32, in the rollout's decode as
    # in the trainer's forward, whatever the kernels), kept so by a learning rate of 0. The
    # rollout's log-probs are then shifted per completion by SHIFTS: the shares the metrics
    # must report are known from the tokens the learner keeps.
    actor = EX.qwen3(SIZE)
    actor.lm_head.w[...] = jnp.zeros_like(actor.lm_head.w[...])
    cluster = make_cluster(actor, steps=2, optimizer=optax.adamw(0.0))
    learner = grpo(cluster, epsilon=0.2)
    lsj_tunix.enable(learner, lsj.DynamicScale(init_scale=2.0**10))
    generate, prepare = cluster.rollout.generate, learner._generate_and_compute_advantage

    def shifted(*args, **kwargs):
        out = generate(*args, **kwargs)
        logprobs = [
            np.asarray(lp, np.float32) + np.float32(SHIFTS[i % len(SHIFTS)])
            for i, lp in enumerate(out.logprobs)
        ]
        return dataclasses.replace(out, logprobs=logprobs)

    examples = []

    def kept(*args, **kwargs):
        examples.append(prepare(*args, **kwargs))
        return examples[-1]

    cluster.rollout.generate, learner._generate_and_compute_advantage = shifted, kept
    train(learner)
    clip, exact = [], []
    for example in examples:
        seen = np.asarray(example.completion_mask, bool) & np.isfinite(
            np.asarray(example.rollout_per_token_logps)
        )
        per_row = seen.sum(axis=1)
        shift = np.array([SHIFTS[i % len(SHIFTS)] for i in range(len(per_row))])
        clip.append(per_row[np.abs(shift) == 1.0].sum() / per_row.sum())
        exact.append(per_row[shift == 0.0].sum() / per_row.sum())
    assert 0 < min(clip) and 0 < min(exact)
    np.testing.assert_allclose(rl_history(cluster, "mismatch/clip_fraction"), clip, rtol=1e-6)
    np.testing.assert_allclose(rl_history(cluster, "mismatch/exact_fraction"), exact, rtol=1e-6)


# Meshes: SFT sharded (fsdp, tp), RL with its roles on meshes of their own.


def two_meshes():
    """Two (fsdp 2, tp 2) meshes on devices 0-3 and 4-7, the axis names Qwen3's sharding
    rules use."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    devices = np.asarray(jax.devices()[:8])
    return tuple(
        jax.sharding.Mesh(d.reshape(2, 2), ("fsdp", "tp"), axis_types=auto)
        for d in (devices[:4], devices[4:])
    )


def padded(spec, ndim):
    """A partition spec with one entry per axis (``P('fsdp', 'tp')`` of a 3-d array is
    ``('fsdp', 'tp', None)``)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def assert_sharded_as_the_model(model, opt_state, mesh, moments=2):
    """Every parameter on ``mesh`` with the partition spec the model declares, and every
    optimizer leaf of a parameter's shape with that parameter's spec (``moments`` of them per
    parameter at least: Adam's two)."""
    state = nnx.state(model, nnx.Param)
    declared = jax.tree_util.tree_leaves(nnx.get_partition_spec(state))
    leaves = jax.tree_util.tree_leaves(state)
    by_shape = {}
    for x, spec in zip(leaves, declared, strict=True):
        spec = padded(spec, x.ndim)
        assert x.sharding.mesh == mesh, (x.shape, x.sharding)
        assert padded(x.sharding.spec, x.ndim) == spec, (x.shape, x.sharding)
        by_shape.setdefault(x.shape, set()).add(spec)
    matched = 0
    for x in jax.tree_util.tree_leaves(nnx.as_pure(opt_state)):
        if x.ndim >= 2 and len(by_shape.get(x.shape, ())) == 1:
            want = next(iter(by_shape[x.shape]))
            assert padded(x.sharding.spec, x.ndim) == want, (x.shape, x.sharding)
            matched += 1
    unambiguous = [x for x in leaves if x.ndim >= 2 and len(by_shape[x.shape]) == 1]
    assert matched >= moments * len(unambiguous) > 0


@pytest.mark.multidevice(8)
def test_sft_sharded_over_fsdp_and_tp_matches_one_device():
    mesh, _ = two_meshes()
    one = sft(jnp.float16, steps=3)
    sharded = sft(jnp.float16, steps=3, mesh=mesh)
    assert history(sharded, "loss_scale/skipped") == [0.0] * 3
    # The same float16 arithmetic but for the order of the sums the shards split: each op
    # result differs by at most an ulp of float16 (2**-11 relative), a few per layer; three
    # Adam steps keep the losses within 1%.
    np.testing.assert_allclose(history(sharded, "loss"), history(one, "loss"), rtol=1e-2)
    assert_sharded_as_the_model(sharded.model, sharded.optimizer.opt_state, mesh)


def loss_with_shard_fault(model, input_tokens, input_mask, positions, attention_mask):
    """Tunix's default SFT loss, plus ``inf * w[BAD, 0]`` of the embedding on a batch whose
    first row ends with ``BAD``: an inf gradient in one element of one parameter, which
    lives on one device of the mesh."""
    loss = peft_trainer._default_loss_fn(model, input_tokens, input_mask, positions, attention_mask)
    fault = jnp.where(input_tokens[0, -1] == FAULT_TOKEN, jnp.inf, 0.0)
    return loss + fault * model.embedder.input_embedding[...][FAULT_TOKEN, 0]


FAULT_TOKEN = SIZE.vocab - 1  # the token test_integration_tunix.batches plants


@pytest.mark.multidevice(8)
def test_an_inf_confined_to_one_shard_skips_the_step_on_every_device():
    mesh, _ = two_meshes()
    before = sft(jnp.float16, steps=2, mesh=mesh, loss=loss_with_shard_fault)
    trainer = sft(jnp.float16, steps=3, bad=(2,), mesh=mesh, loss=loss_with_shard_fault)
    embedding = trainer.model.embedder.input_embedding[...]
    holders = [
        d
        for d, index in embedding.sharding.devices_indices_map(embedding.shape).items()
        if index[0].start <= FAULT_TOKEN < index[0].stop and index[1].start == 0
    ]
    assert len(holders) == 1  # the inf gradient lived on one device
    assert history(trainer, "loss_scale/skipped") == [0.0, 0.0, 1.0]
    assert history(trainer, "loss_scale/loss_scale")[-1] == 2.0**9  # backed off from 2**10
    shards = lambda model: [  # noqa: E731
        [np.asarray(s.data) for s in x.addressable_shards]
        for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    ]
    for got, want in zip(shards(trainer.model), shards(before.model), strict=True):
        for a, b in zip(got, want, strict=True):  # every device's shard, bit for bit
            np.testing.assert_array_equal(a, b)
    step = trainer.optimizer.step[...]
    assert {int(np.asarray(s.data)) for s in step.addressable_shards} == {2}


def grpo_run(compute_dtype, meshes=None, replay=None):
    """A GRPO run (SGD with momentum: updates linear in the gradients) on one device or with
    the actor and the reference on ``meshes[0]`` and the rollout on ``meshes[1]``; ``replay``: the
    completions of another run, given to the learner in place of this rollout's (which still
    runs). The cluster and the completions the learner trained on."""
    actor_mesh = meshes[0] if meshes else None
    roles = None
    if meshes:
        roles = {rl.Role.ACTOR: meshes[0], rl.Role.REFERENCE: meshes[0], rl.Role.ROLLOUT: meshes[1]}
    cluster = make_cluster(
        EX.qwen3(SIZE), meshes=roles, steps=2, optimizer=optax.sgd(0.5, momentum=0.9)
    )
    learner = grpo(cluster)
    policy = lsj.DynamicScale(init_scale=2.0**10)
    if compute_dtype == jnp.float32:  # a loss scale where none is needed: enable() says so
        with pytest.warns(IntegrationWarning, match="needs none"):
            lsj_tunix.enable(learner, policy, compute_dtype=compute_dtype)
    else:
        lsj_tunix.enable(learner, policy, compute_dtype=compute_dtype)
    generate, seen = cluster.rollout.generate, []

    def recorded(*args, **kwargs):
        out = generate(*args, **kwargs)
        assert all(np.all(np.isfinite(lp)) for lp in out.logprobs)
        seen.append(replay[len(seen)] if replay else out)
        return seen[-1]

    cluster.rollout.generate = recorded
    train(learner, mesh=actor_mesh)
    return cluster, seen


@pytest.mark.multidevice(8)
def test_grpo_with_actor_and_rollout_on_meshes_of_their_own_matches_one_device():
    # In float32 (with a loss scale) the rollouts on the two layouts sample the same tokens:
    # the logits differ by float32's rounding (1e-7 relative), far from any sampling
    # boundary the few draws meet.
    meshes = two_meshes()
    one, one_out = grpo_run(jnp.float32)
    two, two_out = grpo_run(jnp.float32, meshes)
    assert [o.text for o in two_out] == [o.text for o in one_out]
    np.testing.assert_allclose(
        rl_history(two, "grad_norm"), rl_history(one, "grad_norm"), rtol=1e-5
    )
    # SGD (with momentum) moves each parameter by a sum of lr times its gradients: float32
    # gradients summed in another order agree to ~1e-6 relative of the largest.
    for k, want in params(one.actor_trainer.model).items():
        got = params(two.actor_trainer.model)[k]
        np.testing.assert_allclose(got, want, atol=1e-5 * (np.abs(want).max() + 1), err_msg=k)
    assert_sharded_as_the_model(
        two.actor_trainer.model, two.actor_trainer.optimizer.opt_state, meshes[0], moments=1
    )
    rollout_state = nnx.state(two.rollout.model(), nnx.Param)
    assert {x.sharding.mesh for x in jax.tree_util.tree_leaves(rollout_state)} == {meshes[1]}


@pytest.mark.multidevice(8)
def test_float16_grpo_on_meshes_of_their_own_matches_one_device_on_the_same_completions():
    # In float16 the two layouts' logits differ by an ulp (2**-11) here and there, which
    # moves some sampled tokens: the learner is given the one-device run's completions
    # (the rollout on its own mesh still runs, in float16, and gives finite log-probs).
    meshes = two_meshes()
    one, one_out = grpo_run(jnp.float16)
    two, _ = grpo_run(jnp.float16, meshes, replay=one_out)
    for role_history in ("loss_scale/skipped",):
        assert rl_history(two, role_history) == rl_history(one, role_history) == [0.0, 0.0]
    # float16 rounds each op to 2**-11 relative; the gradient of this 2-layer model passes
    # some tens of them: its norm agrees within 2%.
    np.testing.assert_allclose(
        rl_history(two, "grad_norm"), rl_history(one, "grad_norm"), rtol=2e-2
    )
    assert_sharded_as_the_model(
        two.actor_trainer.model, two.actor_trainer.optimizer.opt_state, meshes[0], moments=1
    )


# A first run that looks right.


def test_bfloat16_gets_no_loss_scale_unless_given_one():
    def scale_of(trainer):
        return float(lsj.get_loss_scale_state(nnx.as_pure(trainer.optimizer.opt_state)).scale)

    trainer = plain_sft_trainer()
    lsj_tunix.enable(trainer, compute_dtype=jnp.bfloat16)
    assert scale_of(trainer) == 1.0
    assert trainer.model.config.dtype == jnp.bfloat16
    given = plain_sft_trainer()
    with pytest.warns(IntegrationWarning, match="bfloat16 has float32's range and needs none"):
        lsj_tunix.enable(given, lsj.DynamicScale(), compute_dtype=jnp.bfloat16)
    assert scale_of(given) == 2.0**15  # applied as given
    # compute_dtype=None: the models as built, and the default follows the dtype they compute in
    with EX.entered(EX.mesh()):
        built = peft_trainer.PeftTrainer(
            EX.qwen3(SIZE, jnp.bfloat16),
            optax.adamw(1e-2),
            peft_trainer.TrainingConfig(eval_every_n_steps=9),
        )
    lsj_tunix.enable(built, compute_dtype=None)
    assert scale_of(built) == 1.0
    assert scale_of(lsj_tunix.enable(plain_sft_trainer())) == 2.0**15  # float16: DynamicScale()


def test_the_first_skipped_step_is_said_with_why_once(caplog):
    with caplog.at_level("WARNING", logger="lossscale_jax.integrations.tunix"):
        trainer = sft(jnp.float16, steps=4, bad=(1, 2))
    assert history(trainer, "loss_scale/skipped") == [0.0, 1.0, 1.0, 0.0]
    said = [r.getMessage() for r in caplog.records if "skipped an optimizer step" in r.getMessage()]
    # The batches' loss is inf (loss_with_fault): said as such, the dynamic scale's backoff
    # too, with no claim that a scale fixes it.
    assert len(said) == 1 and "the trainer skipped" in said[0]
    assert "its loss itself was not finite" in said[0]
    assert "backed off from 1024 to 512" in said[0] and "which cannot help" in said[0]
    assert not [r for r in caplog.records if "is stuck" in r.getMessage()]  # 2 in a row only


def said(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_the_log_says_what_was_not_finite_and_what_the_scale_did(caplog):
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(
            nnx.as_pure(nnx.state(EX.qwen3(SIZE), nnx.Param))
        )[0]
    ]
    # A dynamic scale of 2**24 on a finite loss: the scaled gradients pass float16's 65504 at
    # the loss's first cotangent, so every leaf overflows; the scale halves.
    with caplog.at_level("WARNING", logger="lossscale_jax.integrations.tunix"):
        trainer = sft(jnp.float16, steps=1, policy=lsj.DynamicScale(init_scale=2.0**24))
    assert history(trainer, "loss_scale/skipped") == [1.0]
    (line,) = said(caplog, "skipped an optimizer step")
    assert (
        "its gradients, scaled by 16777216, overflowed (inf or nan): the gradient of "
        f"{paths[0]} and {len(paths) - 1} other(s)"
    ) in line
    assert "backed off from 16777216 to 8388608" in line and "not finite before" not in line
    # A static scale: it stays where it was, and three skips in a row are a stuck run.
    caplog.clear()
    with caplog.at_level("WARNING", logger="lossscale_jax.integrations.tunix"):
        trainer = sft(jnp.float16, steps=3, policy=lsj.StaticScale(2.0**24))
    assert trainer.moved == [False] * 3
    (line,) = said(caplog, "skipped an optimizer step")
    assert "stayed at 16777216" in line and "backed off" not in line
    assert "this policy does not lower it" in line
    (line,) = said(caplog, "is stuck")
    assert "its last 3 optimizer steps were all skipped" in line
    assert "the gradients overflow at a loss scale of 16777216" in line
    # No loss scale (bfloat16's default), and a loss that is inf at every step: the loss is
    # named, the scale stays at 1, and the run is stuck.
    caplog.clear()
    with caplog.at_level("WARNING", logger="lossscale_jax.integrations.tunix"):
        sft(jnp.float16, steps=3, policy=lsj.NoScale(skip_on_overflow=True), bad=(0, 1, 2))
    (line,) = said(caplog, "skipped an optimizer step")
    assert "its loss itself was not finite" in line and "stayed at 1 " in line
    assert "backed off" not in line and "scaled by" not in line
    (line,) = said(caplog, "is stuck")
    assert "the loss itself is not finite, which no loss scale fixes" in line
