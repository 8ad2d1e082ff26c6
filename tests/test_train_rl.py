"""The RL fine-tuning job (examples/train_rl.py) in its --quick mode.

References: the JSON schema is the one docs/examples/train_rl.md documents; the inference
path (key/value cache) is checked against the training path (one forward pass) in float32,
where the two must agree; the mismatch, the reward, the advantages and the underflow count
are recomputed in NumPy from the job's own first batch; the dynamic scale follows the
plain-Python model of the DynamicScale rule (``reference_scalers.ReferenceDynamic``).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_script  # tests/ is on sys.path under pytest
from reference_scalers import ReferenceDynamic  # tests/ is on sys.path under pytest

import lossscale_jax as lsj

KEYS = {
    "config",
    "seed",
    "final_reward",
    "mismatch_kl",
    "mismatch_abs",
    "skipped_fraction",
    "lost_fraction",
}
CONFIGS = {"fp32", "bf16", "fp16_noscale", "fp16_dynamic", "fp16_headroom"}
SCALED = ("fp16_dynamic", "fp16_headroom")


def load():
    return load_script("examples/train_rl.py")


JITTED = ("train_step", "rollout", "reference_gradients", "lost_entries")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ex = load()
    out = tmp_path_factory.mktemp("rl")
    # The traces the job adds (the module is imported once per process: other tests call
    # its jitted functions too, at other sizes).
    before = {name: getattr(ex, name)._cache_size() for name in JITTED}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = ex.main(["--quick", "--out", str(out), "--no-progress"])
    sys.stdout.write(printed.getvalue())
    traced = {name: getattr(ex, name)._cache_size() - before[name] for name in JITTED}
    return ex, out, dict(result, traced=traced, printed=printed.getvalue())


@pytest.mark.slow
def test_quick_says_each_stage_when_done_without_the_bar(job):
    # --no-progress: a line per stage, in order, with the seconds since the run began, so a
    # run cut at a time limit (gpu_check.sh's) shows how far it got.
    ex, _, result = job
    lines = [line for line in result["printed"].splitlines() if line.startswith("[")]
    want = ["compiled", "pretrained 0 steps"]  # --quick: no pretraining
    want += [f"{c.name}, seed {s}: 8 steps" for c in ex.CONFIGS for s in range(2)]
    assert len(lines) == len(want)
    for line, what in zip(lines, want, strict=True):
        assert line.split("] ", 1)[1].startswith(what), (line, what)
    seconds = [float(line[1:].split(" s]")[0]) for line in lines]
    assert seconds == sorted(seconds) and seconds[0] > 0


def _rows(result, config):
    return sorted((r for r in result["rows"] if r["config"] == config), key=lambda r: r["seed"])


def _first_batch(ex, result, dtype, seed=0):
    """The batch the job's first step of ``seed`` sampled in ``dtype``."""
    chars, train = ex.load_corpus()
    vowels = jnp.asarray([c in ex.VOWELS for c in chars], jnp.float32)
    steps, size = result["job"]["steps"], result["job"]["size"]
    offsets = ex.prompt_offsets(size, seed, steps, len(train))[0]
    key = ex.sample_keys(seed, steps)[0]
    params = result["job"]["params"]
    return ex.rollout(size, dtype, params, jnp.asarray(train), offsets, key, vowels)


@pytest.mark.slow
def test_quick_json_rows_follow_the_schema(job):
    ex, out, result = job
    rows = json.loads((out / "rl_results.json").read_text())
    assert rows == result["rows"]
    seeds = 2  # --quick
    assert len(rows) == len(CONFIGS) * seeds
    assert {r["config"] for r in rows} == CONFIGS == {c.name for c in ex.CONFIGS}
    for r in rows:
        assert set(r) == KEYS, r
        assert r["seed"] in range(seeds)
        assert 0.0 <= r["final_reward"] <= 1.0
        assert r["mismatch_kl"] >= 0.0 and r["mismatch_abs"] >= 0.0
        assert 0.0 <= r["skipped_fraction"] <= 1.0
        if r["config"] == "fp32":
            assert r["lost_fraction"] is None  # the reference is not compared with itself
        else:
            assert 0.0 <= r["lost_fraction"] <= 1.0
    for config in CONFIGS:
        assert [r["seed"] for r in _rows(result, config)] == [0, 1]


