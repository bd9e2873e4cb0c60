"""Tree-verify attention, MLA (Kimi: 64 heads over one 576-dim latent head, V = its first 512 dims) and GQA
(the Kimi drafter's layer 64 q / 64 kv heads x 128; a Llama-8B layer 32 q / 8 kv x 128), bf16, paged KV
(page size 64), uniform prefixes, random bushy trees.

Providers, all in one run: eagle3 (torch.ops.eagle3.*: for MLA in bf16 on Hopper the CUDA kernel
csrc/mla_decode_sm90.cu, else the Triton kernels); eagle3.triton (MLA: the Triton kernel of
triton_kernels/mla_decode.py, config {"kernel": "mla_decode"}); torch (vectorised: gather the
paged rows, one matmul for the scores, the tree mask, softmax in fp32, one matmul for the output); torch.sdpa
(scaled_dot_product_attention with a boolean [B, 1, N, L] mask after the same gather); torch.compile of the
vectorised version (a few shapes: compiling costs GPU-machine time).

Device time: CUDA-graph replays of back-to-back calls over input sets rotated past L2 (median per call).
FLOPs: 2 * rows * L * (Dk + Dv) per request, rows = N * NH, L = prefix + N (the tree block counted whole).
Bytes: the KV rows of every request read once, q read, out written. Printed: us, the vectorised torch us,
speed-up, TFLOP/s, GB/s, and the fraction of the floor max(bytes / copy_bw, flops / mm_rate) / time.

For MLA, provider eagle3.v_split is the Triton launcher with config {"v_split": 2}: the 512 V dims split
across two programs per row block (triton_kernels/tree_attention.py, default_config).

fp8 (issue 23): provider eagle3.fp8 is torch.ops.eagle3.tree_attention_mla on an fp8 e4m3 copy of the same cache
with its per-tensor kv_scale (amax / 448; bf16 q, fp32 accumulation), its bytes
counted at one a dim. Every MLA shape has it; FP8_SHAPES adds issue 23's memory-bound rows (N 1 at 64 / 16 / 8
local heads, 4-token chains at 8 / 16; B1 P32768, B8 P8192, B64 P4096: models mla, mla-16, mla-8) with
providers eagle3, eagle3.triton, eagle3.fp8, eagle3.fp8.sm90 and eagle3.fp8.triton only. The table ends with each
shape's fp8 speed-up over eagle3 (bf16). eagle3.fp8 is the op's route (the sm90 kernel's fp8 build where it serves;
EAGLE3_MLA_FP8_SM90=0 keeps the Triton fp8 kernel and drops the next provider), eagle3.fp8.sm90 that build (config
kernel sm90), eagle3.fp8.triton the Triton fp8 kernel on the same inputs. EAGLE3_TREE_SWEEP=1 adds fp8 tile
variants (eagle3.fp8:<config>, Triton). The lead's fp8 run:
EAGLE3_TREE_PROVIDERS="eagle3,eagle3.fp8" EAGLE3_TREE_SHAPES="mla* N1,mla-* N4 chain" (patterns: see _kept).
EAGLE3_TREE_SWEEP=1 also times tile configurations of the Triton kernel (provider eagle3:<config>).
EAGLE3_TREE_SHAPES="mla B1 P32768 N16,mla B1 P32768 N1" keeps only those shapes and
EAGLE3_TREE_PROVIDERS="eagle3,torch,eagle3:v_split=2*" only those providers (a trailing * matches a prefix):
a short run on a time budget.

`python bench/bench_tree_attention.py` (no GPU needed) compiles the first MLA kernel's variants (config
kernel=v1, v_split) for sm_90a with triton's bundled ptxas and prints registers, spills, shared memory and
the wgmma count of each; `python bench/dev/sweep_mla.py --compile` does the same for mla_decode's kernel.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from common import graph_time_us, rotation

import eagle3_ops  # noqa: F401
from eagle3_ops import tree
from eagle3_ops.models.cache import FP8_MAX, fp8_quantize

PAGE = 64
DEV = "cuda"  # the device of every input (a CPU check of the baselines sets "cpu")
KIMI_SCALE = 0.130861
FP8_SM90 = os.environ.get("EAGLE3_MLA_FP8_SM90", "") != "0"  # the sm90 fp8 build (the op's route unless =0)
# name -> (kind, NH, HKV, Dk, Dv, scale)
MODELS = {"mla": ("mla", 64, 1, 576, 512, KIMI_SCALE),
          "mla-16": ("mla", 16, 1, 576, 512, KIMI_SCALE),  # Kimi's 64 heads at TP 4: 16 local heads a rank
          "mla-8": ("mla", 8, 1, 576, 512, KIMI_SCALE),  # TP 8
          "kimi-drafter": ("gqa", 64, 64, 128, 128, 128 ** -0.5),
          "llama-8b": ("gqa", 32, 8, 128, 128, 128 ** -0.5)}
# (model, B, prefix, N): the targets first
SHAPES = [("mla", 1, 32768, 16), ("mla", 8, 8192, 16), ("mla", 1, 4096, 16), ("mla", 1, 32768, 1),
          ("mla", 32, 32768, 1), ("mla", 8, 8192, 4), ("kimi-drafter", 1, 8192, 16), ("llama-8b", 1, 8192, 16),
          ("llama-8b", 8, 8192, 16)]
COMPILED = {("mla", 1, 4096, 16), ("llama-8b", 1, 8192, 16)}
# issue 23's memory-bound rows (a fifth element: the tree kind, default bushy), for eagle3 vs eagle3.fp8
FP8_SHAPES = [(m, B, P, 1) for m in ("mla", "mla-16", "mla-8") for B, P in ((1, 32768), (8, 8192), (64, 4096))] + \
             [(m, B, P, 4, "chain") for m in ("mla-16", "mla-8") for B, P in ((1, 32768), (8, 8192), (64, 4096))]
FP8_SHAPES = [s for s in FP8_SHAPES if s not in SHAPES]
FP8_SWEEP = [dict(BLOCK_N=32, num_stages=4), dict(BLOCK_N=64, num_stages=3), dict(BLOCK_N=32, num_stages=3, cut=False),
             dict(tma=False)]
SWEEP = [dict(BLOCK_N=32, num_warps=8, num_stages=2), dict(BLOCK_N=64, num_warps=8, num_stages=1),
         dict(BLOCK_N=64, num_warps=8, num_stages=2)]
SWEEP_CHUNKS = [128, 1024]  # min_chunk (split length floor) for the N = 1 shapes
# The V split with other tiles: 64 rows x 8 warps (no spills, but both warpgroups compute the score tile),
# 128 rows x 8 warps (one score tile per warpgroup, 188 KB of shared memory: one program per SM).
SWEEP_V_SPLIT = [dict(v_split=2, BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3, programs_per_sm=1),
                 dict(v_split=2, BLOCK_M=128, BLOCK_N=16, num_warps=8, num_stages=3, programs_per_sm=1)]


def _kept(name, env):
    """Whether EAGLE3_TREE_SHAPES / EAGLE3_TREE_PROVIDERS (comma lists) keep name: an entry matches exactly, or
    with * standing for any text (a trailing * a prefix: "mla* N1" keeps every MLA model's N 1 shapes)."""
    want = os.environ.get(env)
    if not want:
        return True
    return any(fnmatch.fnmatchcase(name, w) for w in want.split(","))


def _sid(s):
    model, B, P, N = s[:4]
    return f"{model} B{B} P{P} N{N}" + (f" {s[4]}" if len(s) > 4 else "")


def _inputs(model, B, P, N, g, tree_kind="bushy", fp8=False):
    kind, NH, HKV, Dk, Dv, scale = MODELS[model]
    L = P + N
    pages = -(-L // PAGE)
    perm = torch.randperm(B * pages, generator=g, device=DEV).int()
    page_table = perm.view(B, pages).contiguous()
    parents = tree.random_parents(B, N, torch.Generator().manual_seed(int(perm[0])), tree_kind)
    x = dict(q=torch.randn(B * N, NH, Dk, generator=g, device=DEV, dtype=torch.bfloat16),
             page_table=page_table, prefix_lens=torch.full((B,), P, dtype=torch.int32, device=DEV),
             tree_mask=tree.tree_mask(parents).to(DEV), out=torch.empty(B * N, NH, Dv, device=DEV,
                                                                      dtype=torch.bfloat16),
             lse=torch.empty(B * N, NH, device=DEV))
    if kind == "mla":
        x["k"] = torch.randn(B * pages, PAGE, Dk, generator=g, device=DEV, dtype=torch.bfloat16)
        x["v"] = None
        if fp8:  # the same rows as an fp8 cache (vLLM's per-tensor scale rule), the bf16 copy dropped
            x["kv_scale"] = (x["k"].abs().amax().float() / FP8_MAX).reshape(())
            x["k"] = fp8_quantize(x["k"], x["kv_scale"])
    else:
        x["k"] = torch.randn(B * pages, PAGE, HKV, Dk, generator=g, device=DEV, dtype=torch.bfloat16)
        x["v"] = torch.randn(B * pages, PAGE, HKV, Dv, generator=g, device=DEV, dtype=torch.bfloat16)
    return x


def _counts(model, B, P, N, fp8=False):
    kind, NH, HKV, Dk, Dv, _ = MODELS[model]
    L = P + N
    kv = B * L * (Dk if kind == "mla" else HKV * (Dk + Dv)) * (1 if fp8 else 2)
    nbytes = kv + B * N * NH * (Dk + Dv) * 2
    return nbytes, 2 * B * N * NH * L * (Dk + Dv)


def _dense(x, B, P, N):
    """Vectorised torch: the paged rows gathered densely [B, L, ...] and the [B, N, L] visibility."""
    L = P + N
    pos = torch.arange(L, device=DEV)
    k = x["k"][x["page_table"][:, pos // PAGE].long(), pos % PAGE]
    v = None if x["v"] is None else x["v"][x["page_table"][:, pos // PAGE].long(), pos % PAGE]
    j = torch.arange(N, device=DEV)
    bits = (x["tree_mask"][:, :, j // 32] >> (j % 32)) & 1  # [B, N, N]
    visible = torch.cat([torch.ones(B, N, P, dtype=torch.bool, device=DEV), bits.bool()], dim=2)
    return k, v, visible


def _providers(model, B, P, N, tree_kind="bushy"):
    kind, NH, HKV, Dk, Dv, scale = MODELS[model]
    new = (model, B, P, N, tree_kind)[:4 if tree_kind == "bushy" else 5] in FP8_SHAPES

    def eagle3(x):
        if kind == "mla":
            torch.ops.eagle3.tree_attention_mla(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"],
                                                scale, x["out"], x["lse"])
        else:
            torch.ops.eagle3.tree_attention(x["q"], x["k"], x["v"], x["page_table"], x["prefix_lens"],
                                            x["tree_mask"], scale, x["out"], x["lse"])

    def plain(x):
        k, v, visible = _dense(x, B, P, N)
        q = x["q"].view(B, N, HKV, NH // HKV, Dk)
        if kind == "mla":
            k = k[:, :, None, :]
            v = k[..., :Dv]
        s = torch.einsum("bnkgd,blkd->bkgnl", q, k).float() * scale  # [B, HKV, G, N, L]
        s = s.masked_fill(~visible[:, None, None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).to(q.dtype)
        o = torch.einsum("bkgnl,blkd->bnkgd", p, v)
        x["out"].copy_(o.reshape(B * N, NH, Dv))
        x["lse"].copy_(lse.permute(0, 3, 1, 2).reshape(B * N, NH))

    def sdpa(x):
        k, v, visible = _dense(x, B, P, N)
        q = x["q"].view(B, N, NH, Dk).transpose(1, 2)
        if kind == "mla":
            k = k[:, None]  # [B, 1, L, Dk]
            v = k[..., :Dv]
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
        x["out"].copy_(o.transpose(1, 2).reshape(B * N, NH, Dv))

    def launcher(cfg):
        from eagle3_ops.triton_kernels import tree_attention as ta

        def call(x):
            ta.tree_attention_mla(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"], scale,
                                  x["out"], x["lse"], config=cfg)
        return call

    def fp8(cfg=None):
        from eagle3_ops.triton_kernels.tree_attention import tree_attention_mla_op

        def call(x):
            tree_attention_mla_op(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"], scale, x["out"],
                                  x["lse"], x["kv_scale"], config=cfg)
        return call

    def eagle3_fp8(x):  # the op, as an engine calls it
        torch.ops.eagle3.tree_attention_mla(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"],
                                            scale, x["out"], x["lse"], x["kv_scale"])

    if new:  # issue 23's fp8 rows: ours only
        providers = {"eagle3": eagle3, "eagle3.triton": launcher(dict(kernel="mla_decode")), "eagle3.fp8": eagle3_fp8,
                     "eagle3.fp8.triton": fp8(dict(kernel="mla_decode"))}
        if FP8_SM90:
            providers["eagle3.fp8.sm90"] = fp8(dict(kernel="sm90"))
        if os.environ.get("EAGLE3_TREE_SWEEP") == "1":
            for cfg in FP8_SWEEP:
                providers["eagle3.fp8:" + ",".join(f"{k}={v}" for k, v in cfg.items())] = fp8(cfg)
        return {k: v for k, v in providers.items() if _kept(k, "EAGLE3_TREE_PROVIDERS")}
    providers = {"eagle3": eagle3, "torch": plain}
    if kind == "mla":
        providers["eagle3.triton"] = launcher(dict(kernel="mla_decode"))
        providers["eagle3.v_split"] = launcher(dict(v_split=2))
        providers["eagle3.fp8"] = eagle3_fp8
        if FP8_SM90:
            providers["eagle3.fp8.sm90"] = fp8(dict(kernel="sm90"))
        providers["eagle3.fp8.triton"] = fp8(dict(kernel="mla_decode"))
    if B * (P + N) * NH * (Dk + Dv) * 2 <= 16e9:  # SDPA's math path repeats the KV heads for every query head
        providers["torch.sdpa"] = sdpa
    if (model, B, P, N) in COMPILED:
        providers["torch.compile"] = torch.compile(plain, dynamic=False)
    if os.environ.get("EAGLE3_TREE_SWEEP") == "1" and kind == "mla" and N in (1, 16):
        configs = [dict(min_chunk=c) for c in SWEEP_CHUNKS] if N == 1 else []
        for cfg in SWEEP + SWEEP_V_SPLIT + configs:
            providers["eagle3:" + ",".join(f"{k}={v}" for k, v in cfg.items())] = launcher(cfg)
        for cfg in FP8_SWEEP:
            providers["eagle3.fp8:" + ",".join(f"{k}={v}" for k, v in cfg.items())] = fp8(cfg)
    return {k: v for k, v in providers.items() if _kept(k, "EAGLE3_TREE_PROVIDERS")}


_ROWS: list = []


@pytest.fixture(scope="module", autouse=True)
def _table():
    yield
    lines = [f"{'shape':<26} {'provider':<44} {'us':>9} {'torch us':>9} {'speed-up':>8} {'TFLOP/s':>8} "
             f"{'GB/s':>7} {'of floor':>8}"]
    base = {r[0]: r[2] for r in _ROWS if r[1] == "torch"}
    for shape, provider, us, nbytes, flops, fraction in _ROWS:
        ref = base.get(shape)
        lines.append(f"{shape:<26} {provider:<44} {us:>9.1f} {ref or float('nan'):>9.1f} "
                     f"{(ref / us if ref else float('nan')):>7.2f}x {flops / us * 1e-6:>8.1f} "
                     f"{nbytes / us * 1e-3:>7.0f} {100 * fraction:>7.1f}%")
    bf16 = {r[0]: r[2] for r in _ROWS if r[1] == "eagle3"}
    for shape, provider, us, *_ in _ROWS:  # issue 23's done-when: fp8 >= 1.7x our bf16 on the memory-bound rows
        if provider.startswith("eagle3.fp8") and shape in bf16:
            lines.append(f"fp8 vs bf16: {shape:<26} {provider:<40} {us:>8.1f} us vs eagle3 {bf16[shape]:>8.1f} us: "
                         f"{bf16[shape] / us:.2f}x")
    if os.environ.get("EAGLE3_TREE_SWEEP") == "1":  # registers, spills, shared memory of each compiled variant
        from eagle3_ops.triton_kernels import tree_attention as ta

        try:
            for cache in ta._tree_attention_kernel.device_caches.values():
                for key, k in cache[0].items():
                    try:
                        k._init_handles()  # triton 3.6 fills n_regs / n_spills when first launched
                    except Exception:  # a variant that did not fit (OutOfResources): no numbers
                        continue
                    lines.append(f"compiled: regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} "
                                 f"warps {k.metadata.num_warps} stages {k.metadata.num_stages} {str(key)[-160:]}")
        except (AttributeError, IndexError, TypeError) as e:
            lines.append(f"compiled variants not readable on this triton: {e}")
    text = "\n".join(lines)
    out = os.environ.get("EAGLE3_BENCH_OUT")
    if out:
        with open(os.path.join(out, "tree_attention_table.txt"), "w") as f:
            f.write(text + "\n")
    sys.__stdout__.write("\n" + text + "\n")


def _cases():
    for s in SHAPES + FP8_SHAPES:
        if not _kept(_sid(s), "EAGLE3_TREE_SHAPES"):
            continue
        for p in _providers(*s):
            yield pytest.param(s, p, id=f"{_sid(s)}-{p}")


@pytest.mark.parametrize("shape, provider", list(_cases()))
def test_tree_attention(recorder, shape, provider):
    model, B, P, N = shape[:4]
    fp8 = provider.startswith("eagle3.fp8")
    nbytes, flops = _counts(model, B, P, N, fp8)
    fn = _providers(*shape)[provider]
    g = torch.Generator(device=DEV).manual_seed(0)
    sets = [_inputs(model, B, P, N, g, *shape[4:], fp8=fp8) for _ in range(rotation(nbytes))]
    try:
        us = graph_time_us([lambda x=x: fn(x) for x in sets], reps=10)
    except Exception as e:  # a sweep configuration that does not fit the chip (shared memory)
        if not (provider.startswith("eagle3:") or provider.startswith("eagle3.fp8:")):
            raise
        pytest.skip(f"{provider}: {type(e).__name__}: {str(e)[:200]}")
    row = recorder.add("tree_attention", _sid(shape), provider, us, nbytes, flops, tflops=flops / us * 1e-6)
    _ROWS.append((_sid(shape), provider, us, nbytes, flops, row.fraction))
    out = os.environ.get("EAGLE3_BENCH_OUT")
    if out:  # row by row as well, so that a run stopped early keeps what it measured
        with open(os.path.join(out, "tree_attention_rows.jsonl"), "a") as f:
            f.write(json.dumps(dict(shape=_sid(shape), provider=provider, us=us, bytes=nbytes, flops=flops,
                                    fraction=row.fraction)) + "\n")


# ---- registers and spills without a GPU ------------------------------------------------------------------


def compile_report(variants=None):
    """Compile the first MLA kernel (kernel=v1) for sm_90a as the JIT would specialise it for mla B1 P32768
    N16 (pointers and multiples of 16 marked divisible by 16, ints equal to 1 made constants) and print
    ptxas's registers and spills, the shared memory and the wgmma count of each variant."""
    from common import compile_sm90a
    from eagle3_ops.triton_kernels import tree_attention as ta

    fn = ta._tree_attention_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "PT": "*i32", "PL": "*i32", "TM": "*i32",
            "LSE": "*fp32", "PO": "*fp32", "PLSE": "*fp32", "ERR": "*i64"}
    pages = -(-(32768 + 16) // PAGE)
    ints = dict(N=16, W=1, HKV=1, NUM_PAGES=pages, CAPACITY=pages * PAGE, PAGE_SIZE=PAGE, NUM_SPLITS=9,
                stride_qt=64 * 576, stride_qh=576, stride_kp=PAGE * 576, stride_ks=576, stride_kh=0,
                stride_vp=PAGE * 576, stride_vs=576, stride_vh=0, stride_pt=pages, stride_ot=64 * 512, stride_oh=512)
    for name, cfg in (variants or {"default": {}, "v_split": dict(v_split=2),
                                   **{",".join(f"{k}={v}" for k, v in c.items()): c for c in SWEEP_V_SPLIT}}).items():
        vs = cfg.get("v_split", 1)
        full = ta.default_config(torch.bfloat16, 576, 512, 16 * 64, True, vs)
        full.update(cfg)
        const = dict(G=64, D1=512, D2=64, DV=512, BLOCK_D1=512 // vs, BLOCK_D2=64, BLOCK_DV=512 // vs,
                     SHARED_V=True, BLOCK_M=full["BLOCK_M"], BLOCK_N=full["BLOCK_N"], SPLIT=True, HAS_LSE=True,
                     V_SPLIT=vs, DOT_PREC="tf32", OP=ta.OP_MLA)
        k, info, _, _ = compile_sm90a(fn, const, dict(ptrs, scale_log2="fp32"), ints, full["num_warps"],
                                      full["num_stages"], "tree_attention_report")
        print(f"{name:<72} shared {k.metadata.shared:>6}  wgmma {k.asm['ptx'].count('wgmma.mma_async'):>3}  {info}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    compile_report()
