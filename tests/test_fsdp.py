"""The cached losses under FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2 gloo CPU processes.

Each process holds half of the batch; the model's transformer layers and the model itself are sharded. The loss and
every parameter gradient (FSDP2 averages them over the ranks; read back whole with ``full_tensor``) must equal one
process's on the whole batch (with ``gather_across_devices=False``: the mean of the two halves' gradients), for both
gradient-sync modes, parameters resharded after forward or not, hard negatives, a decoder with left padding, the 2D
loss, an activation budget, and ranks whose own data would run different numbers of mini-batches (token budgets that
cut their texts differently, budgets that keep different mini-batches): those must finish (a collective mismatch would
abort or hang; the process group's timeout is short) and stay exact. The collectives are counted: ``per_step``
reduce-scatters once per FSDP unit and step, ``per_backward`` once per backward; after a ``per_step`` step FSDP2's
own settings are back (later forwards all-gather as after a ``per_backward`` step).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import DIMS, MINI_BATCH_SIZE, ROWS, WORLD_SIZE, child_setup, local_rows, spawn
from tests.helpers import assert_grads_close, loss_and_grads, texts

TOKEN_BUDGET = 24
ALL_DIRECTIONS = dict(
    directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
    hardness_mode="all_negatives",
    hardness_strength=5.0,
)
# name: (model, hard negatives, base loss config, loss options, fully_shard options)
CASES = {
    "per_backward": ("bert", 0, {}, {}, {}),
    "per_step": ("bert", 0, {}, {"fsdp_sync": "per_step"}, {}),
    "no_reshard": ("bert", 0, {}, {}, {"reshard_after_forward": False}),
    "hard_negatives": ("bert", 1, ALL_DIRECTIONS, {}, {}),
    "per_step_hard_negatives": ("bert", 1, ALL_DIRECTIONS, {"fsdp_sync": "per_step"}, {}),
    "gather_off": ("bert", 1, {"gather_across_devices": False}, {}, {}),
    "token_budget": ("bert", 0, {}, {"mini_batch_num_tokens": TOKEN_BUDGET}, {}),
    "budget": ("bert", 1, {}, {"activation_budget": "per rank"}, {}),
    "per_step_budget": ("bert", 1, {}, {"activation_budget": "per rank", "fsdp_sync": "per_step"}, {}),
    "decoder": ("decoder", 1, {}, {}, {}),
    "2d": ("bert", 1, {}, {"layers": True}, {}),
    "lora": ("lora", 1, {}, {}, {}),
    "bf16": ("bert", 1, {}, {}, {"mp_policy": "bf16"}),
    "evaluation": ("bert", 0, {}, {"mini_batch_num_tokens": TOKEN_BUDGET}, {}),  # no gradients: the loss only
}
# Rank 0 keeps every mini-batch, rank 1 almost none: they agree on the mini-batches both kept.
BUDGETS = (10**9, 20_000)


def _columns(negatives: int) -> list[list[str]]:
    """The whole batch, [anchors, positives, negatives...]: rank 0's rows are long and rank 1's short, so that a
    token budget cuts them into different numbers of mini-batches."""
    return [texts(4, 11 + 100 * c, 9, 14) + texts(4, 12 + 100 * c, 1, 3) for c in range(2 + negatives)]


def _model(kind: str):
    from st_cached_losses.testing import tiny_decoder_sentence_transformer, tiny_sentence_transformer

    if kind == "decoder":
        return tiny_decoder_sentence_transformer()
    model = tiny_sentence_transformer()
    if kind == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        torch.manual_seed(1)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False)
        inject_adapter_in_model(config, model.transformers_model)  # any transformers (add_adapter: see README)
    return model


def _loss(model, negatives, config, options, rank=None):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_cached_losses import CachedMatryoshka2dLoss, CachedMatryoshkaLoss

    config = {"gather_across_devices": dist.is_initialized(), **config}
    base = CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH_SIZE, **config)
    options = dict(options)
    if options.pop("layers", False):
        return CachedMatryoshka2dLoss(model, base, DIMS, n_layers_per_step=-1, n_dims_per_step=-1, **options)
    if options.get("activation_budget") == "per rank":
        options["activation_budget"] = BUDGETS[rank or 0]
    return CachedMatryoshkaLoss(model, base, DIMS, **options)


def _shard(model, shard_options):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = dict(shard_options)
    if options.pop("mp_policy", None) == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backbone = model[0].auto_model
    backbone = getattr(backbone, "base_model", backbone)  # under a LoRA adapter: the wrapped model
    for layer in backbone.layers if hasattr(backbone, "layers") else backbone.encoder.layer:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


class _Collectives:
    """Counts FSDP2's all-gathers and reduce-scatters (it calls them through ``torch.distributed``)."""

    def __init__(self) -> None:
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self._originals = {}

    def __enter__(self):
        for name, kind in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter")):
            original = self._originals[name] = getattr(dist, name)

            def counting(*args, _original=original, _kind=kind, **kwargs):
                self.counts[_kind] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _worker(rank, port, out_dir):
    child_setup(rank, port)
    models = {case: _model(kind) for case, (kind, *_) in CASES.items()}  # before the process group (see there)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=30))
    local = local_rows(rank)
    results = {}
    for case, (_kind, negatives, config, options, shard_options) in CASES.items():
        # The loss is built before the model is sharded, as a user's script may: it sees the model change in place.
        loss_fn = _loss(models[case], negatives, config, options, rank)
        model = _shard(models[case], shard_options)
        features = [model.preprocess(column[local]) for column in _columns(negatives)]
        forwards = [0]
        hook = model.register_forward_pre_hook(
            lambda module, args, forwards=forwards: forwards.__setitem__(0, forwards[0] + 1)
        )
        with _Collectives() as collectives, torch.set_grad_enabled(case != "evaluation"):
            out = loss_fn(features, None)
            total = torch.stack(list(out.values())).sum()
            if case != "evaluation":
                total.backward()
        hook.remove()
        loss = total.detach().clone()
        dist.all_reduce(loss)
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
        after = _Collectives()
        if case in (
            "per_step",
            "per_backward",
        ):  # then two forwards (gradients read first): what the restored settings gather
            with torch.no_grad(), after:
                for _ in range(2):
                    model(features[0])
        report = getattr(loss_fn, "activation_report", None)
        results[case] = {
            "loss": float(loss) / WORLD_SIZE,
            "grads": grads,
            "forwards": forwards[0],
            "collectives": collectives.counts,
            "gathers_after": after.counts["all_gather"],
            "units": sum(1 for _ in _fsdp_units(model)),
            "kept": None if report is None else sorted(report.kept),
            "kept_bytes": None if report is None else report.kept_bytes,
            "minibatches": None if report is None else len(report.minibatches),
        }
    torch.save(results, os.path.join(out_dir, f"fsdp_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_units(model):
    from torch.distributed.fsdp import FSDPModule

    return (module for module in model.modules() if isinstance(module, FSDPModule))


# 2 spawned gloo processes: the tests that take these results are marked slow.
@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    spawn(_worker, str(out_dir))
    return [torch.load(out_dir / f"fsdp_rank{rank}.pt") for rank in range(WORLD_SIZE)]


def _reference(case):
    """One process: the whole batch (gather on), or the mean over the two halves (gather off)."""
    kind, negatives, config, options, _ = CASES[case]
    model = _model(kind)
    columns = _columns(negatives)
    halves = [slice(0, ROWS)] if config.get("gather_across_devices", True) else [slice(0, 4), slice(4, 8)]
    losses, grads = [], []
    for rows in halves:
        options = {key: 10**9 if value == "per rank" else value for key, value in options.items()}
        features = [model.preprocess(column[rows]) for column in columns]
        loss, grad = loss_and_grads(model, _loss(model, negatives, config, options), features)  # the loss, too
        losses.append(float(loss))
        grads.append(grad)
    return sum(losses) / len(losses), {name: sum(g[name] for g in grads) / len(grads) for name in grads[0]}


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if case not in ("bf16", "evaluation")])
def test_fsdp2_matches_one_process_on_the_whole_batch(spawned, case):
    loss, grads = _reference(case)
    for rank in range(WORLD_SIZE):
        result = spawned[rank][case]
        assert result["loss"] == pytest.approx(loss, rel=1e-4)
        assert_grads_close(result["grads"], grads)


