"""``python -m benchmarks.gpu --dry-run``: the GPU command's every step at tiny sizes on the CPU, with the chunked
backend standing in for Triton, so that its code (and the CUDA suite's cases) cannot rot unseen in CI."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from benchmarks.gpu import run
from tests.cuda import cuda_checks, maxsim_cuda_checks


# The whole dry run, minutes on a CPU: the tests that take it are marked slow.
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return run.main(["--dry-run", "--correctness", "full", "--out", str(out)]), out


@pytest.mark.slow
def test_dry_run_writes_every_result(dry_run):
    code, out = dry_run
    assert code == 0
    for name in ("correctness", "loss_stage", "multivector_loss_stage", "train_step", "multivector_train_step"):
        assert (out / f"{name}.csv").stat().st_size > 0
    pngs = ("loss_stage_bf16", "loss_stage_tf32", "loss_stage_fp32")
    pngs += ("multivector_loss_stage_bf16", "multivector_loss_stage_fp32")
    steps = ("train_step", "train_step_phases", "multivector_train_step", "multivector_train_step_phases")
    for name in ("correctness", *pngs, *steps):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    sections = ("**Correctness**", "**Loss stage**", "**Multi-vector loss stage**", "**Training step**", "**Targets**")
    sections += ("**Multi-vector training step**",)
    for section in (*sections, "Largest loss-stage B"):
        assert section in summary


@pytest.mark.slow
def test_dry_run_checks_every_case_backend_and_block_size(dry_run):
    _, out = dry_run
    with (out / "correctness.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    runs = {(r["case"], r["backend"]) for r in rows}
    for case in cuda_checks.cases("tiny"):
        assert {(case.name, "triton"), (case.name, "chunked")} <= runs
    for count in cuda_checks.BLOCK_ROWS["tiny"]:
        assert (f"block_rows {count}", "triton") in runs
    for case in maxsim_cuda_checks.maxsim_cases("tiny"):
        assert {(case.name, "triton"), (case.name, "chunked")} <= runs
    assert {r["quantity"] for r in rows} >= {"loss", "per_dim", "d_queries", "d_docs", "d_world_queries"}
    assert all(r["passed"] == "True" for r in rows)


@pytest.mark.slow
def test_dry_run_measures_every_contender(dry_run):
    from benchmarks.core.report import read_csv

    _, out = dry_run
    stage = {(r["contender"], r["metric"]) for r in read_csv(out / "loss_stage.csv")}
    for name in ("auto", "triton", "chunked", "stock"):
        for dtype in ("bf16", "tf32", "fp32"):
            assert {(f"{name}_{dtype}", "seconds_median"), (f"{name}_{dtype}", "peak_bytes")} <= stage
    # what "auto" resolved to on the CPU: the chunked backend, IEEE fp32 (the precision policy is CUDA's)
    assert {("auto_bf16", "loss_backend_chunked"), ("auto_tf32", "loss_precision_ieee")} <= stage
    multivector = {(r["contender"], r["metric"]): r["value"] for r in read_csv(out / "multivector_loss_stage.csv")}
    for shape in ("Ld16_pairs", "Ld32_pairs"):
        for dtype in ("bf16", "fp32"):
            for name in ("matmul", "triton", "triton4dims", "chunked", "chunked4dims", "stock"):
                assert {
                    (f"{name}_{dtype}", f"{shape}/{m}") for m in ("seconds_median", "peak_bytes")
                } <= multivector.keys()
            for name in ("triton", "triton4dims", "chunked", "chunked4dims", "stock"):  # the reference's loss (stock's)
                assert multivector[(f"{name}_{dtype}", f"{shape}/loss_ok")] == 1
    summary = (out / "summary.md").read_text()
    for name in ("lik", "flash_maxsim"):  # not installed, or their backward kernels need CUDA: skipped, and said so
        assert f"not run: {name}: " in summary
    # The training steps by the device method (perf_counter standing in for CUDA events): every contender's rounds,
    # phases, spread, tensor peak and resolved loss-stage backend (ours: the op's chunked; stock: its own code).
    for csv_name, names in (
        ("train_step", ("ours", "stock", "stock_cmnrl")),
        ("multivector_train_step", ("ours", "stock")),
    ):
        steps = {(r["contender"], r["B"], r["metric"]): r["value"] for r in read_csv(out / f"{csv_name}.csv")}
        for batch in {b for (_, b, _) in steps}:
            assert steps[("inputs", batch, "device_warmup_steps")] == 2
            for name in names:
                assert steps[(name, batch, "repeats")] == 2
                assert steps[(name, batch, "seconds_min")] <= steps[(name, batch, "seconds_median")]
                assert steps[(name, batch, "seconds_loss_median")] > 0 and steps[(name, batch, "peak_bytes")] > 0
                backend = "chunked" if name == "ours" else "stock"
                assert steps[(name, batch, f"loss_backend_{backend}")] == 1


@pytest.mark.slow
def test_a_failing_case_fails_the_run(monkeypatch, tmp_path):
    """The exit code says whether every check passed (here a backend whose d_docs is off by 1%)."""
    real = cuda_checks.run_backend

    def off_by_one_percent(name, queries, *args, **kwargs):
        result = real(name, queries, *args, **kwargs)
        if queries.dtype == torch.float64:  # the truth
            return result
        return result._replace(grads=(result.grads[0], result.grads[1] * 1.01, result.grads[2]))

    monkeypatch.setattr(cuda_checks, "run_backend", off_by_one_percent)
    assert run.main(["--dry-run", "--steps", "correctness", "--out", str(tmp_path)]) == 1
    assert "failed" in (tmp_path / "summary.md").read_text()


def test_the_checks_run_each_mode_in_the_precision_auto_resolves(monkeypatch):
    """The backend runs in what the op's precision "auto" resolves to for the mode (asked under bf16 autocast for
    "bf16_autocast"), the float64 truth in IEEE."""
    asked, seen = [], []

    def resolve(precision, queries):
        asked.append((precision, queries.dtype, torch.is_autocast_enabled(queries.device.type)))
        return "tf32"

    real = cuda_checks.run_backend

    def spy(name, queries, docs, world, spec, *args, **kwargs):
        seen.append((queries.dtype, spec.precision))
        return real(name, queries, docs, world, spec, *args, **kwargs)

    monkeypatch.setattr(cuda_checks, "resolve_precision", resolve)
    monkeypatch.setattr(cuda_checks, "run_backend", spy)
    rows = cuda_checks.run_case(cuda_checks.cases("tiny")[0], "triton", "bf16_autocast", "cpu", stand_in="chunked")
    assert asked == [("auto", torch.float32, True)]
    assert sorted(seen, key=str) == [(torch.float32, "tf32"), (torch.float64, "ieee")]
    assert all(r["passed"] for r in rows)


def test_a_maxsim_backend_off_by_one_percent_fails_its_case(monkeypatch):
    """The MaxSim check fails a backend whose document gradients are 1% off (the truth, float64, untouched)."""
    from st_cached_losses.ops.maxsim import chunked

    real = chunked.forward

    def off_by_one_percent(problem, *args, **kwargs):
        result = real(problem, *args, **kwargs)
        if problem.queries.dtype == torch.float64:
            return result
        return result._replace(grads=(result.grads[0], result.grads[1] * 1.01, result.grads[2]))

    case = maxsim_cuda_checks.maxsim_cases("tiny")[0]
    assert not cuda_checks.failures(maxsim_cuda_checks.run_case(case, "triton", "fp32", "cpu", stand_in="chunked"))
    monkeypatch.setattr(chunked, "forward", off_by_one_percent)
    rows = maxsim_cuda_checks.run_case(case, "triton", "fp32", "cpu", stand_in="chunked")
    assert [r["quantity"] for r in rows if not r["passed"]] == ["d_docs"]


def _records(*rows):
    return [dict(zip(("contender", "B", "metric", "value"), row)) for row in rows]


def test_targets_judge_the_triton_rows():
    """The loss stages' targets read the Triton backend's rows ("auto" is the chunked backend until the card is
    verified): met, MISSED or not measured, with the figure."""
    from benchmarks.gpu.summary import targets

    mib = 2**20
    stage = _records(
        ("auto_bf16", 16384, "seconds_median", 0.300),
        ("triton_bf16", 16384, "seconds_median", 0.005),
        ("triton_tf32", 16384, "seconds_median", 0.012),
        ("triton_bf16", 16384, "peak_bytes", 100 * mib),
        ("inputs_bf16", 16384, "input_bytes", 48 * mib),
    )
    late = _records(
        ("triton_bf16", 512, "Ld128_pairs/seconds_median", 0.0015),
        ("triton4dims_bf16", 512, "Ld128_pairs/seconds_median", 0.0030),
        ("triton4dims_bf16", 4096, "Ld128_pairs/peak_bytes", 600 * mib),
        ("inputs_bf16", 4096, "Ld128_pairs/token_bytes", 320 * mib),
    )
    lines = targets(stage, late, [], [])
    assert "- met: loss stage B = 16384 bf16 <= 6 ms: 5.0 ms" in lines
    assert "- not measured: loss stage B = 65536 bf16 <= 100 ms" in lines
    assert any(line.startswith("- met: loss stage peak") and "0.28 of it" in line for line in lines)
    assert "- MISSED: loss stage B = 16384, fp32 inputs under TF32 <= 2x the bf16 time: 2.40x" in lines
    assert "- met: multi-vector loss stage B = 512, Ld 128, bf16, one dim <= 2 ms: 1.5 ms" in lines
    assert "- MISSED: multi-vector loss stage B = 512, four dims <= 1.5x one dim: 2.00x" in lines
    assert any(line.startswith("- MISSED: multi-vector loss stage peak") and "1.04 of it" in line for line in lines)


def test_without_a_gpu_the_real_run_is_a_one_line_error(capsys, tmp_path):
    assert run.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_multivector_step_stops_adding_sizes_past_its_share(monkeypatch):
    """Every contender is measured at the first size; with the share spent, no larger B runs, and the table says
    why."""
    from benchmarks.gpu import multivector

    monkeypatch.setattr(multivector, "CONTENDERS", ("matmul", "chunked"))
    plan = multivector.Plan("cpu", (8, 16, 32), (16,), 0.0, query_tokens=4, dim=8, dims=(8, 4), floor_block=32)
    rows, notes = multivector.run(plan)
    measured = {(name, batch) for name, batch, metric, _ in rows if metric.endswith("/seconds_median")}
    assert measured == {(f"{n}_{d}", 8) for n in ("matmul", "chunked") for d in ("bf16", "fp32")}
    skipped = {(name, batch) for name, batch, metric, _ in rows if metric.endswith("/over_budget")}
    assert skipped == {(f"{n}_{d}", 16) for n in ("matmul", "chunked") for d in ("bf16", "fp32")}
    records = [dict(zip(("contender", "B", "metric", "value"), row)) for row in rows]
    assert "not run: measuring it would take" in "\n".join(multivector.summary_lines(records, notes, plan))


def test_the_multivector_step_flags_a_wrong_loss_and_outlives_a_failing_kernel(monkeypatch):
    """A contender whose loss is not the reference's is marked MISMATCH; one that raises is noted, and the run goes
    on (here stand-ins for the two libraries, which cannot run on a CPU)."""
    from benchmarks.gpu import anchors, multivector

    def stand_in(name, *inputs):
        if name == "lik":
            return lambda: torch.tensor(5.0)

        def kernel_fails():
            raise RuntimeError("no kernel image")

        return kernel_fails

    monkeypatch.setattr(anchors, "unavailable", lambda name, device: None)
    monkeypatch.setattr(anchors, "infonce_step", stand_in)
    monkeypatch.setattr(multivector, "CONTENDERS", ("matmul", "chunked", "lik", "flash_maxsim"))
    plan = multivector.Plan("cpu", (8,), (16,), math.inf, query_tokens=4, dim=8, dims=(8, 4), floor_block=32)
    rows, notes = multivector.run(plan)
    value = {(name, metric): v for name, _, metric, v in rows}
    assert value[("chunked_fp32", "Ld16_pairs/loss_ok")] == 1 and value[("lik_fp32", "Ld16_pairs/loss_ok")] == 0
    assert value[("flash_maxsim_bf16", "Ld16_pairs/raised")] == 1
    records = [dict(zip(("contender", "B", "metric", "value"), row)) for row in rows]
    summary = "\n".join(multivector.summary_lines(records, notes, plan))
    assert "| lik | " in summary and "MISMATCH" in summary
    assert "flash_maxsim_fp32 at B = 8, Ld16_pairs: raised RuntimeError: no kernel image" in summary


# ------------------------------------------------------------------ other libraries' MaxSim kernels (benchmarks)


@pytest.fixture
def interpreted_autotune(monkeypatch, tmp_path):
    """Autotuned kernels of other libraries in Triton's CPU interpreter (TRITON_INTERPRET=1, conftest.py), which has
    no benchmarker: each autotuner takes its first config."""
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "do_bench", property(lambda self: lambda fn, quantiles: [1.0, 1.0, 1.0]))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))


def _maxsim_problem(query_tokens: int = 6, doc_tokens: int = 12, dim: int = 16):
    """Unit token vectors, positives echoing their queries, right-padded query and document masks."""
    from benchmarks.gpu.multivector import Plan, problem

    queries, documents, query_mask, document_mask = problem(
        Plan("cpu", (5,), (doc_tokens,), 0.0, query_tokens=query_tokens, dim=dim), 5, doc_tokens, torch.float32
    )
    query_mask[1, query_tokens - 2 :] = False
    return queries, documents, query_mask, document_mask


def _ours(queries, documents, query_mask, document_mask, similarity="cosine"):
    from st_cached_losses import maxsim_infonce

    leaves = queries.clone().requires_grad_(), documents.clone().requires_grad_()
    out = maxsim_infonce(
        *leaves, query_mask=query_mask, document_mask=document_mask, dims=[queries.shape[2]], similarity=similarity
    )
    out.loss.backward()
    return out.loss.detach(), leaves[0].grad, leaves[1].grad


def test_anchor_lengths_need_right_padded_masks():
    from benchmarks.gpu.anchors import prefix_lengths

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    assert prefix_lengths(mask, "document_mask").tolist() == [2, 3, 0]
    with pytest.raises(ValueError, match="document_mask must keep a prefix"):
        prefix_lengths(torch.tensor([[1, 0, 1]], dtype=torch.bool), "document_mask")


def test_anchors_are_skipped_without_cuda():
    from benchmarks.gpu.anchors import ANCHORS, unavailable

    for name in ANCHORS:
        assert "CUDA" in unavailable(name, "cpu") or "not importable" in unavailable(name, "cpu")
    with pytest.raises(ValueError, match="name must be one of"):
        unavailable("colbert", "cpu")


def test_lik_scores_give_maxsim_infonce_loss(interpreted_autotune):
    """late-interaction-kernels' forward in the interpreter (its backward kernels refuse CPU tensors): the InfoNCE over
    its scores is maxsim_infonce's at the full dim, masks included."""
    pytest.importorskip("late_interaction_kernels", reason="pip install late-interaction-kernels==0.4.5")
    import torch.nn.functional as F

    from benchmarks.gpu.anchors import scorer

    queries, documents, query_mask, document_mask = _maxsim_problem()
    with torch.no_grad():
        scores = scorer("lik", query_mask, document_mask)(queries, documents)
    loss = F.cross_entropy(scores, torch.arange(queries.shape[0]))
    torch.testing.assert_close(loss, _ours(queries, documents, query_mask, document_mask)[0], rtol=1e-3, atol=0)


