"""The benchmark behind ``python benchmarks/bench_step.py`` (benchmarks/README.md).

Modules, in the order a run uses them:

- ``workloads``: the models, their parameters, batches and gradients; the cases;
- ``variants``: the steps timed (plain, lossscale_jax's, jmp, Flax, ``optax.apply_if_finite``);
- ``prototypes``: the library's steps with another overflow check or step structure;
- ``harness``: compiling, running and timing a case's variants; refusing one that diverged;
  the allocator children;
- ``hlo``: reading the compiled HLO (the tests assert with the same reader);
- ``breakdowns``: the overflow check alone, and the compile time taken apart;
- ``report``: results.md, the target check, the marked blocks of docs/performance.md;
- ``gpu``: the accelerator's run (``--gpu-results``), the post step's device time among it,
  and results_gpu.json, its table and the docs' block;
- ``profiling``: the steps in a profiler trace, summed per device track and kernel;
- ``deviceless``: the steps compiled for a GPU without one; ``underflow``: what plain's
  float16 backward pass loses;
- ``cli``: the command's flags and the run as a whole (``main``);
- ``_library``: every private name of lossscale_jax the benchmark touches, and only there.
"""