@pytest.mark.slow
def test_bf16_mixed_precision_is_fp32_within_bf16_rounding(spawned):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the forward and backward in bf16 (8 bits of
    mantissa: ~0.4% per rounding), the same loss and gradients as one fp32 process within a few roundings."""
    loss, grads = _reference("bf16")
    for rank in range(WORLD_SIZE):
        result = spawned[rank]["bf16"]
        assert result["loss"] == pytest.approx(loss, rel=2e-2)
        assert_grads_close(result["grads"], grads, rtol=5e-2)


@pytest.mark.slow
def test_evaluation_with_uneven_token_budgets_finishes_with_the_whole_batch_loss(spawned):
    """Without gradients FSDP2 still all-gathers in every forward: the ranks agree on their mini-batches here too."""
    loss, _ = _reference("evaluation")
    assert spawned[0]["evaluation"]["forwards"] == spawned[1]["evaluation"]["forwards"]
    assert spawned[0]["evaluation"]["loss"] == pytest.approx(loss, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["per_backward", "token_budget", "budget", "decoder"])
def test_every_rank_runs_the_same_forwards(spawned, case):
    assert spawned[0][case]["forwards"] == spawned[1][case]["forwards"]
    assert spawned[0][case]["collectives"] == spawned[1][case]["collectives"]


@pytest.mark.slow
def test_token_budgets_that_cut_the_ranks_differently_still_finish(spawned):
    """Rank 0's long texts need more mini-batches than rank 1's short ones (one process on each half counts them):
    under FSDP2 both ranks run as many as the one that needs most (rank 1 pads with one-row mini-batches)."""
    kind, negatives, config, options, _ = CASES["token_budget"]
    alone = []
    for rows in (slice(0, 4), slice(4, 8)):
        model = _model(kind)
        forwards = [0]
        model.register_forward_pre_hook(
            lambda module, args, forwards=forwards: forwards.__setitem__(0, forwards[0] + 1)
        )
        loss_and_grads(
            model, _loss(model, negatives, config, options), [model.preprocess(c[rows]) for c in _columns(0)]
        )
        alone.append(forwards[0])
    assert alone[0] != alone[1], "the ranks' own data must need different numbers of mini-batches"
    assert spawned[0]["token_budget"]["forwards"] == spawned[1]["token_budget"]["forwards"] >= max(alone)


@pytest.mark.slow
def test_budgets_that_keep_different_mini_batches_agree_on_the_ones_both_kept(spawned):
    for case in ("budget", "per_step_budget"):
        rank0, rank1 = (spawned[rank][case] for rank in range(WORLD_SIZE))
        assert rank0["kept"] == rank1["kept"], "one kept set for both ranks"
        assert 0 < len(rank0["kept"]) < rank0["minibatches"], "rank 1's budget keeps only some"


@pytest.mark.slow
def test_kept_bytes_under_fsdp2_are_the_unsharded_ones(spawned):
    """The budget measures activations, not FSDP2's all-gathered parameters: rank 0's kept bytes (everything kept,
    agreed down to what rank 1 kept) are within 15% of the same mini-batches' bytes without sharding."""
    model = _model("bert")
    loss_fn = _loss(model, 1, {}, {"activation_budget": 10**9})
    features = [model.preprocess(column[0:4]) for column in _columns(1)]
    loss_and_grads(model, loss_fn, features)
    unsharded = loss_fn.activation_report.measured_bytes
    sharded = spawned[0]["budget"]
    expected = sum(unsharded[index] for index in sharded["kept"])
    assert sharded["kept_bytes"] == pytest.approx(expected, rel=0.15)