def test_flash_maxsim_step_gives_maxsim_infonce_loss_and_gradients(interpreted_autotune, monkeypatch):
    """flash-maxsim forward + backward in the interpreter (its atomic backward path, which does not ask the CUDA
    device for its name): the loss is maxsim_infonce's, the gradients those of its dot-product MaxSim (on unit token
    vectors the same loss; cosine's gradients are the tangential part of these)."""
    pytest.importorskip("flash_maxsim", reason="pip install flash-maxsim==0.3.0")
    import torch.nn.functional as F

    from benchmarks.gpu.anchors import infonce_step, scorer

    monkeypatch.setenv("FLASH_BWD_PATH", "atomic")
    problem = _maxsim_problem()
    loss, d_queries, d_docs = _ours(*problem, similarity="dot")
    torch.testing.assert_close(infonce_step("flash_maxsim", *problem)(), loss, rtol=2e-3, atol=0)
    torch.testing.assert_close(_ours(*problem)[0], loss, rtol=1e-5, atol=0)
    queries, documents = (x.clone().requires_grad_() for x in problem[:2])
    F.cross_entropy(scorer("flash_maxsim", *problem[2:])(queries, documents), torch.arange(5)).backward()
    torch.testing.assert_close(queries.grad, d_queries, rtol=2e-3, atol=2e-4)
    torch.testing.assert_close(documents.grad, d_docs, rtol=2e-3, atol=2e-4)


