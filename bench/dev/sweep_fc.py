"""fc_proj weight-streaming candidates at Kimi shape (issue 4), in one H200 run of about a minute:
python bench/dev/sweep_fc.py [T ...]. For each weight dtype (bf16; fp8-e4m3 with a per-channel scale) and T
(default 1, 4, 16, 32, 64): F.linear (bf16) and torch._scaled_mm (fp8 activations quantised outside the timed
call, rowwise scales) as same-run baselines, the current default and each candidate in CANDIDATES, each
checked once against an fp32 product of the same (dequantised) weight, then the best per case with its
% of copy bandwidth over the weight bytes.

Candidates compile first in parallel worker processes (the Triton cache is shared), so the timed loop
only loads them. `python bench/dev/sweep_fc.py --compile` needs no GPU: it compiles every candidate for
sm_90a and prints ptxas's registers and spills and the shared memory (triton's bundled ptxas).

Configs read "BN,BK,SPLIT,warps,stages[,PER_SM[,TMA]]" (triton_kernels/fc_proj.py:parse_override), passed to
the launcher explicitly (fc_proj._fc_proj's config): PER_SM > 0 is the persistent stream-K kernel (PER_SM
programs per SM, equal weight bytes each).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import multiprocessing as mp
import os
import sys
import time
import traceback

import torch

import _shared  # noqa: F401  (first: puts the checkout and bench/ on sys.path)

H = HD = 7168
K = 3 * H
TS = (1, 4, 16, 32, 64)  # issue 4's T <= 64 grid
# A stream-K config's PER_SM must not exceed the CTAs that fit on an SM (else a second partial wave undoes
# the balance): bf16 is bound by shared memory, fp8 by registers (its weight tile is converted in registers,
# ~160 at T <= 16 and ~250 at T = 64 with 128 x 128 tiles on 4 warps). `--compile` prints the fit per T.
# (5180f72's candidates and results: results/fc_sweep_streamk_h200.log; their winners are the defaults.)
# Now: the fp8 neighbourhood of its default 128,128,0,4,4,2,1 (42.1 / 44.8 / 65.1 us at T = 1 / 16 / 64, where
# 1.9x bf16 F.linear needs ~40.5 us): deeper pipelines, 8 warps (half the converted tile per thread), wider K.
# 6501455's run (results/fc_sweep_prep_h200.log): "+prep" (fp8 rows gathered, normalised and converted to fp16 once,
# before the stream-K kernel) lost at every T, so that path was removed; no tile config beat the defaults.
# The CUDA kernel fc_stream_sm90.cu, removed (the weight as wgmma's register operand, straight from global memory)
# was run at a7c24b9 (results/fc_sweep_sm90_h200.log): correct, but 0.47-0.73x F.linear at every T, so it is
# gone. Left: the best fp8 tiles of 6501455's run.
CANDIDATES = {
    "bf16": [],
    "fp8": ["256,128,0,8,4,1,1"],
}


def _cfg(c):
    from eagle3_ops.triton_kernels.fc_proj import parse_override

    v = parse_override(c)
    return dict(BLOCK_N=v[0], BLOCK_K=v[1], split=v[2], num_warps=v[3], num_stages=v[4], per_sm=v[5], tma=v[6])


def _where(e):
    """An exception as "Type at file:line: message" (its innermost frame), so a log shows where it came from."""
    tb = traceback.extract_tb(e.__traceback__)
    at = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}{at}: {e}"


def _kernels_module():
    """eagle3_ops.triton_kernels.fc_proj, refused when it predates this script's config fields: a stale copy
    (an old eagle3_ops/triton_kernels or install on the machine) failed every stream-K candidate on the
    H200 with the old 5-field parser's "too many values to unpack (expected 5)"."""
    from eagle3_ops.triton_kernels import fc_proj as kernels  # (importing eagle3_ops registers its ops)

    with open(kernels.__file__, "rb") as f:
        src = f.read()
    blob = hashlib.sha1(b"blob %d\0" % len(src) + src).hexdigest()[:10]  # = git hash-object / rev-parse HEAD:path
    print(f"kernels {os.path.realpath(kernels.__file__)} (blob {blob})", flush=True)
    if not hasattr(kernels, "_fc_proj") or not hasattr(kernels, "_persistent"):
        sys.exit(f"{kernels.__file__} has no stream-K path or no _fc_proj(config=...): stale copy of fc_proj.py")
    return kernels


