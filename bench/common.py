"""Benchmark plumbing shared by bench/bench_*.py: ceilings measured in the same run, CUDA-graph timing
over rotated inputs, the roofline fraction, and the results file.

    fraction of the floor = max(bytes / copy_bw, flops / mm_rate) / time

copy_bw counts bytes read plus bytes written by a large device-to-device copy; mm_rate is an
8192^3 bf16 matmul on random data. Both are measured at the start of every run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

L2_BYTES = 60 * 2**20  # H200: 60 MB of L2; rotated inputs are sized to exceed it several times


def event_median_us(fn: Callable[[], None], reps: int = 50, warmup: int = 5) -> float:
    """Median device time of fn() in microseconds, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


@dataclass
class Ceilings:
    copy_bw: float  # bytes/s, read + written
    mm_rate: float  # flop/s, bf16 dense

    @staticmethod
    def measure() -> "Ceilings":
        n = 1 << 30  # 1 GiB each way
        src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        t = event_median_us(lambda: dst.copy_(src), reps=20) * 1e-6
        copy_bw = 2 * n / t
        del src, dst
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        t = event_median_us(lambda: a @ b, reps=20) * 1e-6
        return Ceilings(copy_bw=copy_bw, mm_rate=2 * 8192**3 / t)


def rotation(bytes_per_call: int) -> int:
    """How many input sets to rotate so that one pass over them exceeds L2 three times."""
    return max(1, min(64, -(-3 * L2_BYTES // max(bytes_per_call, 1))))


def eager_time_us(calls: list[Callable[[], None]], total: int, batches: int = 10) -> float:
    """Per-call wall time of back-to-back eager calls (host launch cost included, the device drained at each
    batch's end): `total` calls cycling through `calls` (never more: ops that advance state size their inputs
    by it), in `batches` timed batches; the fastest batch. Host noise (another process on the core, the
    garbage collector, a page fault, a cold first batch) only ever adds time, so the minimum is the estimate a
    re-run reproduces: one timed run of 40 calls swung 20 to 33 us between two processes of one build
    (device_checks_h200.log at f803251)."""
    batches = max(1, min(batches, total))
    per_batch, k, times = total // batches, 0, []
    torch.cuda.synchronize()
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            calls[k % len(calls)]()
            k += 1
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / per_batch * 1e6)
    return min(times)


def graph_time_us(calls: list[Callable[[], None]], reps: int = 30) -> float:
    """Per-call median time of the given calls (one per rotated input set), captured back to back in
    one CUDA graph and replayed: launch gaps shrink to what an engine's graph would see."""
    per_graph = max(len(calls), 20)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm up (compilation, allocator) outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    return event_median_us(graph.replay, reps=reps) / per_graph


@dataclass
class Row:
    bench: str
    shape: str
    provider: str
    us: float
    bytes: int
    flops: int
    floor_us: float
    fraction: float
    extra: dict = field(default_factory=dict)


class Recorder:
    def __init__(self, ceilings: Ceilings):
        self.ceilings = ceilings
        self.rows: list[Row] = []

    def add(self, bench: str, shape: str, provider: str, us: float, bytes: int, flops: int = 0, **extra) -> Row:
        floor = max(bytes / self.ceilings.copy_bw, flops / self.ceilings.mm_rate) * 1e6
        # (a derived row - a difference of two medians - can be 0 us: no fraction of the floor then)
        row = Row(bench, shape, provider, us, bytes, flops, floor, floor / us if us > 0 else float("nan"), extra)
        self.rows.append(row)
        return row

    def table(self) -> str:
        out = [f"ceilings measured in this run: copy {self.ceilings.copy_bw / 1e12:.2f} TB/s, "
               f"bf16 matmul {self.ceilings.mm_rate / 1e12:.0f} TFLOP/s",
               f"{'bench':<16} {'shape':<28} {'provider':<14} {'us':>9} {'vs torch':>9} {'floor us':>9} {'of floor':>8}"]
        base = {(r.bench, r.shape): r.us for r in self.rows if r.provider == "torch"}
        for r in self.rows:
            ref = base.get((r.bench, r.shape))
            if "share_of_torch" in r.extra:  # a derived cost: its share of the torch path, not a speed-up
                speedup, of_floor = f"{100 * r.extra['share_of_torch']:.0f}%", "-"
            else:
                speedup = f"{ref / r.us:.2f}x" if ref and r.us > 0 else "-"
                of_floor = f"{100 * r.fraction:.1f}%" if r.fraction == r.fraction else "-"
            out.append(f"{r.bench:<16} {r.shape:<28} {r.provider:<14} {r.us:>9.2f} {speedup:>9} {r.floor_us:>9.2f} "
                       f"{of_floor:>8}")
        return "\n".join(out)

    def write(self, path: str) -> None:
        def git(*args):
            try:
                return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
            except (OSError, subprocess.CalledProcessError):
                return os.environ.get("EAGLE3_COMMIT", "unknown")

        import triton

        doc = {
            "commit": os.environ.get("EAGLE3_COMMIT") or git("rev-parse", "HEAD"),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "ceilings": {"copy_bw_bytes_per_s": self.ceilings.copy_bw, "bf16_mm_flop_per_s": self.ceilings.mm_rate},
            "rows": [asdict(r) for r in self.rows],
        }
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".part", "w") as f:  # (then renamed: a run killed mid-write leaves the last whole file)
            json.dump(doc, f, indent=1)
        os.replace(path + ".part", path)


def bench_out(name: str) -> Optional[str]:
    folder = os.environ.get("EAGLE3_BENCH_OUT")
    return os.path.join(folder, f"{name}.json") if folder else None


def compile_sm90a(fn, const: dict, types: dict, ints: dict, num_warps: int, num_stages: int, name: str):
    """AOT-compile the Triton kernel `fn` for sm_90a without a GPU, specialised as the JIT would: `const`
    the constexpr arguments, `types` the other non-int arguments' types ("*bf16", "fp32", "tensordesc<..>";
    pointers marked divisible by 16), `ints` the int arguments' values (multiples of 16 marked divisible,
    1 made a constant). Runs triton's bundled ptxas -v on the PTX. Returns (compiled kernel, ptxas's
    register / spill lines joined, ptxas's stderr, path of the cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs, consts = {}, {}, dict(const)
    for i, n in enumerate(fn.arg_names):
        if n in const:
            sig[n] = "constexpr"
        elif n in types:
            sig[n] = types[n]
            if types[n].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints[n] == 1:
            sig[n], consts[n] = "constexpr", 1
        else:
            sig[n] = "i32"
            if ints[n] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128), options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"{name}.ptx")
    with open(ptx_file, "w") as f:
        f.write(k.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx_file, "-o", ptx_file + ".cubin"],
                       capture_output=True, text=True)
    info = "; ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                     if "registers" in line or "spill" in line)
    return k, info, r.stderr, ptx_file + ".cubin"
