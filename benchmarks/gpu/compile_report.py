"""CPU-side predictors of the Triton kernels: ``python -m benchmarks.gpu --compile-report --out DIR`` (no GPU).

Every variant of every entry of ``benchmarks/gpu/kernels.py`` is compiled for ``--arch`` (90: H100) by Triton's LLVM
and bundled ptxas (``triton.backends.nvidia.compiler.get_ptxas``; the kernels land in Triton's cache, so a run on the
card with the same Triton version skips compiling them). One row per kernel and variant in ``compile_report.csv``:

- ``registers``, ``spill_stores`` / ``spill_loads`` / ``stack_bytes`` (``ptxas -v`` on the kernel's PTX, Triton's own
  options), ``shared_bytes`` (Triton's dynamic shared memory plus ptxas' static);
- the hot loop's instruction mix, read from the PTX (LLVM marks each basic block's loop depth): the blocks of the
  deepest loop (``hot_depth``) give ``wgmma`` (tensor-core warpgroup MMAs) with their N (``wgmma_n``), ``mma``
  (``mma.sync``), ``ld_vector`` (``ld.global.v2/v4``), ``cp_async``, ``tma`` (``cp.async.bulk.tensor``),
  ``ld_scalar_b16`` / ``ld_scalar_b32`` (scalar global loads of 16 / 32 bits); ``loop_wgmma`` / ``loop_mma``: the
  same counts over every loop (what the tensor-core rule reads);
- ``ctas_per_sm``, ``occupancy`` (active warps / 64) and ``grid`` / ``waves`` at B = M = 16384 on a 132-SM H100
  (65536 registers, 228 KiB shared memory, 64 warps and 32 CTAs per SM; registers allocated per warp in units of 256);
- ``launches_per_call``: the entry's launches in one op call at B = 16384 (forward with gradients, query_to_doc, five
  dims), counted by running the op at two small sizes in Triton's CPU interpreter (``launches.py``); the count holds
  at any B where both agree, else the cell is empty and ``launches_note`` says why. ``torch_ops_per_call``: the
  PyTorch operators (each about one kernel launch on a GPU; views excluded) of the same call;
- ``rule``: "ok", or what breaks the rules the test enforces (spills; no tensor-core instruction in a loop where the
  variant declares them), and ``known_failure`` (the registry's reason, if any); ``triton`` / ``ptxas``: the versions.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu.kernels import KERNELS, Variant, compile_variant

__all__ = ["BATCH", "FIELDS", "H100", "hot_loop", "main", "occupancy", "ptxas_usage", "rows", "rule"]

BATCH = 16384
# H100 SXM5 per SM (CUDA occupancy calculator's sm_90 figures) and its 132 SMs.
H100 = {"sms": 132, "registers": 65536, "shared_bytes": 228 * 1024, "reserved_shared": 1024, "warps": 64, "ctas": 32}
FIELDS = [
    "kernel", "variant", "config", "num_warps", "num_stages", "arch", "registers", "spill_stores", "spill_loads",
    "stack_bytes", "shared_bytes", "hot_depth", "wgmma", "wgmma_n", "mma", "ld_vector", "cp_async", "tma",
    "ld_scalar_b16", "ld_scalar_b32", "loop_wgmma", "loop_mma", "tensor_cores_declared", "ctas_per_sm", "occupancy",
    "grid", "waves", "launches_per_call", "torch_ops_per_call", "launches_note", "rule", "known_failure", "triton",
    "ptxas", "date",
]  # fmt: skip


def ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spill bytes and stack of ``ptx`` compiled by the ptxas Triton uses for ``arch``, with its options."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2"]
        command += [f"--gpu-name={sm_arch_from_capability(arch)}", str(source), "-o", str(Path(folder) / "k.cubin")]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "stack_bytes": number(r"(\d+) bytes stack frame"),
        "static_shared": number(r"(\d+) bytes smem"),
    }


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):(.*)$")
_DEPTH = re.compile(r"Depth=(\d+)")
_OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)")


def _blocks(ptx: str) -> list[tuple[int, list[str]]]:
    """(loop depth, opcodes) of each basic block, in order: LLVM's comments after a block's label name its loop depth
    ("=> This Loop Header: Depth=2", "in Loop: Header=BB0_2 Depth=1"); a block without them is in no loop."""
    blocks: list[tuple[int, list[str]]] = [(0, [])]
    in_header = False
    for line in ptx.splitlines():
        label = _LABEL.match(line)
        if label:
            depths = [int(d) for d in _DEPTH.findall(label.group(2))]
            blocks.append((max(depths, default=0), []))
            in_header = True
            continue
        stripped = line.strip()
        if in_header and stripped.startswith("//"):  # the label's comment continues on its own lines
            depths = [int(d) for d in _DEPTH.findall(stripped)]
            blocks[-1] = (max([blocks[-1][0], *depths]), blocks[-1][1])
            continue
        in_header = False
        opcode = _OPCODE.match(line)
        if opcode and not stripped.startswith(("//", ".", "$")):
            blocks[-1][1].append(opcode.group(1))
    return blocks


def _mix(opcodes: list[str]) -> dict[str, object]:
    wgmma = [op for op in opcodes if op.startswith("wgmma.mma_async")]
    loads = [op for op in opcodes if op.startswith("ld.global")]
    scalar = [op for op in loads if not re.search(r"\.v[248]\.", op)]
    return {
        "wgmma": len(wgmma),
        "wgmma_n": " ".join(sorted({m.group(1) for op in wgmma if (m := re.search(r"\.m64n(\d+)k", op))}, key=int)),
        "mma": sum(op.startswith("mma.sync") for op in opcodes),
        "ld_vector": len(loads) - len(scalar),
        "cp_async": sum(op.startswith("cp.async") and not op.startswith("cp.async.bulk") for op in opcodes),
        "tma": sum(op.startswith("cp.async.bulk.tensor") for op in opcodes),
        "ld_scalar_b16": sum(re.search(r"\.[bsuf]16$", op) is not None for op in scalar),
        "ld_scalar_b32": sum(re.search(r"\.[bsuf]32$", op) is not None for op in scalar),
    }


def hot_loop(ptx: str) -> dict[str, object]:
    """The instruction mix of the deepest loop's blocks (``hot_depth``: its depth, 0 for a kernel without loops) and
    the tensor-core counts over every loop (``loop_wgmma``, ``loop_mma``)."""
    blocks = _blocks(ptx)
    depth = max(d for d, _ in blocks)
    mix = _mix([op for d, ops in blocks if d == depth for op in ops])
    in_loops = _mix([op for d, ops in blocks if d >= 1 for op in ops])
    return {"hot_depth": depth, **mix, "loop_wgmma": in_loops["wgmma"], "loop_mma": in_loops["mma"]}


def occupancy(registers: int, shared_bytes: int, num_warps: int, grid: int, device: dict = H100) -> dict[str, float]:
    """CTAs per SM (the least of what registers, shared memory, warps and the CTA limit allow), active warps / the
    SM's, and waves of ``grid`` programs over the device's SMs."""
    per_warp = -(-registers * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    limits = [device["ctas"], device["warps"] // num_warps]
    if registers:
        limits.append(device["registers"] // (per_warp * num_warps))
    if shared_bytes:
        limits.append(device["shared_bytes"] // (shared_bytes + device["reserved_shared"]))
    ctas = max(0, min(limits))
    return {
        "ctas_per_sm": ctas,
        "occupancy": round(ctas * num_warps / device["warps"], 4),
        "waves": round(grid / (ctas * device["sms"]), 3) if ctas else "",
    }


def rule(variant: Variant, row: dict) -> str:
    """ "ok", or which rule ``row`` (a report row of ``variant``) breaks: spilled registers; no tensor-core
    instruction in any loop of a variant that declares them."""
    broken = []
    if row["spill_stores"] or row["spill_loads"]:
        broken.append(f"spills {row['spill_stores']} B stores / {row['spill_loads']} B loads")
    if variant.tensor_cores and not (row["loop_wgmma"] or row["loop_mma"]):
        broken.append("no tensor-core instruction in a loop")
    return "; ".join(broken) or "ok"


def launch_counts() -> dict[str, dict]:
    """{op/backend: {"kernels": {name: launches}, "torch_ops": n, "note": str}} from ``launches.py`` run in a fresh
    process under Triton's interpreter ({} and a printed reason if it fails)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "benchmarks.gpu.launches"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        print(f"launch counts failed:\n{result.stderr[-2000:]}", file=sys.stderr)
        return {}
    return json.loads(result.stdout.strip().splitlines()[-1])