def test_an_offline_machine_passes_a_model_directory(tmp_path, monkeypatch, capsys):
    """The GPU machine has no MiniLM package, only a carried copy: the training step takes its folder, and the tiny
    stand-ins of the loss stage take their tokenizer from it (the first GPU run failed on both)."""
    from benchmarks import train_step
    from st_cached_losses import testing

    assert train_step.parse_args(["--model", str(tmp_path)]).model == str(tmp_path)
    with pytest.raises(SystemExit) as refused:
        train_step.parse_args(["--model", str(tmp_path / "missing")])
    assert refused.value.code == 2 and "local model directory" in capsys.readouterr().err
    monkeypatch.setenv(testing.TOKENIZER_ENV, str(tmp_path))
    assert testing.tokenizer_path() == str(tmp_path)
    monkeypatch.delenv(testing.TOKENIZER_ENV)
    assert testing.tokenizer_path() == testing.minilm_path()


# ------------------------------------------------------------------ the compile report (CPU-side predictors)

NESTED_LOOPS_PTX = """
.visible .entry k(
)
{
	ld.global.b64 	%rd1, [%rd0];
$L__BB0_2:                              // =>This Loop Header: Depth=1
	ld.global.b32 	%r1, [%rd2];
	wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%f1}, %rd3, %rd4, 1, 1, 1, 0, 0;
$L__BB0_3:                              //   Parent Loop BB0_2 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
	@%p1 ld.global.b16 	%rs1, [%rd5];
	ld.global.v4.b32 	{%r2, %r3, %r4, %r5}, [%rd6];
	cp.async.cg.shared.global [%r6], [%rd7], 16;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f2}, %rd8, %rd9, 1, 1, 1, 0, 0;
	@!%p2 bra 	$L__BB0_3;
$L__BB0_4:                              // %._crit_edge
	ld.global.b16 	%rs2, [%rd10];
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f3}, {%r7}, {%r8}, {%f4};
	ret;
}
"""