# ---- the GPU run --------------------------------------------------------------------------------------

_STATE: dict = {}


def _weights():
    if not _STATE:
        from eagle3_ops.ops import prepare_fc_weight

        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(HD, K, device="cuda", generator=g) / K**0.5
        _STATE["bf16"] = (w.bfloat16(), None)
        w8, s8, _ = prepare_fc_weight(w, fp8=True)
        _STATE["fp8"] = (w8, s8)
    return _STATE


def _call(name, aux, out, config):
    """One fc_proj call through its launcher with candidate `config` (None: the default tiles)."""
    from eagle3_ops.triton_kernels import fc_proj as kernels

    w, s = _weights()[name]
    return lambda: kernels._fc_proj(aux, w, s, None, 1e-6, "none", None, out, config=config)


def _precompile(task):
    """In a worker process: one call per T compiles (or loads) the candidate's kernels into the shared cache."""
    import eagle3_ops  # noqa: F401  (registers the ops)

    name, config, ts = task
    t0 = time.time()
    try:
        for T in ts:
            aux = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            _call(name, aux, torch.empty(T, HD, device="cuda", dtype=torch.bfloat16), config)()
        torch.cuda.synchronize()
        return f"{time.time() - t0:.1f} s"
    except Exception as e:  # out of shared memory etc.: reported again by the timed loop
        return _where(e)[:100]