def rows(arch: int = 90, entries=KERNELS, counts: dict | None = None) -> list[dict]:
    """One row per entry and variant (see the module docstring)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    counts = launch_counts() if counts is None else counts
    versions = {"triton": triton.__version__, "ptxas": get_ptxas(arch).version, "date": datetime.date.today()}
    out = []
    for entry in entries:
        calls = counts.get(f"{entry.op}/{entry.backend}", {})
        for variant in entry.variants():
            compiled = compile_variant(entry, variant, arch)
            usage = ptxas_usage(compiled.asm["ptx"], arch)
            shared = compiled.metadata.shared + usage.pop("static_shared")
            grid = entry.grid(BATCH, variant)
            row = {"kernel": entry.name, "variant": variant.label, "config": variant.config, "arch": f"sm_{arch}"}
            row.update(num_warps=variant.num_warps, num_stages=variant.num_stages, **usage, shared_bytes=shared)
            row.update(hot_loop(compiled.asm["ptx"]), tensor_cores_declared=int(variant.tensor_cores), grid=grid)
            row.update(occupancy(usage["registers"], shared, variant.num_warps, grid))
            launches = calls.get("kernels", {}).get(entry.kernel_name)
            row.update(
                launches_per_call="" if launches is None else launches, torch_ops_per_call=calls.get("torch_ops", "")
            )
            row.update(launches_note=calls.get("note", "not counted"), known_failure=entry.known_failure(variant) or "")
            row.update(rule=rule(variant, row), **versions)
            print(
                f"  {entry.name:<16} {variant.label:<5} {variant.config:<16} {row['registers']:>3} registers, "
                f"spills {row['spill_stores']}/{row['spill_loads']} B, {shared:>6} B shared, wgmma {row['wgmma']} "
                f"(N {row['wgmma_n'] or '-'}), scalar loads {row['ld_scalar_b16']}+{row['ld_scalar_b32']}, "
                f"{row['ctas_per_sm']} CTA/SM: {row['rule']}",
                flush=True,
            )
            out.append(row)
    return out


def main(out: Path, arch: int = 90, count_launches: bool = True) -> int:
    """Write ``compile_report.csv`` under ``out``; 0 (the rules are the test's to enforce, the report records).
    ``count_launches``: run ``launches.py`` (else launches_per_call stays empty)."""
    from st_cached_losses.ops.triton.kernels import INTERPRETED

    if INTERPRETED:
        print(
            "benchmarks.gpu: error: --compile-report needs Triton's compiler: unset TRITON_INTERPRET", file=sys.stderr
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    report = rows(arch, counts=None if count_launches else {})
    with (out / "compile_report.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(report)
    print(f"wrote {out / 'compile_report.csv'} ({len(report)} kernels x variants)")
    return 0