def test_the_hot_loop_is_the_deepest_loops_blocks():
    """Instructions are counted in the blocks LLVM marks as the deepest loop; outside any loop they do not count."""
    from benchmarks.gpu.compile_report import hot_loop

    mix = hot_loop(NESTED_LOOPS_PTX)
    assert mix["hot_depth"] == 2
    assert (mix["wgmma"], mix["wgmma_n"], mix["mma"]) == (1, "128", 0)
    assert (mix["ld_vector"], mix["cp_async"], mix["tma"], mix["ld_scalar_b16"], mix["ld_scalar_b32"]) == (
        1,
        1,
        0,
        1,
        0,
    )
    assert (mix["loop_wgmma"], mix["loop_mma"]) == (2, 0)  # both loops' wgmma; the mma after them is in none


def test_occupancy_and_waves_of_a_132_sm_card():
    from benchmarks.gpu.compile_report import occupancy

    # 255 registers: 8192 per warp (256-register units), 8 warps fill the SM's 65536: one CTA, 8 of 64 warps.
    assert occupancy(255, 20480, 8, 256) == {"ctas_per_sm": 1, "occupancy": 0.125, "waves": round(256 / 132, 3)}
    # 64 registers x 4 warps: 8 CTAs by registers; 100 KiB of shared memory (+1 KiB reserved) allows 2.
    assert occupancy(64, 100 * 1024, 4, 264)["ctas_per_sm"] == 2
    assert occupancy(64, 0, 4, 264) == {"ctas_per_sm": 8, "occupancy": 0.5, "waves": 0.25}