def _scaled_mm_call(aux, w8, scale):
    sa = (aux.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    a8 = (aux.float() / sa).to(torch.float8_e4m3fn)
    sb = scale.view(1, -1)
    f = lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        f()
    except RuntimeError:  # no rowwise scaling in this build: per-tensor scales
        sa, sb = sa.max().reshape(()), sb.max().reshape(())
    return f


def main(ts):
    t_start = time.time()
    _kernels_module()
    tasks = [(name, c, ts) for name, cs in CANDIDATES.items() for c in [None] + cs]
    workers = min(len(tasks), max(1, (os.cpu_count() or 2) - 2), 14)
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for (name, c, _), res in zip(tasks, pool.map(_precompile, tasks)):
            print(f"compiled {name:<4} {c or 'default':<20} {res}", flush=True)
    print(f"compilation: {time.time() - t_start:.0f} s in {workers} processes", flush=True)

    import torch.nn.functional as F

    from common import Ceilings, graph_time_us

    bw = Ceilings.measure().copy_bw
    print(f"copy {bw / 1e12:.2f} TB/s (read + write)")
    W = _weights()
    summary = []
    for T in ts:
        aux = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(T, HD, device="cuda", dtype=torch.bfloat16)
        lin = graph_time_us([lambda: F.linear(aux, W["bf16"][0])], reps=10)
        smm = graph_time_us([_scaled_mm_call(aux, *W["fp8"])], reps=10)
        for name, (w, s) in W.items():
            wf = w.float() if s is None else w.float() * s[:, None]
            truth = F.linear(aux.float(), wf)
            del wf
            nbytes = w.numel() * w.element_size()
            base = lin if name == "bf16" else smm
            print(f"T={T:<3} {name:<4} {'F.linear' if name == 'bf16' else '_scaled_mm':<20} {base:8.2f} us  "
                  f"{nbytes / (base * 1e-6) / bw * 100:5.1f}% of copy")
            rows = []
            for c in [None] + CANDIDATES[name]:
                try:
                    out.fill_(float("nan"))
                    _call(name, aux, out, c)()
                    err = float((out.float() - truth).norm() / truth.norm())
                    us = graph_time_us([_call(name, aux, out, c)], reps=10)
                except Exception as e:
                    print(f"T={T:<3} {name:<4} {c or 'default':<20} {_where(e)[:120]}")
                    continue
                ok = err <= 1e-2  # tests/conftest.TOLERANCES[bf16]; NaN (rows not written) fails too
                rows.append((us if ok else float("inf"), c or "default", err, ok))
                print(f"T={T:<3} {name:<4} {c or 'default':<20} {us:8.2f} us  {nbytes / (us * 1e-6) / bw * 100:5.1f}% "
                      f"of copy  {lin / us:5.2f}x F.linear  {smm / us:5.2f}x _scaled_mm  rel err {err:.2e}"
                      f"{'' if ok else '  FAIL'}", flush=True)
            rows.sort()
            if rows and rows[0][3]:
                us, c, err, _ = rows[0]
                summary.append(f"best T={T:<3} {name:<4} {c:<20} {us:8.2f} us  {nbytes / (us * 1e-6) / bw * 100:5.1f}% "
                               f"of copy  {lin / us:5.2f}x F.linear ({lin:.2f})  {smm / us:5.2f}x _scaled_mm "
                               f"({smm:.2f})")
    print("\n".join(summary))
    print(f"wall {time.time() - t_start:.0f} s")


# ---- registers, spills and shared memory without a GPU -------------------------------------------------


def compile_report():
    """Compile each candidate's streaming kernel for sm_90a as the JIT would specialise it at Kimi shape (ints
    that are multiples of 16 marked divisible, ints equal to 1 made constants) and print ptxas's report."""
    import triton

    from common import compile_sm90a

    kernels = _kernels_module()
    for name, cs in CANDIDATES.items():
        wty = "*bf16" if name == "bf16" else "*fp8e4nv"
        for c in cs:
            cfg = _cfg(c)
            bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
            for T in (1, 16, 64):
                bt = max(16, triton.next_power_of_2(T))
                common = dict(HAS_ROWS=False, NORM=0, HAS_NW=False, COMPUTE=triton.language.bfloat16, IEEE=False,
                              F16=name == "fp8", BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt)
                ptrs = dict(aux="*bf16", rows="*bf16", w=wty, rstd="*bf16", nw="*bf16",
                            part="*fp32", scale="*fp32", out="*bf16", err="*i64")
                if cfg["per_sm"]:
                    fn = kernels._fc_persistent_kernel
                    ipn = K // bk
                    iters = triton.cdiv(HD // bn * ipn, cfg["per_sm"] * 132)
                    s_max = triton.cdiv(iters, ipn) + 1
                    ints = dict(stride_a=K, T=T, R=T, K=K, Hd=HD, n_chunks=1, CHUNK=K, IPC=ipn, ITERS=iters)
                    const = dict(common, TMA=bool(cfg["tma"]), S_MAX=s_max)
                    ptrs["w_desc"] = f"tensordesc<{wty[1:]}[{bn}, {bk}]>" if cfg["tma"] else wty  # else the weight
                else:
                    fn = kernels._fc_stream_kernel
                    kps = triton.cdiv(triton.cdiv(K, cfg["split"]), bk) * bk
                    ints = dict(stride_a=K, T=T, R=T, K=K, Hd=HD, n_chunks=1, CHUNK=K,
                                SPLITS_PER_CHUNK=triton.cdiv(K, kps), K_PER_SPLIT=kps, stride_o=HD)
                    const = dict(common, HAS_SCALE=name == "fp8", SPLIT=triton.cdiv(K, kps))
                try:
                    k, info, _, _ = compile_sm90a(fn, const, ptrs, ints, cfg["num_warps"], cfg["num_stages"],
                                                  "fc_proj_report")
                except Exception as e:
                    print(f"{name:<4} {c:<20} T={T:<3} {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    continue
                ptx = k.asm["ptx"]
                regs = int(info.split("Used ")[1].split()[0]) if "Used " in info else 255
                fit = min(65536 // (-(-regs // 8) * 8 * 32 * cfg["num_warps"]), 233472 // (k.metadata.shared + 1024),
                          64 // cfg["num_warps"])  # H100/H200: 64K registers, 228 KB shared (1 KB per CTA)
                short = "  FEWER THAN PER_SM" if cfg["per_sm"] > fit else ""
                print(f"{name:<4} {c:<18} T={T:<3} shared {k.metadata.shared:>6}  regs {regs:>3}  "
                      f"spill {info.split(' bytes spill stores')[0].split(' ')[-1]:>3}  fits {fit}/SM{short}  wgmma "
                      f"{ptx.count('wgmma.mma_async'):>2}  tma {ptx.count('cp.async.bulk.tensor'):>1}", flush=True)


if __name__ == "__main__":
    if "--compile" in sys.argv:
        compile_report()
    else:
        main([int(t) for t in sys.argv[1:]] or list(TS))
