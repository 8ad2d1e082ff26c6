"""The RL fine-tuning job (examples/train_rl.py) in its --quick mode.

References: the JSON schema is the one docs/examples/train_rl.md documents; the inference
path (key/value cache) is checked against the training path (one forward pass) in float32,
where the two must agree; the mismatch, the reward, the advantages and the underflow count
are recomputed in NumPy from the job's own first batch; the dynamic scale follows the
plain-Python model of the DynamicScale rule (``reference_scalers.ReferenceDynamic``).
"""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ex = load()
    out = tmp_path_factory.mktemp("rl")
    result = ex.main(["--quick", "--out", str(out), "--no-progress"])
    return ex, out, result


def _rows(result, config):
    return sorted((r for r in result["rows"] if r["config"] == config), key=lambda r: r["seed"])


def _first_batch(ex, result, dtype, seed=0):
    """The batch the job's first step of ``seed`` sampled in ``dtype``."""
    chars, train = ex.load_corpus()
    vowels = jnp.asarray([c in ex.VOWELS for c in chars], jnp.float32)
    steps = result["job"]["steps"]
    offsets = ex.prompt_offsets(seed, steps, len(train))[0]
    key = ex.sample_keys(seed, steps)[0]
    params = result["job"]["params"]
    return ex.rollout(dtype, params, jnp.asarray(train), offsets, key, vowels)


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
    first-step mismatch equals a NumPy computation from the two paths' log-probs."""
    ex, _, result = job
    params = result["job"]["params"]
    token_logp = jax.jit(ex.token_logp)
    for dtype, config in ((jnp.float32, "fp32"), (jnp.bfloat16, "bf16")):
        batch = _first_batch(ex, result, dtype)
        train = np.asarray(token_logp(ex.cast(params, dtype), batch.seq), np.float64)
        d = train - np.asarray(batch.logp_rollout, np.float64)
        if dtype == jnp.float32:
            assert np.max(np.abs(d)) < 1e-5
        else:
            assert np.mean(np.abs(d)) > 1e-4
        h = result["job"]["results"][config][0]
        np.testing.assert_allclose(h["abs"][0], np.mean(np.abs(d)), rtol=1e-3)
        np.testing.assert_allclose(h["kl"][0], np.mean(np.expm1(d) - d), rtol=1e-2)


@pytest.mark.slow
def test_reward_and_advantages_against_the_text(job):
    """The reward is the share of vowels in the decoded completion; advantages are the
    rewards normalised within each prompt's group."""
    ex, _, result = job
    chars, train = ex.load_corpus()
    batch = _first_batch(ex, result, jnp.float16)
    seq = np.asarray(batch.seq)
    n = ex.PROMPTS * ex.GROUP
    assert seq.shape == (n, ex.PROMPT_LEN + ex.GEN)
    offsets = np.asarray(ex.prompt_offsets(0, result["job"]["steps"], len(train))[0])
    for i, row in enumerate(seq):  # each group starts from its prompt
        start = offsets[i // ex.GROUP]
        np.testing.assert_array_equal(row[: ex.PROMPT_LEN], train[start : start + ex.PROMPT_LEN])
    texts = ["".join(chars[t] for t in row[ex.PROMPT_LEN :]) for row in seq]
    reward = np.array([sum(c in "aeiou" for c in t) / ex.GEN for t in texts])
    np.testing.assert_allclose(batch.reward, reward.mean(), rtol=1e-6)
    grouped = reward.reshape(ex.PROMPTS, ex.GROUP)
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
    params = result["job"]["params"]
    batch = _first_batch(ex, result, jnp.float16)
    _, _, g16, _ = ex.train_step(config, params, ex.make_tx(config).init(params), batch)
    g32 = ex.reference_gradients(params, batch)
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


@pytest.mark.slow
def test_each_jitted_function_compiled_once(job):
    """One trace per configuration's step and per dtype's rollout, one for the probe's
    float32 gradient, one per compared dtype for its count: no step retraced."""
    ex, _, _ = job
    assert ex.train_step._cache_size() == len(ex.CONFIGS)
    assert ex.rollout._cache_size() == len({c.dtype for c in ex.CONFIGS})
    assert ex.reference_gradients._cache_size() == 1
    assert ex.lost_entries._cache_size() == 2  # bfloat16 and float16 gradients