def test_the_rules_name_spills_lost_tensor_cores_narrow_wgmma_and_overfull_sms():
    from benchmarks.gpu.compile_report import rule
    from benchmarks.gpu.kernels import Variant

    clean = {"spill_stores": 0, "spill_loads": 0, "loop_wgmma": 4, "loop_mma": 0, "wgmma_n": "64 128"}
    clean.update(ctas_per_sm=1, shared_bytes=1024, registers=128)
    tensor_cores, fma = Variant("bf16", {}, {}, 8, 2), Variant("ieee", {}, {}, 8, 2, tensor_cores=False)
    assert rule(tensor_cores, clean) == "ok"
    assert rule(tensor_cores, {**clean, "spill_loads": 8}) == "spills 0 B stores / 8 B loads"
    assert rule(tensor_cores, {**clean, "loop_wgmma": 0}) == "no tensor-core instruction in a loop"
    assert rule(tensor_cores, {**clean, "loop_wgmma": 0, "loop_mma": 2}) == "mma.sync, no wgmma"
    assert rule(tensor_cores, {**clean, "wgmma_n": "32 128"}) == "wgmma N 32 < 64"
    overfull = "does not fit an SM (400000 B shared, 128 registers)"
    assert rule(tensor_cores, {**clean, "ctas_per_sm": 0, "shared_bytes": 400000}) == overfull
    assert rule(fma, {**clean, "loop_wgmma": 0, "wgmma_n": ""}) == "ok"


