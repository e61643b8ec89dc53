"""CPU-side predictors of the Triton kernels: ``python -m benchmarks.gpu --compile-report --out DIR`` (no GPU).

Every variant of every entry of ``benchmarks/gpu/kernels.py`` is compiled for ``--arch`` (90: H100) by Triton's LLVM
and bundled ptxas (``triton.backends.nvidia.compiler.get_ptxas``). One row per kernel and variant in
``compile_report.csv``:

- ``registers``, ``spill_stores`` / ``spill_loads`` / ``stack_bytes`` (``ptxas -v`` on the kernel's PTX, Triton's own
  options), ``shared_bytes`` (Triton's dynamic shared memory plus ptxas' static);
- the hot loop's instruction mix, read from the PTX (LLVM marks each basic block's loop depth): the blocks of the
  deepest loop (``hot_depth``) give ``wgmma`` (tensor-core warpgroup MMAs) with their N (``wgmma_n``), ``mma``
  (``mma.sync``), ``ld_vector`` (``ld.global.v2/v4``), ``cp_async``, ``tma`` (``cp.async.bulk.tensor``),
  ``ld_scalar_b16`` / ``ld_scalar_b32`` (scalar global loads of 16 / 32 bits); ``loop_wgmma`` / ``loop_mma``: the
  same counts over every loop (what the tensor-core rule reads);
- ``problem`` (the size the next columns are given at: the dense kernels' B = M = 16384, D = 768, five dims; the
  MaxSim kernels' B = M = 512, Lq 32, Ld 128, D 128, four dims), ``grid`` (programs of one launch there),
  ``ctas_per_sm``, ``occupancy`` (active warps / 64) and ``waves`` on a 132-SM H100 (65536 registers, 228 KiB shared
  memory, 64 warps and 32 CTAs per SM; registers allocated per warp in units of 256);
- ``units`` (the call's row blocks or query tiles there), ``launches_per_call``: the kernel's launches in one op call
  there (forward with gradients and the backward), a fixed part plus a part per unit counted in Triton's CPU
  interpreter (``launches.py``; empty, and ``launches_note`` says why, where the counts are not linear in the
  units); ``torch_ops_per_call``: the PyTorch operators of the same call (each about one kernel launch on a GPU:
  cuBLAS GEMMs, fills, small reductions; views excluded);
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

from benchmarks.gpu.kernels import KERNELS, PROBLEMS, Variant, compile_variant

__all__ = ["FIELDS", "H100", "hot_loop", "main", "measure", "occupancy", "ptxas_usage", "rows", "rule"]

# H100 SXM5 per SM (CUDA occupancy calculator's sm_90 figures) and its 132 SMs.
H100 = {"sms": 132, "registers": 65536, "shared_bytes": 228 * 1024, "reserved_shared": 1024, "warps": 64, "ctas": 32}
# The CSV's columns: the kernel, its resources, its machine code, its launch, and where the figures come from.
FIELDS = [
    *["kernel", "variant", "config", "num_warps", "num_stages", "arch"],
    *["registers", "spill_stores", "spill_loads", "stack_bytes", "shared_bytes"],
    *["hot_depth", "wgmma", "wgmma_n", "mma", "ld_vector", "cp_async", "tma", "ld_scalar_b16", "ld_scalar_b32"],
    *["loop_wgmma", "loop_mma", "tensor_cores_declared"],
    *["problem", "grid", "ctas_per_sm", "occupancy", "waves", "units", "launches_per_call", "torch_ops_per_call"],
    *["launches_note", "rule", "known_failure", "triton", "ptxas", "date"],
]


def _register_option() -> list[str]:
    """["--regAllocOptLevel=2"] where this Triton passes it to ptxas (3.9 does, for a ptxas 13 bug; 3.6 does not)."""
    import inspect

    from triton.backends.nvidia.compiler import CUDABackend

    option = "--regAllocOptLevel=2"
    return [option] if option in inspect.getsource(CUDABackend.make_cubin) else []


def ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spill bytes and stack of ``ptx`` compiled by the ptxas Triton uses for ``arch``, with its options."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [get_ptxas(arch).path, "-lineinfo", "-v", *_register_option()]
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
    """ "ok", or which rules ``row`` (a report row of ``variant``) breaks: spilled registers; not one CTA per SM
    (more shared memory or registers than an SM has: the launch fails); and where the variant declares tensor cores:
    no tensor-core instruction in a loop, mma.sync without wgmma (Hopper's warpgroup MMA), wgmma narrower than
    N = 64. The scalar loads are reported, not ruled on (a mask's bytes load so too)."""
    broken = []
    if row["spill_stores"] or row["spill_loads"]:
        broken.append(f"spills {row['spill_stores']} B stores / {row['spill_loads']} B loads")
    if not row["ctas_per_sm"]:
        broken.append(f"does not fit an SM ({row['shared_bytes']} B shared, {row['registers']} registers)")
    if variant.tensor_cores:
        narrow = [n for n in str(row["wgmma_n"]).split() if int(n) < 64]
        if not (row["loop_wgmma"] or row["loop_mma"]):
            broken.append("no tensor-core instruction in a loop")
        elif not row["loop_wgmma"]:
            broken.append("mma.sync, no wgmma")
        elif narrow:
            broken.append(f"wgmma N {' '.join(narrow)} < 64")
    return "; ".join(broken) or "ok"


def launch_counts() -> dict[str, dict]:
    """{op/backend: ``launches.model``'s counts} from ``launches.py`` run in a fresh
    process under Triton's interpreter ({} and a printed reason if it fails)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "benchmarks.gpu.launches"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        print(f"launch counts failed:\n{result.stderr[-2000:]}", file=sys.stderr)
        return {}
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(entry, variant: Variant, arch: int = 90) -> dict:
    """Compile one variant for ``arch`` and read ptxas' usage and the PTX's hot loop: {"registers", "spill_stores",
    "spill_loads", "stack_bytes", "shared_bytes", ``hot_loop``'s keys, "ptx"} (in a process without
    TRITON_INTERPRET; the package's predictor tests call this too)."""
    compiled = compile_variant(entry, variant, arch)
    ptx = compiled.asm["ptx"]
    usage = ptxas_usage(ptx, arch)
    usage["shared_bytes"] = compiled.metadata.shared + usage.pop("static_shared")
    return {**usage, **hot_loop(ptx), "ptx": ptx}


def _launches(entry, variant: Variant, counts: dict) -> dict:
    """launches_per_call, torch_ops_per_call and the note for ``entry`` at its variant's units."""
    calls = counts.get(f"{entry.op}/{entry.backend}")
    if not calls or not calls.get("linear"):
        note = calls["note"] if calls else "not counted"
        return {"launches_per_call": "", "torch_ops_per_call": "", "launches_note": note}
    key, units = entry.launch_key, variant.units
    fixed, per_unit = calls["fixed"].get(key), calls["per_unit"].get(key)
    return {
        "launches_per_call": "" if fixed is None else fixed + units * per_unit,
        "torch_ops_per_call": calls["torch_fixed"] + units * calls["torch_per_unit"],
        "launches_note": f"{fixed} + {per_unit} x {units} units; " + calls["note"] if fixed is not None else "",
    }


def rows(arch: int = 90, entries=KERNELS, counts: dict | None = None) -> list[dict]:
    """One row per entry and variant (see the module docstring)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    counts = launch_counts() if counts is None else counts
    versions = {"triton": triton.__version__, "ptxas": get_ptxas(arch).version, "date": datetime.date.today()}
    out = []
    for entry in entries:
        for variant in entry.variants():
            got = measure(entry, variant, arch)
            got.pop("ptx")
            row = {"kernel": entry.name, "variant": variant.label, "config": variant.config, "arch": f"sm_{arch}"}
            row.update(num_warps=variant.num_warps, num_stages=variant.num_stages, **got)
            row.update(tensor_cores_declared=int(variant.tensor_cores), problem=PROBLEMS[entry.op], grid=variant.grid)
            row.update(occupancy(got["registers"], got["shared_bytes"], variant.num_warps, variant.grid))
            row.update(units=variant.units, **_launches(entry, variant, counts))
            row.update(known_failure=entry.known_failure(variant) or "")
            row.update(rule=rule(variant, row), **versions)
            print(
                f"  {entry.name:<20} {variant.label:<5} {variant.config:<26} {row['registers']:>3} registers, "
                f"spills {row['spill_stores']}/{row['spill_loads']} B, {row['shared_bytes']:>6} B shared, wgmma "
                f"{row['wgmma']} (N {row['wgmma_n'] or '-'}), mma {row['mma']}, vector {row['ld_vector']}, scalar "
                f"loads {row['ld_scalar_b16']}+{row['ld_scalar_b32']}, {row['ctas_per_sm']} CTA/SM: {row['rule']}",
                flush=True,
            )
            out.append(row)
    return out


def main(out: Path, arch: int = 90, count_launches: bool = True) -> int:
    """Write ``compile_report.csv`` under ``out``; 0 (the rules are the test's to enforce, the report records).
    ``count_launches``: run ``launches.py`` (else launches_per_call stays empty)."""
    from st_cached_losses.ops.dense.triton_fused import INTERPRETED

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
