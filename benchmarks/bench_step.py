"""Cost of loss scaling per training step, against the plain step a user runs and the JAX peers.

One command regenerates ``benchmarks/results.md`` and ``results.json``::

  python benchmarks/bench_step.py

It runs every case once per allocator, each allocator in a child process of its own
(the environment is set before Python starts): the default glibc malloc, glibc tuned to
keep freed memory (``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2**30``)
and, where the library is installed (Debian ``libtcmalloc-minimal4``), tcmalloc
through ``LD_PRELOAD``. In a child, every variant of a case is compiled, then all run
interleaved over several rounds (the order rotates each round), so machine noise hits
them alike. Reported per variant: the median over rounds of the round's ratio to the plain
step (and its range), median ms, minor page faults per step, compile time (CPU seconds of
trace + lower + compile, measured in the first child only: the others read a shared
compilation cache), temporaries (``memory_analysis()``), and from the compiled HLO the
conditionals, parameter-sized copies and selects, kernels (fusions) and an estimate of the
bytes a good step moves. A variant whose loss went non-finite over the timed steps, whose
parameters or optimizer state hold a non-finite value, or whose loss scale moved (or that
skipped a step) is refused: it gets no timing. The run ends with a target-by-target check.

This file is the entry point; the code is the package ``bench/`` next to it (its
``__init__.py`` lists the modules).

Variants:
  plain            what a user runs without loss scaling: gradients cast to the parameter
                   dtype, then optax.adam and apply_updates
  lsj_optax_*      lossscale_jax.loss_scaling: tx.update + optax.apply_updates
  lsj_fused_*      lossscale_jax.apply_gradients (update applied inside the conditional)
  jmp              jmp.DynamicLossScale + jmp.all_finite + jmp.select_tree
  flax             flax DynamicScale.value_and_grad + the documented jnp.where skip
  optax_if_finite  optax.apply_if_finite(adam) with a static scale
  proto_*          (not in the default run) the lossscale_jax steps with another overflow
                   check or step structure, to choose formulations: see bench/prototypes.py
  lsj_*_headroom_ieee  (not in the default run) the lossscale_jax steps with HeadroomScale
                   held at the benchmark's scale (the whole rule runs, the scale stays put)

Workloads, layouts, gradient patterns, steps:
  mlp_20m   4 dense layers, 18.9M params, 8 leaves;  deep_300: 150 residual layers of
            width 140, 2.96M params, 300 leaves;  mlp_1m / tiny / tiny_deep: smaller
  in_out    kernels stored [in, out] and applied as ``h @ kernel`` (Flax ``nn.Dense``)
  out_in    kernels stored [out, in] and applied as ``h @ kernel.T`` (torch.nn.Linear)
  fp16grad  gradients taken w.r.t. the float16 copy of float32 master weights
  fp32grad  gradients taken w.r.t. the float32 params, cast inside the loss (what Flax's
            ``dtype=float16, param_dtype=float32`` modules give)
  lm_185m   a decoder-only transformer (d 1024, 12 layers, 16 heads, vocabulary 32768,
            sequence 1024, batch 8: 185.6M params); lm_tiny: the same code, small
  full      forward + backward + scaler + Adam + apply;  post: scaler + Adam + apply on
            precomputed (scaled) gradients

Usage::

  python benchmarks/bench_step.py                        # the full run (see README.md)
  python benchmarks/bench_step.py --quick --out /tmp/b   # smoke run, in-process (a minute)
  python benchmarks/bench_step.py --cases mlp_20m/in_out/fp16grad/post \\
      --variants plain lsj_fused_ieee proto_fused_mask --allocators glibc_tuned
  python benchmarks/bench_step.py --check-report         # overflow-check formulations alone
  python benchmarks/bench_step.py --gpu-results benchmarks/results_gpu.json  # on a GPU

Modes (``--modes``): latency (each step blocked on; the CPU default) and throughput (steps
dispatched back to back, one block at the end); both by default on an accelerator.
"""

from bench.cli import main  # bench/ sits next to this file, which Python puts on sys.path

if __name__ == "__main__":
    main()