@pytest.mark.slow
def test_quick_mismatch_ordering(job):
    """float32 agrees with itself; float16 (scaled or not) is 4x or more closer than
    bfloat16, in every seed.

    Measured in the quick run (initial weights, 8 steps): bf16's KL is about 40x
    float16's, and fp32's is 1e-14 (float32 rounding of two orders of summation).
    """
    _, _, result = job
    bf16 = _rows(result, "bf16")
    for seed in (0, 1):
        assert _rows(result, "fp32")[seed]["mismatch_kl"] < 1e-10
        assert bf16[seed]["mismatch_kl"] > 1e-8
        for config in ("fp16_noscale", *SCALED):
            row = _rows(result, config)[seed]
            assert 4 * row["mismatch_kl"] <= bf16[seed]["mismatch_kl"], (config, seed)
            assert row["mismatch_abs"] < bf16[seed]["mismatch_abs"], (config, seed)


@pytest.mark.slow
def test_inference_path_is_the_training_path_in_float32(job):
    """The key/value-cache decoding and the one-pass forward are two implementations of
    one model: in float32 they agree to rounding, in bfloat16 they do not; the job's
    first-step mismatch equals a NumPy computation from the two paths' log-probs.

    The log-probs of the training path are taken again here, by the gradient computation
    the job's step runs (``gradients``), compiled on its own: XLA may round a token's
    float32 log-softmax differently in the two programs, in its log-sum-exp and in the
    subtraction from the logit, one float32 rounding each (the log-softmax is float32 in
    both compute dtypes). So each token's log-ratio ``d`` here is within ``u``, two ulps
    of its ``|logp|``, of the job's: the job's mean ``|d|`` is within ``mean(u)`` of
    this one, and its KL term ``expm1(d) - d`` (about ``d**2 / 2``) within
    ``|d| u + u**2 / 2`` per token, plus what the job's float32 evaluation of it loses to
    cancellation (an ulp of ``d``). Either mean, summed in float32 over ``n`` tokens, is
    also off by at most ``n`` float32 epsilons of itself. In float32 the mismatch is
    rounding itself (about 1e-7, a fifth of an ulp of a log-prob near ``log(1/vocab)``):
    the same bound holds, which a ratio of two rounding noises would not (rtol 1e-3 failed
    on a GPU at 1.8% and on an AVX2 CPU at 0.45%)."""
    ex, _, result = job
    params, size = result["job"]["params"], result["job"]["size"]
    eps32 = float(np.finfo(np.float32).eps)
    for config in (c for c in ex.CONFIGS if c.name in ("fp32", "bf16")):
        batch = _first_batch(ex, result, config.dtype)
        opt_state = ex.make_tx(size, config).init(params)
        gradients = jax.jit(ex.gradients, static_argnums=(0, 1, 2))
        logp = gradients(size, config.dtype, False, params, batch, opt_state)[1]
        train = np.asarray(logp, np.float64)
        d = train - np.asarray(batch.logp_rollout, np.float64)
        if config.dtype == jnp.float32:
            # Rounding: under 1e-5, about 20 float32 ulps of a log-prob near -4.6.
            assert np.max(np.abs(d)) < 1e-5
        else:
            assert np.mean(np.abs(d)) > 1e-4  # bfloat16's 8 bits: 2^-8 per rounding
        u = 2 * np.spacing(np.abs(train).astype(np.float32)).astype(np.float64)
        h = result["job"]["results"][config.name][0]
        want_abs, want_kl = np.mean(np.abs(d)), np.mean(np.expm1(d) - d)
        n = d.size
        tol_abs = np.mean(u) + n * eps32 * want_abs
        cancellation = np.spacing(np.abs(d).astype(np.float32)).astype(np.float64)
        tol_kl = np.mean(np.abs(d) * u + u**2 / 2 + cancellation) + n * eps32 * want_kl
        assert abs(h["abs"][0] - want_abs) <= tol_abs, (config.name, h["abs"][0], want_abs)
        assert abs(h["kl"][0] - want_kl) <= tol_kl, (config.name, h["kl"][0], want_kl)
        if config.dtype == jnp.bfloat16:  # where it means something: the bound is tight
            assert tol_abs < 0.01 * want_abs and tol_kl < 0.01 * want_kl


