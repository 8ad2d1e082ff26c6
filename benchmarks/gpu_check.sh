#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with one CUDA GPU (README.md, "On a GPU"):
#
#   1. the GPU benchmark (lm_185m, full and post step, both modes)  -> results_gpu.json, .md
#   2. the full step of plain, plain_scaled (a constant loss scale, nothing else), ours and
#      the peers, kernel by kernel                                   -> kernels.json,
#                                                                       profile.tar.gz
#   3. the skip's two formulations, the select per leaf the GPU takes against a lax.cond,
#      and plain_scaled against plain, with the optimized HLO of every step kept for reading
#      afterwards                                                    -> select.json, .md,
#                                                                       hlo.tar.gz
#   4. what plain's float16 backward pass loses to underflow (--underflow), for the whole
#      step's ~4%                                                     -> tests.log
#   5. the test suite on the GPU (make test-gpu)                     -> tests.log
#
# Usage: benchmarks/gpu_check.sh OUTDIR [SECONDS]
# Eight files land in OUTDIR; SECONDS (default 540) bounds the whole run: each part gets what
# the earlier ones left (the suite last, as it matters least for the measurements), and a
# part cut short still leaves what it wrote. GPU_CHECK_QUICK=1 rehearses it on CPU in a
# minute (lm_tiny, two rounds, one test module).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [SECONDS]}
budget=${2:-540}
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=$(mktemp -d)
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
# pack FOLDER PATTERN NAME: the files of $work/FOLDER named PATTERN into $out/NAME (tar.gz).
pack() { (cd "$work" && find "$1" -name "$2" -print0 2>/dev/null |
    tar -czf "$out/$3" --null -T -); }
# The checkout itself is imported (no install needed). The suite imports jmp (pure Python:
# `pip install jmp==0.0.4`, or its wheel put on PYTHONPATH); the benchmark skips it, saying so.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

if [[ ${GPU_CHECK_QUICK:-0} == 1 ]]; then
    model=lm_tiny
    bench_size=(--rounds 2 --iters 1 --steps 2)
    profile_steps=2
    tests=(env JAX_PLATFORMS=cpu python -m pytest -q -p no:benchmark tests/test_division.py)
else
    model=lm_185m
    bench_size=()
    profile_steps=10
    tests=(make test-gpu PYTHON=python GPU_TEST_WORKERS=4)
fi
cases=("$model/in_out/fp16grad/full" "$model/in_out/fp16grad/post")

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    python -c 'import jax, optax; print("jax", jax.__version__, "optax", optax.__version__,
        jax.devices())'
} > "$out/tests.log" 2>&1

echo "== 1. the GPU benchmark ($(left) s left)" | tee -a "$out/tests.log"
timeout "$(left)" python benchmarks/bench_step.py --gpu-results "$out/results_gpu.json" \
    --cases "${cases[@]}" "${bench_size[@]}" 2>&1 | tail -n 40 >> "$out/tests.log"

echo "== 2. kernel by kernel ($(left) s left)" | tee -a "$out/tests.log"
timeout "$(left)" python benchmarks/bench_step.py --profile "$work/profile" \
    --cases "${cases[0]}" --steps "${profile_steps}" 2>&1 | tail -n 20 >> "$out/tests.log"
[[ -f $work/profile/kernels.json ]] && cp "$work/profile/kernels.json" "$out/kernels.json"
pack profile 'perfetto_trace.json.gz' profile.tar.gz

echo "== 3. a select against lax.cond, plain_scaled, HLO kept ($(left) s left)" | tee -a "$out/tests.log"
XLA_FLAGS="--xla_dump_to=$work/hlo" timeout "$(left)" python benchmarks/bench_step.py \
    --cases "${cases[@]}" --out "$work/select" "${bench_size[@]}" \
    --allocators default --modes throughput \
    --variants plain plain_scaled lsj_optax_ieee lsj_optax_cond_ieee lsj_fused_ieee \
    lsj_fused_cond_ieee \
    2>&1 | tail -n 40 >> "$out/tests.log"
for ext in json md; do
    [[ -f $work/select/results.$ext ]] && cp "$work/select/results.$ext" "$out/select.$ext"
done
# The optimized modules only (the steps, their names as the benchmark jits them).
pack hlo '*after_optimizations.txt' hlo.tar.gz

echo "== 4. underflow in plain's backward pass ($(left) s left)" | tee -a "$out/tests.log"
timeout "$(left)" python benchmarks/bench_step.py --underflow --cases "${cases[0]}" \
    --out "$work/underflow" 2>&1 | tail -n 5 >> "$out/tests.log"

echo "== 5. the test suite ($(left) s left)" | tee -a "$out/tests.log"
if (($(left) > 30)); then
    timeout "$(left)" "${tests[@]}" 2>&1 | tail -n 150 >> "$out/tests.log"
    echo "suite exit status: ${PIPESTATUS[0]} (124: cut at the budget)" >> "$out/tests.log"
else
    echo "no time left for the suite" >> "$out/tests.log"
fi
rm -rf "$work"
echo "done in $((SECONDS - start)) s; wrote: $(ls "$out" | tr '\n' ' ')" | tee -a "$out/tests.log"
