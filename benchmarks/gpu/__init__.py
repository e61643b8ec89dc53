"""One prepared command for a CUDA machine, and the compile report that needs none.

    python -m benchmarks.gpu --model .gpu/minilm          # one H100, offline, about 8 minutes: results/gpu/
    python -m benchmarks.gpu --quick --model .gpu/minilm  # fewer sizes: about 4 minutes
    python -m benchmarks.gpu --steps loss_stage train_step --model .gpu/minilm   # some steps, in the usual order
    python -m benchmarks.gpu --dry-run --out /tmp/gpu     # any machine: every step at tiny sizes on the CPU, the
                                                          # chunked backend standing in for Triton (run in CI)
    python -m benchmarks.gpu --compile-report --out DIR   # a CPU: every registered Triton kernel compiled for sm_90
                                                          # -> DIR/compile_report.csv (registers, spills, smem, the
                                                          # hot loop's instructions, occupancy, launches per call)

Step 0, ``precompile`` (``gpu/precompile.py``; ``--no-precompile`` skips it), records on meta tensors every Triton
launch the chosen steps will make and compiles them, one process per CPU, into Triton's cache before the first one,
with the package's public warm-up (``st_cached_losses.warmup``; the first GPU run spent 291 s compiling one kernel at
a time on first launch). Then the steps, in order
(``--steps`` picks some); each writes long-format CSV + PNG under --out, ``summary.md`` gets every
table and the issues' targets (met, missed, not measured), and a short table (each step's seconds and headline) is
printed last:

1. ``correctness`` (``gpu/correctness.py``, ``correctness.csv``): the Triton and chunked backends against a float64
   truth on ``tests/cuda/cuda_checks.py``'s cases (those of ``python -m pytest -m cuda``), then ``maxsim_infonce``'s
   Triton and chunked backends on its MaxSim cases; short by default (three dense and two MaxSim cases in fp32, bf16
   and under bf16 autocast), ``--correctness full`` for every case, precision and forced block size.
2. ``loss_stage`` (``gpu/loss_stage.py``, ``loss_stage.csv``): ``matryoshka_infonce`` (auto, triton, chunked) against
   stock ``MatryoshkaLoss(CachedMNRL)``'s ``calculate_loss``, D = 768, dims 768..64, bf16 inputs, fp32 under TF32 and
   IEEE fp32, B in {4096, 16384, 65536} within a 120 s share, then the largest B.
3. ``multivector`` (``gpu/multivector.py``, ``multivector_loss_stage.csv``): ``maxsim_infonce`` (Triton and chunked
   backends, one dim and four) against stock's, late-interaction-kernels and flash-maxsim where installed, and the
   GEMM floor, within a 60 s share.
4. ``train_step`` (``gpu/train_steps.py`` -> ``benchmarks.train_step``, ``train_step.csv``): ours (its loss stage
   on ``--backend``, default the Triton backend), stock
   MatryoshkaLoss(CachedMNRL), stock CachedMNRL; MiniLM under bf16 autocast, dims 384..32, mini-batch 256, B in
   {1024, 8192}, by the device method (one process, a model copy per contender, two warm-up steps on the timed batch,
   five interleaved rounds, CUDA events per phase).
5. ``multivector_train_step`` (``benchmarks.multivector_train_step``, ``multivector_train_step.csv``): the same for
   the MultiVectorEncoder, ours against stock's cached multi-vector loss, B in {512, 4096}.

Device time (one H100, estimated from the first run's figures, benchmarks/results/gpu/summary.md): step 0 about
10 s of recording (on the CPU) overlapped with 16 processes compiling, correctness about 60 s, loss stage 120 s plus
the largest-B search's 30 s, multi-vector loss stage 60 s, training steps about 90 s dense and 90 s multi-vector:
about 8 minutes. Every row names the device, the torch / triton /
sentence-transformers versions and the date.

The machine may have no network: ``--model PATH`` takes a local copy of the model (an fp16 copy is cast to fp32;
bf16 is autocast's job, as in the trainer).
"""
