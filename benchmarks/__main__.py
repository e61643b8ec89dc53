"""Regenerate the benchmark results (CSV + PNG under benchmarks/results/).

python -m benchmarks                          # everything committed: train_step (default, GISTEmbed, 2D), then
                                              # loss_stage (1 and 2 threads, GISTEmbed, mask_duplicates,
                                              # in-batch negatives on and off),
                                              # compile_step, integrations, scale_out, memory_bank,
                                              # multivector_loss_stage (and in-batch negatives on and off),
                                              # multivector_train_step, loss_precision (op loss ndcg),
                                              # sparse_loss_stage, sparse_train_step
python -m benchmarks train_step [FLAGS...]    # one benchmark, with its own flags (see --help)
python -m benchmarks loss_stage [FLAGS...]
python -m benchmarks compile_step [FLAGS...]  # torch.compile against eager (inductor: C++ compiles, minutes)
python -m benchmarks integrations             # LoRA, image-text, gradient checkpointing: errors against stock
python -m benchmarks scale_out [FLAGS...]     # DDP, FSDP2, DeepSpeed ZeRO on 2 gloo processes
python -m benchmarks memory_bank PARTS...      # the memory bank: loss stage, a training step, NDCG@10 (slow)
python -m benchmarks multivector_loss_stage [FLAGS...]   # late interaction: maxsim_infonce against stock's
python -m benchmarks multivector_train_step [FLAGS...]   # late interaction: a MultiVectorEncoder's training step
python -m benchmarks loss_precision PARTS...  # what precision="bf16" costs against IEEE fp32 (op, loss, ndcg: slow)
python -m benchmarks sparse_loss_stage [FLAGS...]   # SPLADE: sparse_infonce against stock CachedSpladeLoss's step 2
python -m benchmarks sparse_train_step [FLAGS...]   # SPLADE: a whole step's peak and time against stock
"""

from __future__ import annotations

import sys

from benchmarks import (
    compile_step,
    integrations,
    loss_precision,
    loss_stage,
    memory_bank,
    multivector_loss_stage,
    multivector_train_step,
    scale_out,
    sparse_loss_stage,
    sparse_train_step,
    train_step,
)

BENCHMARKS = {
    "train_step": train_step.main,
    "loss_stage": loss_stage.main,
    "compile_step": compile_step.main,
    "integrations": integrations.main,
    "scale_out": scale_out.main,
    "memory_bank": memory_bank.main,
    "multivector_loss_stage": multivector_loss_stage.main,
    "multivector_train_step": multivector_train_step.main,
    "loss_precision": loss_precision.main,
    "sparse_loss_stage": sparse_loss_stage.main,
    "sparse_train_step": sparse_train_step.main,
}
# What `python -m benchmarks` runs: the committed results, each under its own file name.
EVERYTHING = (
    ("train_step", []),
    (
        "train_step",
        ["--sizes", "512", "--contenders", "ours_gist", "stock_gist", "--repeats", "2", "--name", "train_step_gist"],
    ),
    (
        "train_step",
        [
            "--sizes",
            "128",
            "1024",
            "--dims",
            "384",
            "192",
            "96",
            "48",
            "--contenders",
            "ours",
            "ours_2d",
            "stock_2d",
            "--baseline",
            "ours",
            "--repeats",
            "1",
            "--name",
            "train_step_2d",
        ],
    ),
    ("loss_stage", ["--threads", "1"]),
    ("loss_stage", ["--threads", "2", "--name", "loss_stage_2threads"]),
    (
        "loss_stage",
        ["--gist", "--sizes", "256", "512", "1024", "8192", "--stock-max-batch", "1024", "--name", "loss_stage_gist"],
    ),
    ("compile_step", []),
    ("integrations", []),
    ("loss_stage", ["--mask-duplicates", "--sizes", "8192", "--threads", "1", "--name", "loss_stage_mask_duplicates"]),
    ("loss_stage", ["--in-batch-negatives", "--sizes", "1024", "8192", "--name", "loss_stage_in_batch_negatives"]),
    ("scale_out", []),
    ("memory_bank", ["loss-stage", "step", "ndcg"]),
    ("multivector_loss_stage", ["--sizes", "256", "512", "1024", "--stock-budget", "120"]),
    (
        "multivector_loss_stage",
        ["--in-batch-negatives", "--sizes", "256", "512", "1024", "8192", "--negatives", "3", "--doc-tokens", "128"],
    ),
    ("multivector_train_step", ["--contenders", "ours", "ours_kept", "stock", "--repeats", "2"]),
    ("loss_precision", ["op", "loss", "ndcg"]),
    ("sparse_loss_stage", []),
    ("sparse_train_step", []),
)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv and argv[0] in BENCHMARKS:
        BENCHMARKS[argv[0]](argv[1:])
        return
    if argv:
        raise SystemExit(f"usage: python -m benchmarks [{' | '.join(BENCHMARKS)} [FLAGS...]], got {argv[0]!r}")
    for name, flags in EVERYTHING:
        print(f"== {name} {' '.join(flags)}", flush=True)
        BENCHMARKS[name](flags)


if __name__ == "__main__":
    main()
