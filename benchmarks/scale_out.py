"""Scale-out benchmark: GradCache when the model is sharded, on 2 gloo CPU processes.

Every strategy trains ``CachedMatryoshkaLoss(model, CachedMNRL(model, mini_batch_size, gather_across_devices=True),
dims)`` with AdamW on the built-in data (``--batch`` rows per rank and step, different rows on each rank and step), the
model being the packaged all-MiniLM-L6-v2:

    ddp              DistributedDataParallel (one all-reduce per step)
    fsdp2            fully_shard on every transformer layer and the model, fsdp_sync="per_backward" (FSDP's own)
    fsdp2_per_step   the same with fsdp_sync="per_step" (parameters gathered once, one reduce-scatter per step)
    zero1/2/3        deepspeed.initialize with ZeRO stage 1, 2 or 3 (engine.backward / engine.step)
    stock_zero2/3    stock MatryoshkaLoss(CachedMNRL) under ZeRO-2/3: one step; the error each rank raises is recorded

Per strategy and rank: ``seconds_median`` (of --steps timed steps after one warm-up step), the collectives of one more
step by kind (``collectives_<kind>``: the profiler's gloo events) and the bytes this rank contributed to them
(``bytes_<kind>``: the local tensor of each), and ``peak_bytes``: the tensor bytes alive before a step (every tensor the
garbage collector sees: parameters, gradients, optimizer state, as sharded) plus the profiler's exact peak of tensor
bytes allocated during it (activations, the loss stage, gathered parameters and gradients).

    python -m benchmarks.scale_out                                       # -> benchmarks/results/scale_out.*
    python -m benchmarks.scale_out --model tiny --batch 8 --steps 1 --strategies ddp zero3 --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.core.memory import peak_tensor_bytes
from benchmarks.core.report import RESULTS, write_csv
from benchmarks.core.timing import Timer
from st_cached_losses.testing import deepspeed_on_gloo_only, local_rank_setup, rendezvous_store

STRATEGIES = ("ddp", "fsdp2", "fsdp2_per_step", "zero1", "zero2", "zero3", "stock_zero2", "stock_zero3")
WORLD_SIZE = 2
DIMS = (384, 256, 128, 64, 32)
TINY_DIMS = (48, 24)
TIMEOUT = timedelta(minutes=10)


def _model(kind: str):
    from sentence_transformers import SentenceTransformer

    from st_cached_losses.testing import minilm_path, tiny_sentence_transformer

    if kind == "tiny":
        return tiny_sentence_transformer()
    model = SentenceTransformer(minilm_path(), device="cpu")
    model.max_seq_length = 128
    return model


def _batches(args, rank: int) -> list[list[list[str]]]:
    """Per step (warm-up, timed, profiled, memory), this rank's [anchors, positives]."""
    from st_cached_losses.cli.stdlib_data import load_stdlib_dataset

    pairs = load_stdlib_dataset()["train"]
    steps, rows = args.steps + 3, args.batch
    picked = []
    for step in range(steps):
        start = (step * WORLD_SIZE + rank) * rows
        indices = [(start + i) % len(pairs) for i in range(rows)]
        picked.append([[pairs[i]["anchor"] for i in indices], [pairs[i]["positive"] for i in indices]])
    return picked


def _wrap(strategy: str, model, lr: float):
    """(the model the loss embeds with, a step function: loss -> None that back-propagates and updates)."""
    if strategy.startswith(("zero", "stock_zero")):
        import deepspeed

        stage = int(strategy[-1])
        # Buckets of 10M elements (DeepSpeed's default, 500M, would preallocate GBs on this model's scale).
        zero = {"stage": stage, "reduce_bucket_size": 10**7, "allgather_bucket_size": 10**7}
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=10**7, stage3_param_persistence_threshold=0)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
            "zero_optimization": zero,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(loss):
            engine.backward(loss)
            engine.step()

        return engine, step
    if strategy == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model[0].auto_model.encoder.layer:
            fully_shard(layer)
        wrapped = fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return wrapped, step