def test_every_registered_kernel_is_complete():
    """Names unique; each kernel's function has the registered name; its variants compile every argument; known
    failures name real variants; every kernel the two ops' Triton backends define is registered."""
    from benchmarks.gpu.kernels import KERNELS
    from st_cached_losses.ops.dense import triton_fused as fused
    from st_cached_losses.ops.maxsim import triton_kernels

    assert len({entry.name for entry in KERNELS}) == len(KERNELS)
    for entry in KERNELS:
        kernel = entry.kernel()
        assert kernel.fn.__name__ == entry.kernel_name  # an InterpretedFunction here (TRITON_INTERPRET=1)
        labels = [variant.label for variant in entry.variants()]
        assert len(set(labels)) == len(labels) and set(entry.known_failures) <= set(labels)
        assert all(reason for reason in entry.known_failures.values())
        for variant in entry.variants():
            assert list(variant.signature) == list(kernel.arg_names) and variant.grid > 0 and variant.units > 0
    defined = {name for module in (fused, triton_kernels) for name in vars(module) if name.endswith("_kernel")}
    assert defined == {entry.kernel_name for entry in KERNELS}


def test_launches_are_counted_per_kernel_in_the_interpreter():
    """One call of the dense op (query_to_doc) launches each pass, the rows kernel and the query rows' finishing
    once per row block, and the columns' finishing once; MaxSim launches its four kernels once per query tile and
    the inverse norms once per cosine side."""
    from benchmarks.gpu.launches import count

    one, torch_ops = count("matryoshka_infonce", "triton", units=1)
    two, _ = count("matryoshka_infonce", "triton", units=2)
    keys = ("_pass_kernel[PASS=1]", "_pass_kernel[PASS=2]", "_rows_kernel")
    assert one == {**dict.fromkeys(keys, 1), "_finish_kernel": 2} and torch_ops > 0
    assert two == {**dict.fromkeys(keys, 2), "_finish_kernel": 3}
    one, _ = count("maxsim_infonce", "triton", units=1)
    two, _ = count("maxsim_infonce", "triton", units=2)
    per_tile = ("_forward_kernel", "_infonce_kernel", "_query_grad_kernel", "_document_grad_kernel")
    assert one == {**dict.fromkeys(per_tile, 1), "_inverse_norms_kernel": 2}
    assert two == {**dict.fromkeys(per_tile, 2), "_inverse_norms_kernel": 2}


@pytest.mark.slow  # compiles every registered kernel and variant for sm_90 in a fresh process (minutes)
def test_registered_kernels_compile_for_sm90_without_spills_and_on_tensor_cores(tmp_path):
    """The compile report in a process without TRITON_INTERPRET: a row per kernel and variant, and every one the
    registry does not mark as a known failure spills nothing and keeps tensor-core instructions in its loops where
    it declares them."""
    import os
    import subprocess
    import sys

    from benchmarks.gpu.kernels import KERNELS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "benchmarks.gpu", "--compile-report", "--no-launch-count", "--out", str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "compile_report.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["kernel"], r["variant"]) for r in rows} == {
        (entry.name, label) for entry in KERNELS for label in entry.known_failures.keys() | _labels(entry)
    }
    held = [r for r in rows if not r["known_failure"]]
    assert held, "every variant is marked as a known failure: the test holds nothing"
    for row in held:
        assert int(row["spill_stores"]) == int(row["spill_loads"]) == 0, row
        if row["tensor_cores_declared"] == "1":  # Hopper's warpgroup MMA, N >= 64, in a loop
            assert int(row["loop_wgmma"]) > 0 and all(int(n) >= 64 for n in row["wgmma_n"].split()), row
        assert int(row["registers"]) > 0 and int(row["ctas_per_sm"]) >= 1 and row["rule"] == "ok", row


def _labels(entry) -> set[str]:
    return {variant.label for variant in entry.variants()}
