#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with one CUDA GPU (README.md, "On a GPU"):
#
#   1. the GPU benchmark: lm_185m, full and post step, both modes, 3 rounds; plain,
#      plain_scaled (a constant loss scale, nothing else), ours, the peers and a bare
#      jnp.where skip; then each step's device time per step, each variant's steps in a
#      profiler trace, kernel by kernel                              -> results_gpu.json, .md,
#                                                                       kernels.json,
#                                                                       profile.tar.gz
#   2. the skip's two formulations on the post step, the select per leaf the GPU takes
#      against a lax.cond, timed and by device time                  -> select.json
#      (the optimized HLO of every step parts 1 and 2 compile)       -> hlo.tar.gz
#   3. what plain's float16 backward pass loses to underflow (--underflow), for the whole
#      step's ~4%                                                     -> tests.log
#   4. the RL job at its GPU size (examples/train_rl.py --size gpu: 85M parameters, each
#      path on the GPU's own kernels)                                 -> rl_results_gpu.json
#
# Usage: benchmarks/gpu_check.sh OUTDIR [SECONDS]
# Eight files land in OUTDIR (tests.log: the machine, each part's output). SECONDS (default
# 480) bounds the whole run: each part gets what the earlier ones left, less the time kept
# for the RL job (RL_SECONDS, default 180), which comes last and gets the rest; a part cut
# short still leaves what it wrote. Parts 1 and 2 share a compilation cache. The test suite
# is not part of it: `make test-gpu` runs it, in a call of its own. GPU_CHECK_QUICK=1
# rehearses the whole on CPU (lm_tiny, two rounds, the RL job's GPU code at its small size;
# default SECONDS 900 and RL_SECONDS 300: a CPU compiles the RL job's twelve programs slowly).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [SECONDS]}
quick=${GPU_CHECK_QUICK:-0}
budget=${2:-$( ((quick)) && echo 900 || echo 480)}
rl_seconds=${RL_SECONDS:-$( ((quick)) && echo 300 || echo 180)}
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=$(mktemp -d)
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
# Seconds for a part before the RL job: what is left, less the RL job's share (at least 10).
part() { local s=$(($(left) - rl_seconds)); echo $((s > 10 ? s : 10)); }
# pack NAME FOLDER PATTERN...: the files of $work/FOLDER named any PATTERN into $out/NAME
# (tar.gz).
pack() {
    local name=$1 folder=$2 expr=()
    shift 2
    for p in "$@"; do expr+=(${expr[@]:+-o} -name "$p"); done
    (cd "$work" && find "$folder" \( "${expr[@]}" \) -print0 2>/dev/null |
        tar -czf "$out/$name" --null -T -)
}
# The checkout itself is imported (no install needed). jmp is optional: the benchmark skips
# it, saying so.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=$work/cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${GPU_CHECK_COMMIT:-unrecorded}")

if ((quick)); then
    model=lm_tiny
    bench_size=(--rounds 2 --iters 1 --steps 2)
    device_steps=2
    rl=(--size gpu_tiny --quick --seeds 1 --steps 2)
    rl_file=rl_results_gpu_tiny.json
else
    model=lm_185m
    bench_size=(--rounds 3)
    device_steps=20
    rl=(--size gpu)
    rl_file=rl_results_gpu.json
fi
full="$model/in_out/fp16grad/full"
post="$model/in_out/fp16grad/post"

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    python -c 'import jax, optax; print("jax", jax.__version__, "optax", optax.__version__,
        jax.devices())'
    echo "lossscale_jax at $commit"
} > "$out/tests.log" 2>&1

echo "== 1. the GPU benchmark, each step's device time ($(part) s of $(left) s)" |
    tee -a "$out/tests.log"
XLA_FLAGS="--xla_dump_to=$work/hlo" timeout -k 5 "$(part)" python benchmarks/bench_step.py \
    --gpu-results "$out/results_gpu.json" --cases "$full" "$post" "${bench_size[@]}" \
    --device-steps "$device_steps" --profile "$work/profile" \
    --label "benchmarks/gpu_check.sh part 1, lossscale_jax at $commit" \
    2>&1 | tail -n 70 >> "$out/tests.log"
[[ -f $work/profile/kernels.json ]] && cp "$work/profile/kernels.json" "$out/kernels.json"
pack profile.tar.gz profile 'perfetto_trace.json.gz'

echo "== 2. a select against lax.cond, the post step ($(part) s of $(left) s)" |
    tee -a "$out/tests.log"
XLA_FLAGS="--xla_dump_to=$work/hlo" timeout -k 5 "$(part)" python benchmarks/bench_step.py \
    --gpu-results "$work/select/select.json" --cases "$post" "${bench_size[@]}" \
    --device-steps "$device_steps" --modes throughput \
    --variants plain lsj_optax lsj_optax_cond lsj_fused lsj_fused_cond \
    --label "benchmarks/gpu_check.sh part 2, lossscale_jax at $commit" \
    2>&1 | tail -n 30 >> "$out/tests.log"
[[ -f $work/select/select.json ]] && cp "$work/select/select.json" "$out/select.json"
# The optimized modules of the steps only (jit_full, jit_post; the module ids ascend in the
# order the variants compiled, as parts 1 and 2 list them).
pack hlo.tar.gz hlo '*jit_full*after_optimizations.txt' '*jit_post*after_optimizations.txt'

echo "== 3. underflow in plain's backward pass ($(part) s of $(left) s)" |
    tee -a "$out/tests.log"
timeout -k 5 "$(part)" python benchmarks/bench_step.py --underflow --cases "$full" \
    --out "$work/underflow" 2>&1 | tail -n 5 >> "$out/tests.log"

echo "== 4. the RL job, ${rl[*]} ($(left) s left)" | tee -a "$out/tests.log"
timeout -k 5 "$(left)" python examples/train_rl.py "${rl[@]}" --no-progress --out "$work/rl" \
    2>&1 | tail -n 30 >> "$out/tests.log"
echo "RL job exit status: ${PIPESTATUS[0]} (124: cut at the budget)" >> "$out/tests.log"
[[ -f $work/rl/$rl_file ]] && cp "$work/rl/$rl_file" "$out/rl_results_gpu.json"

rm -rf "$work"
echo "done in $((SECONDS - start)) s; wrote: $(ls "$out" | tr '\n' ' ')" | tee -a "$out/tests.log"