def _loss(strategy: str, model, args):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss

    from st_cached_losses import CachedMatryoshkaLoss

    dims = list(TINY_DIMS if args.model == "tiny" else DIMS)
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch_size, gather_across_devices=True)
    if strategy.startswith("stock"):
        return MatryoshkaLoss(model, base, dims)
    return CachedMatryoshkaLoss(
        model, base, dims, fsdp_sync="per_step" if strategy == "fsdp2_per_step" else "per_backward"
    )


def _worker(rank: int, port: int, strategy: str, args, out: str) -> None:
    local_rank_setup(rank, WORLD_SIZE, port)
    model = _model(args.model)  # before the process group (transformers' saving writes on rank 0 only after it)
    batches = _batches(args, rank)
    if strategy.startswith(("zero", "stock_zero")):
        import deepspeed

        deepspeed_on_gloo_only()
        deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT)
    wrapped, update = _wrap(strategy, model, args.lr)
    loss_fn = _loss(strategy, model, args)
    loss_fn.model = wrapped  # as SentenceTransformerTrainer.override_model_in_loss does

    def train_step(texts):
        features = [model.preprocess(column) for column in texts]
        out = loss_fn(features, None)
        # The trainer's reduction: a dict of loss components summed, then divided by the accumulation steps.
        update((torch.stack(list(out.values())).sum() if isinstance(out, dict) else out) / 1)

    result = {}
    if strategy.startswith("stock"):
        try:
            train_step(batches[0])
            result["error"] = ""
        except Exception as error:
            result["error"] = _describe(error)
        Path(out, f"{strategy}_rank{rank}.json").write_text(json.dumps(result))
        return  # no barrier: the process group may be broken
    train_step(batches[0])  # warm-up
    seconds, timer = [], Timer()
    for texts in batches[1 : 1 + args.steps]:
        dist.barrier()
        seconds.append(timer.call(lambda texts=texts: train_step(texts))[1])
    result["seconds_median"] = statistics.median(seconds)
    result.update(_collectives(lambda: train_step(batches[-2])))
    gc.collect()
    live = _live_tensor_bytes()
    _, peak = peak_tensor_bytes(lambda: train_step(batches[-1]))
    result.update(peak_bytes=live + peak, live_bytes=live)
    Path(out, f"{strategy}_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _describe(error: Exception) -> str:
    """One line: the exception, its message's first line and where it was raised (file:line in function)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = f"{'/'.join(Path(frame.filename).parts[-3:])}:{frame.lineno} in {frame.name}"
    message = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}{': ' + message if message else ''} ({where})"


def _collectives(fn) -> dict[str, float]:
    """Counts and bytes per kind of the gloo collectives ``fn`` runs (the profiler's ``gloo:<kind>`` events; bytes:
    the local input tensor, fp32)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    counts, nbytes = Counter(), Counter()
    for event in prof.events():
        if event.name.startswith("gloo:"):
            kind = event.name.split(":", 1)[1]
            counts[kind] += 1
            shape = event.input_shapes[0] if event.input_shapes and event.input_shapes[0] else []
            nbytes[kind] += 4 * _numel(shape)
    return {**{f"collectives_{k}": v for k, v in counts.items()}, **{f"bytes_{k}": v for k, v in nbytes.items()}}


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage the garbage collector reaches (a DTensor by its local shard), each once."""
    storages = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        tensor = obj.to_local() if hasattr(obj, "to_local") else obj
        try:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return sum(storages.values())


def run(strategy: str, args, out: Path) -> list[dict]:
    """Both ranks' results for one strategy (a fresh pair of processes)."""
    with rendezvous_store() as port:
        context = mp.start_processes(
            _worker, args=(port, strategy, args, str(out)), nprocs=WORLD_SIZE, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + (min(args.timeout, 300) if strategy.startswith("stock") else args.timeout)
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    break
        except Exception as error:
            print(f"{strategy}: {type(error).__name__}", file=sys.stderr)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
    results = []
    for rank in range(WORLD_SIZE):
        path = out / f"{strategy}_rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"error": "no result: hung or crashed"})
    return results


def rows(strategy: str, batch: int, results: list[dict]) -> list[tuple]:
    """Long-format rows: per rank, every metric (``..._rank<r>``); stock's failure as ``failed`` = 1 or 0."""
    out = []
    for rank, result in enumerate(results):
        if "error" in result:
            out.append((strategy, batch, f"failed_rank{rank}", float(bool(result["error"]))))
            continue
        out += [(strategy, batch, f"{metric}_rank{rank}", value) for metric, value in result.items()]
    return out


def plot(records: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value = {(c, m): v for c, _, m, v in records}
    names = [s for s in STRATEGIES if (s, "seconds_median_rank0") in value]
    panels = (
        ("seconds_median", "step seconds", 1),
        ("peak_bytes", "peak tensor MiB per rank", 2**20),
        ("collectives", "collectives per step", 1),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for ax, (metric, label, divisor) in zip(axes, panels):
        if metric == "collectives":
            heights = [
                sum(
                    v
                    for (c, m), v in value.items()
                    if c == name and m.startswith("collectives_") and m.endswith("_rank0")
                )
                for name in names
            ]
        else:
            heights = [value[(name, f"{metric}_rank0")] / divisor for name in names]
        ax.bar(names, heights, color="tab:blue")
        ax.set(ylabel=label)
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("GradCache on 2 gloo CPU processes (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(records: list[tuple], errors: dict[str, list[str]]) -> str:
    value = {(c, m): v for c, _, m, v in records}
    kinds = sorted({m.split("_", 1)[1].rsplit("_rank", 1)[0] for _, _, m, _ in records if m.startswith("collectives_")})
    header = ["strategy", "step s", *[f"{k} (count / KiB)" for k in kinds], "peak MiB rank 0 / 1"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in STRATEGIES:
        if (name, "seconds_median_rank0") not in value:
            continue
        cells = [name, f"{value[(name, 'seconds_median_rank0')]:.2f}"]
        for kind in kinds:
            count = value.get((name, f"collectives_{kind}_rank0"), 0)
            cells.append(f"{count:.0f} / {value.get((name, f'bytes_{kind}_rank0'), 0) / 1024:.0f}")
        cells.append(" / ".join(f"{value[(name, f'peak_bytes_rank{r}')] / 2**20:.0f}" for r in range(WORLD_SIZE)))
        lines.append("| " + " | ".join(cells) + " |")
    for name, messages in errors.items():
        lines.append(f"\n{name}: " + "; ".join(f"rank {r}: {m or 'no error'}" for r, m in enumerate(messages)))
    return "\n".join(lines)


def main(argv=None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--model", choices=("minilm", "tiny"), default="minilm")
    parser.add_argument("--batch", type=int, default=128, help="rows per rank and step")
    parser.add_argument("--mini-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per strategy before its ranks are killed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="scale_out")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.out / f".{args.name}_runs"
    scratch.mkdir(exist_ok=True)
    records, errors = [], {}
    for strategy in args.strategies:
        print(f"== {strategy}", flush=True)
        results = run(strategy, args, scratch)
        if strategy.startswith("stock"):
            errors[strategy] = [result.get("error", "") for result in results]
        records += rows(strategy, args.batch, results)
    write_csv(records, args.out / f"{args.name}.csv")
    (args.out / f"{args.name}_errors.json").write_text(json.dumps(errors, indent=1) + "\n")
    plot(records, args.out / f"{args.name}.png")
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()
    print(summary(records, errors))
    return records


if __name__ == "__main__":
    main()