@pytest.mark.slow
def test_reward_and_advantages_against_the_text(job):
    """The reward is the share of vowels in the decoded completion; advantages are the
    rewards normalised within each prompt's group."""
    ex, _, result = job
    chars, train = ex.load_corpus()
    size = result["job"]["size"]
    batch = _first_batch(ex, result, jnp.float16)
    seq = np.asarray(batch.seq)
    n = size.prompts * size.group
    assert seq.shape == (n, size.prompt_len + size.gen)
    offsets = np.asarray(ex.prompt_offsets(size, 0, result["job"]["steps"], len(train))[0])
    for i, row in enumerate(seq):  # each group starts from its prompt
        start = offsets[i // size.group]
        np.testing.assert_array_equal(
            row[: size.prompt_len], train[start : start + size.prompt_len]
        )
    texts = ["".join(chars[t] for t in row[size.prompt_len :]) for row in seq]
    reward = np.array([sum(c in "aeiou" for c in t) / size.gen for t in texts])
    np.testing.assert_allclose(batch.reward, reward.mean(), rtol=1e-6)
    grouped = reward.reshape(size.prompts, size.group)
    want = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(batch.advantage, want.ravel(), rtol=1e-4, atol=1e-4)
    h = result["job"]["results"]["fp16_noscale"][0]
    assert h["reward"][0] == pytest.approx(reward.mean())


@pytest.mark.slow
def test_underflow_probe_against_numpy(job):
    """Unscaled float16 loses a large share of the gradient entries and the scaled runs
    almost none (measured: 18% against 0.004-0.01%); the job's first probe of
    fp16_noscale equals a NumPy count on gradients taken again."""
    ex, _, result = job
    for seed in (0, 1):
        unscaled = _rows(result, "fp16_noscale")[seed]["lost_fraction"]
        assert unscaled > 0.05
        for config in SCALED:
            assert 5 * _rows(result, config)[seed]["lost_fraction"] <= unscaled
            assert _rows(result, config)[seed]["lost_fraction"] < 0.002
        assert _rows(result, "bf16")[seed]["lost_fraction"] < 0.002  # float32's range
    config = next(c for c in ex.CONFIGS if c.name == "fp16_noscale")
    params, size = result["job"]["params"], result["job"]["size"]
    batch = _first_batch(ex, result, jnp.float16)
    opt_state = ex.make_tx(size, config).init(params)
    _, _, g16, _ = ex.train_step(size, config, params, opt_state, batch)
    g32 = ex.reference_gradients(size, params, batch)
    g16 = [np.asarray(x) for x in jax.tree_util.tree_leaves(g16)]
    g32 = [np.asarray(x) for x in jax.tree_util.tree_leaves(g32)]
    assert all(a.dtype == np.float16 for a in g16) and all(b.dtype == np.float32 for b in g32)
    lost = sum(int(np.sum((a == 0) & (b != 0))) for a, b in zip(g16, g32, strict=True))
    nonzero = sum(int(np.sum(b != 0)) for b in g32)
    h = result["job"]["results"]["fp16_noscale"][0]
    assert (int(h["lost"][0]), int(h["nonzero"][0])) == (lost, nonzero)


@pytest.mark.slow
def test_quick_counts_agree_with_the_histories(job):
    ex, _, result = job
    steps = result["job"]["steps"]
    last = max(1, round(ex.LAST * steps))
    for config in ex.CONFIGS:
        for seed, h in enumerate(result["job"]["results"][config.name]):
            row = _rows(result, config.name)[seed]
            for key in ("reward", "kl", "abs", "scale", "skipped"):
                assert len(h[key]) == steps and np.all(np.isfinite(h[key]))
            assert row["skipped_fraction"] == pytest.approx(np.mean(h["skipped"]))
            assert row["final_reward"] == pytest.approx(np.mean(h["reward"][-last:]))
            assert row["mismatch_kl"] == pytest.approx(np.mean(h["kl"][-last:]))
            probes = 0 if config.dtype == jnp.float32 else -(-steps // 10)
            assert len(h["lost"]) == len(h["nonzero"]) == probes
            if isinstance(config.policy, lsj.DynamicScale):
                model = ReferenceDynamic(config.policy)  # skipped == overflow
                used = [float(model.scale)] + [model.step(bool(o))[0] for o in h["skipped"]]
                np.testing.assert_array_equal(h["scale"], used[:-1])
            elif isinstance(config.policy, lsj.HeadroomScale):
                exps = np.log2(h["scale"])  # powers of two: the unscale is exact
                np.testing.assert_array_equal(exps, np.round(exps))
            else:
                np.testing.assert_array_equal(h["scale"], 1.0)
                assert not np.any(h["skipped"])


@pytest.mark.slow
def test_quick_writes_table_and_plot(job):
    ex, out, result = job
    table = (out / "rl_table.md").read_text()
    assert table == result["table"] + "\n"
    for config in ex.CONFIGS:
        assert f"| {config.name} |" in table
    assert "Targets:" in table
    png = (out / "rl_plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_bad_flags_are_rejected():
    ex = load()
    for argv in (["--steps", "0"], ["--seeds", "0"], ["--probe-every", "0"]):
        with pytest.raises(SystemExit):
            ex.parse_args(argv)
    with pytest.raises(SystemExit):
        ex.parse_args(["--pretrain-steps", "-1"])
    assert ex.parse_args(["--quick"]).pretrain_steps == 0


def test_the_gpu_size_is_a_policy_of_85m_parameters():
    """``--size gpu``: d_model 768, 12 layers, 12 heads, context 128 (prompt and completion
    fit), 24 steps x 2 seeds from 200 pretraining steps; its parameters counted by hand:
    per block the query-key-value (3d^2 + 3d), output (d^2 + d) and MLP (4d^2 + 4d and
    4d^2 + d) kernels and biases and two LayerNorms (4d): 12d^2 + 13d; then the token and
    position embeddings and the final LayerNorm."""
    ex = load()
    args = ex.parse_args(["--size", "gpu"])
    size = args.size
    assert size is ex.SIZES["gpu"] and not size.emulated
    assert (args.steps, args.seeds, args.pretrain_steps) == (24, 2, 200)
    assert ex.parse_args(["--size", "gpu", "--quick"]).steps == 8
    d, vocab = size.d_model, len(ex.load_corpus()[0])
    assert size.seq <= size.context and size.head_dim * size.n_head == d
    shapes = jax.eval_shape(lambda k: ex.init_params(size, k, vocab), jax.random.key(0))
    count = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
    assert count == size.n_layer * (12 * d * d + 13 * d) + (vocab + size.context) * d + 2 * d
    assert 50e6 <= count <= 150e6, count
    assert size.loss_weight == size.prompts * size.group * size.gen / 2**20
    with pytest.raises(SystemExit):
        ex.parse_args(["--size", "tpu"])


def test_the_gpu_sizes_matmuls_are_the_backends_own():
    """The emulated sizes round as a GPU would (float32 sums, rounded to the compute
    dtype); the GPU's sizes leave the matmul to the backend, in the compute dtype, float32
    at full precision (not TF32)."""
    ex = load()
    a = jnp.ones((4, 8), jnp.float16)

    def dots(size, x):
        jaxpr = jax.make_jaxpr(lambda x: ex.mm(size, "ij,jk->ik", x, x.T))(x).jaxpr
        return [e.params for e in jaxpr.eqns if e.primitive.name == "dot_general"]

    (emulated,) = dots(ex.SIZES["cpu"], a)
    assert emulated["preferred_element_type"] == jnp.float32
    for x in (a, a.astype(jnp.float32)):
        (native,) = dots(ex.SIZES["gpu_tiny"], x)
        assert native["preferred_element_type"] in (None, x.dtype)
        assert jax.lax.Precision.HIGHEST in tuple(native["precision"])


@pytest.mark.slow
def test_the_gpu_sizes_rollout_is_its_training_path_in_float32():
    """The GPU's code (``gpu_tiny``: its kernels at the small model's size): the key/value
    cache decoding and the one-pass forward agree in float32 to rounding, as in the
    emulated job (under 1e-5, about 20 float32 ulps of a log-prob near -4.6)."""
    ex = load()
    size = ex.SIZES["gpu_tiny"]
    chars, train = ex.load_corpus()
    vowels = jnp.asarray([c in ex.VOWELS for c in chars], jnp.float32)
    params = ex.init_params(size, jax.random.key(1), len(chars))
    offsets = ex.prompt_offsets(size, 0, 1, len(train))[0]
    key = ex.sample_keys(0, 1)[0]
    batch = ex.rollout(size, jnp.float32, params, jnp.asarray(train), offsets, key, vowels)
    assert batch.seq.shape == (size.prompts * size.group, size.seq)
    logp = jax.jit(ex.token_logp, static_argnums=0)(size, params, batch.seq)
    d = np.asarray(logp, np.float64) - np.asarray(batch.logp_rollout, np.float64)
    assert d.shape == (size.prompts * size.group, size.gen)
    assert np.max(np.abs(d)) < 1e-5 and np.all(np.asarray(logp) < 0)


@pytest.mark.slow
def test_each_jitted_function_compiled_once(job):
    """One trace per configuration's step and per dtype's rollout, one for the probe's
    float32 gradient, one per compared dtype for its count: no step retraced."""
    ex, _, result = job
    assert result["traced"] == {
        "train_step": len(ex.CONFIGS),
        "rollout": len({c.dtype for c in ex.CONFIGS}),
        "reference_gradients": 1,
        "lost_entries": 2,  # bfloat16 and float16 gradients
    }
