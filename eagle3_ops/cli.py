"""The `eagle3` command (also `python -m eagle3_ops`).

    eagle3 selfcheck [--device cpu|cuda]   build info, then every op once on small inputs, as a table
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _mutated(name: str, args: tuple) -> list[torch.Tensor]:
    schema = getattr(torch.ops.eagle3, name).default._schema
    out = []
    for a, v in zip(schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write and v is not None:
            out += list(v) if isinstance(v, (list, tuple)) else [v]
    return out


def _summary(name: str, args: tuple, result) -> str:
    if name.startswith("verify_"):
        _, accept_len, emitted = result
        return f"accept_len {accept_len.tolist()}, emitted {emitted[:, 0].tolist()}..."
    outs = _mutated(name, args)
    written = sum(int(torch.isfinite(t).sum()) if t.is_floating_point() else t.numel() for t in outs)
    total = sum(t.numel() for t in outs)
    return f"wrote {', '.join('x'.join(map(str, t.shape)) for t in outs)} ({written}/{total} finite)"


def _compare(cpu_args: tuple, dev_args: tuple, name: str, cpu_res, dev_res) -> str:
    pairs = list(zip(_mutated(name, cpu_args), _mutated(name, dev_args)))
    if name.startswith("verify_"):
        pairs = list(zip(cpu_res, dev_res))
    worst = 0.0
    for c, d in pairs:
        d = d.cpu()
        if not c.is_floating_point():
            if not torch.equal(c, d):
                return "MISMATCH"
            continue
        if torch.equal(c, d) or (torch.isnan(c) == torch.isnan(d)).all() and torch.equal(c.nan_to_num(), d.nan_to_num()):
            continue
        worst = max(worst, float((c.double() - d.double()).norm() / c.double().norm().clamp_min(1e-30)))
    return "bit-exact" if worst == 0 else f"rel err {worst:.1e}"


def selfcheck(device: str) -> int:
    import eagle3_ops
    from eagle3_ops._register import OPS, TRITON_OPS
    from eagle3_ops.samples import sample_args

    info = eagle3_ops.build_info()
    print(f"eagle3_ops {eagle3_ops.__version__} on torch {torch.__version__}")
    print(f"build: CUDA kernels {'compiled for ' + info['cuda_archs'] + ' with CUDA ' + info['cuda_version'] if info['cuda'] else 'not compiled (C++ op table only)'}"
          f"; CUDA ops: {', '.join(info['cuda_kernels']) or 'none'}; Triton ops: {', '.join(TRITON_OPS) or 'none'}")
    use_cuda = device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    header = f"{'op':<20} {'cpu (reference)':<16} {'result':<52} {'cuda kernel':<12} {'cuda vs reference'}"
    print(header)
    print("-" * len(header))
    failures = 0
    for name in OPS:
        op = getattr(torch.ops.eagle3, name)
        args = sample_args(name)
        try:
            t0 = time.perf_counter()
            res = op(*args)
            ms = (time.perf_counter() - t0) * 1e3
            cpu_cell, summary = f"ok {ms:7.2f} ms", _summary(name, args, res)
        except Exception as e:  # a self-check reports, it does not stop at the first failure
            failures += 1
            cpu_cell, summary = "FAILED", f"{type(e).__name__}: {e}"[:52]
        kind = "CUDA C++" if name in info["cuda_kernels"] else ("Triton" if name in TRITON_OPS else "-")
        cuda_cell = "not run"
        if use_cuda and kind != "-":
            dev_args = sample_args(name, device="cuda")
            try:
                dev_res = op(*dev_args)
                torch.cuda.synchronize()
                cuda_cell = _compare(args, dev_args, name, res, dev_res)
                failures += cuda_cell == "MISMATCH"
            except Exception as e:
                failures += 1
                cuda_cell = f"FAILED {type(e).__name__}: {e}"[:60]
        elif kind == "-":
            cuda_cell = "no kernel yet"
        print(f"{name:<20} {cpu_cell:<16} {summary:<52} {kind:<12} {cuda_cell}")
    print(f"\n{len(OPS) - failures}/{len(OPS)} ops ran" + ("" if not failures else f"; {failures} FAILED"))
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3", description="eagle3_ops: EAGLE-3 speculative decoding kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selfcheck", help="build info, then every op once on small inputs (a table)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda also runs each CUDA/Triton kernel and compares it with the CPU reference")
    args = parser.parse_args(argv)
    if args.command == "selfcheck":
        return selfcheck(args.device)
    return 2


if __name__ == "__main__":
    sys.exit(main())