@pytest.mark.slow
def test_per_step_reduce_scatters_once_per_unit_and_step(spawned):
    for rank in range(WORLD_SIZE):
        once, every = spawned[rank]["per_step"], spawned[rank]["per_backward"]
        assert once["collectives"]["reduce_scatter"] == once["units"]
        assert once["collectives"]["all_gather"] == once["units"]
        # per_backward: one reduce-scatter per unit and backward (2 columns x 2 mini-batches of 4 rows).
        assert every["collectives"]["reduce_scatter"] == every["units"] * 2 * 2
        assert every["collectives"]["all_gather"] > once["collectives"]["all_gather"]


@pytest.mark.slow
def test_per_step_gives_fsdp2_its_own_settings_back(spawned):
    """After a ``per_step`` step (the first, so FSDP2's lazy init ran inside it), two forwards all-gather as after a
    ``per_backward`` one: the root keeps its parameters after forward (FSDP2's rule for it), the layers reshard."""
    for rank in range(WORLD_SIZE):
        after_step, after_backward = (spawned[rank][case]["gathers_after"] for case in ("per_step", "per_backward"))
        assert after_step == after_backward, (after_step, after_backward)


def test_fsdp_sync_is_checked_up_front_and_on_the_card():
    model = _model("bert")
    with pytest.raises(ValueError, match="fsdp_sync must be"):
        _loss(model, 0, {}, {"fsdp_sync": "per_epoch"})
    assert _loss(model, 0, {}, {"fsdp_sync": "per_step"}).get_config_dict()["fsdp_sync"] == "per_step"
    assert "fsdp_sync" not in _loss(model, 0, {}, {}).get_config_dict()
