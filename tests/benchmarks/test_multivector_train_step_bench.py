"""Smoke run of the multi-vector training-step benchmark at tiny sizes: it runs (timing in one process, memory in
fresh ones), and what it writes is well-formed."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks import multivector_train_step
from benchmarks.core.phases import PHASES
from benchmarks.core.report import FIELDS
from benchmarks.train_step_report import summary_table

PAIRS = [
    (f"return the {w} of the {v} list", f"def {w}_{v}(items, key=None): return {w}(items[{v!r}])")
    for w in ("sum", "max", "min")
    for v in ("first", "second", "last")
]


@pytest.mark.slow  # a fresh process per contender
def test_multivector_train_step_smoke(tmp_path):
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps(PAIRS))
    out = tmp_path / "results"
    tiny = ["--model", "tiny", "--dims", "32", "16", "--max-seq-length", "24", "--mini-batch-size", "4"]
    records = multivector_train_step.main(
        ["--sizes", "12", *tiny, "--repeats", "2", "--data", str(pairs), "--out", str(out)]
    )

    with (out / "multivector_train_step.csv").open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == FIELDS and all(len(row) == len(FIELDS) for row in rows)
    value = {(r["contender"], r["B"], r["metric"]): r["value"] for r in records}
    for name in multivector_train_step.CONTENDERS:
        assert value[(name, 12, "repeats")] == 2
        step = value[(name, 12, "seconds_median")]
        assert value[(name, 12, "seconds_min")] <= step <= value[(name, 12, "seconds_max")]
        assert all(value[(name, 12, f"seconds_{p}_min")] >= 0 for p in PHASES)
        assert value[(name, 12, "peak_bytes")] > 0
        assert value[(name, 12, "rss_peak_bytes")] >= value[(name, 12, "rss_base_bytes")] > 0
        assert value[(name, 12, "time_ratio_to_stock_min")] > 0
    assert value[("stock", 12, "time_ratio_to_stock_median")] == 1.0
    assert value[("inputs", 12, "unique_pairs")] == len(PAIRS)  # 12 > 9 pairs: cycled
    assert value[("inputs", 12, "load_average_1min_start")] >= 0
    # The default 8 GiB budget keeps every mini-batch of these; only ours_kept has one.
    assert value[("ours_kept", 12, "kept_share")] == value[("ours_kept", 12, "kept_token_share")] == 1.0
    assert ("ours", 12, "kept_share") not in value

    for png in ("multivector_train_step.png", "multivector_train_step_phases.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = summary_table(records)
    assert "| 12 | ours_one_dim |" in table and "| 12 | ours_kept (kept 100% of mini-batches) |" in table


def test_loss_contenders_are_the_documented_losses():
    """ours / ours_one_dim / ours_kept: the Matryoshka loss at all dims / the full dim / with the budget; stock: the
    base loss itself."""
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    from benchmarks.core import contenders
    from benchmarks.core.data import build_model
    from st_cached_losses import CachedMultiVectorMatryoshkaLoss

    model = build_model("tiny", 16, multi_vector=True)
    build = lambda name: contenders.build("multivector_train_step", name, model, [32, 16], 4, 2**20)  # noqa: E731
    assert type(build("stock")) is CachedMultiVectorMultipleNegativesRankingLoss
    ours, one, kept = build("ours"), build("ours_one_dim"), build("ours_kept")
    assert all(isinstance(loss, CachedMultiVectorMatryoshkaLoss) for loss in (ours, one, kept))
    assert (ours.matryoshka_dims, one.matryoshka_dims, kept.matryoshka_dims) == ((32, 16), (32,), (32, 16))
    assert (ours.activation_budget, kept.activation_budget) == (None, 2**20)
    assert ours.mini_batch_size == kept.mini_batch_size == 4
    with pytest.raises(ValueError, match="contender must be one of"):
        build("mnrl")
