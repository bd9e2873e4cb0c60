"""eagle3_ops.compat.sglang at SGLang's EAGLE shapes: each compat function against our native op and against
the plain-PyTorch path, in one run (and sgl-kernel's own kernel where its wheel loads into this torch).

    build       compat   build_tree_kernel_efficient on SGLang's selection (QLEN_ONLY_BITPACKING and
                         FULL_MASK), the topk + sort that selects it not included
                eagle3   torch.ops.eagle3.build_tree at the same B / topk / depth / N (it selects too)
                torch    SGLang's preprocess + build in plain PyTorch (engine/torch_glue.build_tree_into)
    verify      compat   logits.argmax(-1) + verify_tree_greedy, what SGLang's greedy verify runs
                compat-walk  verify_tree_greedy alone (target_predict made beforehand): the compat function
                eagle3   torch.ops.eagle3.verify_greedy on the same logits
                torch    argmax + the walk as tensor ops (engine/torch_glue.verify_greedy)
    sampling    compat   tree_speculative_sampling_target_only on target_probs [B, N, V] fp32
                eagle3   torch.ops.eagle3.verify_sampling on the logits (softmax inside, no draft probs)
    packbits    compat   segment_packbits over B segments of N * (seq + N) mask bits
                torch    one pad + weighted sum per segment (a host loop), what a caller without the kernel writes
    every one   compat   on CUDA tensors compat.sglang calls its C++ op (torch.ops.eagle3._sglang_*,
                         csrc/compat_sglang_*.cu); the case fails if this build lacks it (EAGLE3_CUDA_ONLY
                         without compat_sglang), rather than timing the Triton fallback under its name
                compat-triton  the same compat call on the Triton kernels (kernels = "triton"), what the C++
                         ops replace on the eager path
                compat-torch  the same compat call on compat.sglang's tensor-op path (kernels = "torch"): the
                         PyTorch path the kernels replace
    sgl_kernel  the same call into sgl_kernel, when `import sgl_kernel` works here (else one row says why not)

The last case prints the done-when table (issue 22), per function, shape and timing (graph / eager): compat,
the native op, the PyTorch path it replaces (compat-torch), compat / native (target <= 1.2) and compat /
compat-torch (target < 1), and the Triton kernels' time (compat-triton) beside them; written to
$EAGLE3_BENCH_OUT/compat_ratios.txt too.

Two figures per case: device time of CUDA-graph replays of back-to-back calls over rotated input sets
(graph_time_us) and wall time per eager call with the host launch cost (eager_time_us, bench "<name>/eager").
Bytes: what the call must read and write once (the logits / probabilities dominate verify and sampling).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

from common import eager_time_us, graph_time_us, rotation

import eagle3_ops  # noqa: F401
from eagle3_ops import tree
from eagle3_ops.compat import sglang as compat
from eagle3_ops.engine import torch_glue

V = 163840
BUILD_SHAPES = [(64, 8, 6, 64), (1, 8, 6, 64), (64, 4, 5, 16), (64, 1, 3, 4)]  # (B, topk, depth, N)
VERIFY_SHAPES = [(64, 4, "chain"), (64, 8, "beam"), (1, 8, "beam")]          # (B, N, tree)
EAGER_CALLS = 40
TEMPERATURE = 0.25  # sampling: low enough that the planted argmax tokens are often accepted

try:
    import sgl_kernel  # noqa: F401
    SGL, SGL_WHY = sgl_kernel, ""
except Exception as e:  # noqa: BLE001 - any failure to load is the reason recorded
    SGL, SGL_WHY = None, f"{type(e).__name__}: {e}"[:200]


@contextmanager
def _path(provider):
    """compat-...-torch: compat.sglang's tensor ops on the CUDA tensors (what its kernels replace);
    compat-...-triton: its Triton kernels; any other compat provider: its C++ ops, which must be built."""
    compat.kernels = "auto"
    if provider.startswith("compat"):
        if provider.endswith("-torch"):
            compat.kernels = "torch"
        elif provider.endswith("-triton"):
            compat.kernels = "triton"
        else:
            ops = compat._cuda_ops()
            missing = [name for name, op in zip(ops._fields, ops) if op is None]
            assert not missing, f"this build has no C++ op for {missing}: build with compat_sglang in EAGLE3_CUDA_ONLY"
    try:
        yield
    finally:
        compat.kernels = "auto"


def _time(recorder, bench, shape, provider, calls, nbytes, **extra):
    with _path(provider):
        _timed(recorder, bench, shape, provider, calls, nbytes, **extra)


def _timed(recorder, bench, shape, provider, calls, nbytes, **extra):
    recorder.add(bench, shape, provider, graph_time_us(calls), nbytes, **extra)
    recorder.add(f"{bench}/eager", shape, provider, eager_time_us(calls, EAGER_CALLS), nbytes, **extra)


# ---- build ---------------------------------------------------------------------------------------------------


def sglang_build_inputs(B, topk, depth, N, g):
    """SGLang's drafting (select_top_k_tokens) and preprocess on random log-probabilities: parent_list,
    the sorted selection, lengths; and the same candidates in our [B, depth, topk^2] layout."""
    M = topk * topk if depth > 1 else topk
    scores = torch.full((B, depth, M), float("-inf"), device="cuda")
    parents = torch.full((B, depth, M), -1, dtype=torch.int32, device="cuda")
    scores[:, 0, :topk] = torch.log_softmax(torch.randn(B, 1000, device="cuda", generator=g), -1).topk(topk).values
    plist = [torch.arange(-1, topk, device="cuda").expand(B, topk + 1)]
    for d in range(1, depth):
        beams = scores[:, d - 1].topk(topk).indices
        child = torch.log_softmax(torch.randn(B, topk, 1000, device="cuda", generator=g), -1).topk(topk).values
        scores[:, d] = (scores[:, d - 1].gather(1, beams)[:, :, None] + child).reshape(B, M)
        parents[:, d] = beams.repeat_interleave(topk, 1).int()
        if d >= 2:  # SGLang's parents_list[d - 1]: the beams of depth d - 1 as flat indices (step 0's: plist[0])
            plist.append(beams + topk + (d - 2) * M)
    flat = torch.cat([scores[:, 0, :topk], scores[:, 1:].reshape(B, -1)], 1)
    selected = torch.sort(flat.topk(N - 1, dim=-1).indices, dim=-1).values
    parent_list = torch.cat(plist, 1).contiguous() if depth > 1 else torch.empty(B, 0, dtype=torch.int64, device="cuda")
    seq = torch.randint(0, 8192, (B,), device="cuda", generator=g)
    native = (torch.randint(0, V, (B,), device="cuda", generator=g), torch.randint(0, V, (B, depth, M), device="cuda",
              generator=g), scores, parents, seq.int())
    return parent_list, selected, seq, native


def compat_build_args(parent_list, selected, seq, B, topk, depth, N, mode):
    if mode == compat.TreeMaskMode.QLEN_ONLY_BITPACKING:
        mask = torch.zeros(B * N, dtype={1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[compat._mask_bytes(N)],
                           device="cuda")
    elif mode == compat.TreeMaskMode.QLEN_ONLY:
        mask = torch.ones(B * N * N, dtype=torch.bool, device="cuda")
    else:
        mask = torch.ones(int(seq.sum()) * N + B * N * N, dtype=torch.bool, device="cuda")
    lists = torch.full((3, B, N), -1, device="cuda")
    return (parent_list, selected, seq, mask, torch.empty(B * N, dtype=torch.int64, device="cuda"), *lists, topk,
            depth, N, int(mode))


def native_outs(B, N):
    return (torch.empty(B, N, dtype=torch.int64, device="cuda"), torch.empty(B, N, dtype=torch.int32, device="cuda"),
            torch.empty(B, N, dtype=torch.int64, device="cuda"),
            torch.empty(B, N, (N + 31) // 32, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("provider", ["compat-bitpacked", "compat-full", "compat-bitpacked-triton", "compat-full-triton",
                                      "compat-bitpacked-torch", "compat-full-torch", "eagle3", "torch", "sgl_kernel"])
@pytest.mark.parametrize("B,topk,depth,N", BUILD_SHAPES, ids=[f"B{b}-topk{k}-depth{d}-N{n}" for b, k, d, n in BUILD_SHAPES])
def test_build(recorder, provider, B, topk, depth, N):
    if N > 32 and provider.startswith("compat-bitpacked"):
        pytest.skip("the packed mask holds N <= 32")
    g = torch.Generator(device="cuda").manual_seed(B * N)
    C = depth * topk * topk
    nbytes = B * C * (4 + 4 + 8) + B * N * (8 + 4 + 8 + 4 * ((N + 31) // 32)) + B * 12
    sets = [sglang_build_inputs(B, topk, depth, N, g) for _ in range(min(rotation(nbytes), 8))]
    shape = f"B={B} topk={topk} depth={depth} N={N}"
    if provider == "eagle3":
        calls = [lambda s=s, o=native_outs(B, N): torch.ops.eagle3.build_tree(*s[3], *o) for s in sets]
    elif provider == "torch":
        calls = [lambda s=s, o=native_outs(B, N): torch_glue.build_tree_into(*s[3], *o) for s in sets]
    else:
        mode = compat.TreeMaskMode.FULL_MASK if provider.startswith(("compat-full", "sgl_kernel")) else 2
        if provider == "sgl_kernel" and SGL is None:
            recorder.add("build", shape, "sgl_kernel", float("nan"), nbytes, why_not=SGL_WHY)
            pytest.skip(f"sgl_kernel does not load here: {SGL_WHY}")
        fn = SGL.build_tree_kernel_efficient if provider == "sgl_kernel" else compat.build_tree_kernel_efficient
        calls = [lambda a=compat_build_args(s[0], s[1], s[2], B, topk, depth, N, mode): fn(*a) for s in sets]
    _time(recorder, "build", shape, provider, calls, nbytes)


# ---- verify (greedy) and sampling ------------------------------------------------------------------------------


def verify_inputs(B, N, kind, g, probs: bool):
    parents = tree.random_parents(B, N, torch.Generator().manual_seed(N), kind).cuda()
    logits = torch.randn(B * N, V, device="cuda", generator=g, dtype=torch.bfloat16)
    target = logits.argmax(-1).view(B, N)
    plant = torch.rand(B, N, device="cuda", generator=g) < 0.8  # deep walks, some stopped early
    tokens = torch.where(plant, target.gather(1, parents.long().clamp(min=0)),
                         torch.randint(0, V, (B, N), device="cuda", generator=g))
    _, r_index, r_next, r_sib = tree.to_sglang(tokens, parents)
    out = [torch.empty(B * N + 1, dtype=torch.int32, device="cuda"),
           torch.full((B, N), -1, dtype=torch.int32, device="cuda"), torch.empty(B, dtype=torch.int32, device="cuda")]
    s = dict(logits=logits, tokens=tokens, parents=parents, lists=(r_index, r_next, r_sib), out=out)
    if probs:
        s["probs"] = torch.softmax(logits.float() / TEMPERATURE, -1).view(B, N, V)
        s["coins"] = torch.rand(B, N, device="cuda", generator=g)
        s["final"] = torch.rand(B, device="cuda", generator=g)
    return s


def greedy_call(provider, s):
    if provider == "eagle3":
        return lambda: torch.ops.eagle3.verify_greedy(s["logits"], s["tokens"], s["parents"])
    if provider == "torch":
        return lambda: torch_glue.verify_greedy(s["logits"], s["tokens"], s["parents"])
    fn = compat.verify_tree_greedy if provider.startswith("compat") else SGL.verify_tree_greedy
    B, N = s["tokens"].shape
    if provider.startswith("compat-walk"):  # the compat function alone, on a target_predict made beforehand
        s["target"] = s["logits"].argmax(-1).view(B, N)
        return lambda: fn(*s["out"], s["tokens"], *s["lists"], s["target"])
    return lambda: fn(*s["out"], s["tokens"], *s["lists"], s["logits"].argmax(-1).view(B, N))


@pytest.mark.parametrize("provider", ["compat", "compat-triton", "compat-torch", "compat-walk", "compat-walk-triton",
                                      "compat-walk-torch", "eagle3", "torch", "sgl_kernel"])
@pytest.mark.parametrize("B,N,kind", VERIFY_SHAPES, ids=[f"B{b}-N{n}-{k}" for b, n, k in VERIFY_SHAPES])
def test_verify(recorder, provider, B, N, kind):
    nbytes = B * N * V * 2 + B * N * (8 * 4 + 4) + B * 8
    shape = f"B={B} N={N} {kind} V={V} bf16"
    if provider == "sgl_kernel" and SGL is None:
        recorder.add("verify", shape, "sgl_kernel", float("nan"), nbytes, why_not=SGL_WHY)
        pytest.skip(f"sgl_kernel does not load here: {SGL_WHY}")
    g = torch.Generator(device="cuda").manual_seed(B * N)
    sets = [verify_inputs(B, N, kind, g, probs=False) for _ in range(rotation(nbytes))]
    if provider == "compat":  # same accepted paths as the native op
        s = sets[0]
        greedy_call("compat", s)()
        nodes, alen, _ = torch.ops.eagle3.verify_greedy(s["logits"], s["tokens"], s["parents"])
        assert torch.equal(s["out"][2], alen.clamp(max=N - 1)), "compat accept_token_num differs from verify_greedy"
    _time(recorder, "verify", shape, provider, [greedy_call(provider, s) for s in sets], nbytes)


@pytest.mark.parametrize("provider", ["compat", "compat-triton", "compat-torch", "eagle3", "sgl_kernel"])
@pytest.mark.parametrize("B,N,kind", VERIFY_SHAPES, ids=[f"B{b}-N{n}-{k}" for b, n, k in VERIFY_SHAPES])
def test_sampling(recorder, provider, B, N, kind):
    shape = f"B={B} N={N} {kind} V={V}"
    nbytes = B * N * V * 4 + B * V * 4 + B * N * (8 * 4 + 4 + 4)
    if provider == "sgl_kernel" and SGL is None:
        recorder.add("sampling", shape, "sgl_kernel", float("nan"), nbytes, why_not=SGL_WHY)
        pytest.skip(f"sgl_kernel does not load here: {SGL_WHY}")
    g = torch.Generator(device="cuda").manual_seed(B * N + 1)
    sets = [verify_inputs(B, N, kind, g, probs=True) for _ in range(max(2, rotation(nbytes) // 2))]
    calls = []
    for s in sets:
        if provider == "eagle3":
            t = torch.full((B,), TEMPERATURE, device="cuda")
            seed, off = torch.zeros(B, dtype=torch.int64, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
            calls.append(lambda s=s, t=t, seed=seed, off=off: torch.ops.eagle3.verify_sampling(
                s["logits"], None, None, s["tokens"], s["parents"], t, seed, off))
        else:
            fn = compat.tree_speculative_sampling_target_only if provider.startswith("compat") else \
                SGL.tree_speculative_sampling_target_only
            draft = torch.zeros_like(s["probs"])
            calls.append(lambda s=s, d=draft: fn(*s["out"], s["tokens"], *s["lists"], s["coins"], s["final"],
                                                 s["probs"], d, 1.0, 1.0, True))
    _time(recorder, "sampling", shape, provider, calls, nbytes)


# ---- segment_packbits -----------------------------------------------------------------------------------------


def packbits_torch(x, input_indptr, output_indptr, y, batch_size):
    """One pad + weighted sum per segment (host loop; the offsets read on the host)."""
    ip, op = input_indptr.tolist(), output_indptr.tolist()
    weights = 1 << torch.arange(8, device=x.device, dtype=torch.uint8)
    for s in range(batch_size):
        seg = x[ip[s]:ip[s + 1]]
        seg = torch.nn.functional.pad(seg.to(torch.uint8), (0, (-seg.numel()) % 8)).view(-1, 8)
        y[op[s]:op[s + 1]] = (seg * weights).sum(-1, dtype=torch.uint8)


@pytest.mark.parametrize("provider", ["compat", "compat-triton", "compat-torch", "torch", "sgl_kernel"])
@pytest.mark.parametrize("B,N,seq", [(64, 64, 4096), (1, 64, 32768), (64, 8, 1024)])
def test_packbits(recorder, provider, B, N, seq):
    lengths = torch.full((B,), N * (seq + N), dtype=torch.int32)
    in_ptr = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).cuda()
    out_ptr = torch.cat([torch.zeros(1, dtype=torch.int32), ((lengths + 7) // 8).cumsum(0).int()]).cuda()
    x = torch.rand(int(in_ptr[-1]), device="cuda") < 0.5
    y = torch.empty(int(out_ptr[-1]), dtype=torch.uint8, device="cuda")
    nbytes = x.numel() + y.numel() + 8 * (B + 1)
    shape = f"B={B} N={N} seq={seq}"
    if provider == "sgl_kernel" and SGL is None:
        recorder.add("packbits", shape, "sgl_kernel", float("nan"), nbytes, why_not=SGL_WHY)
        pytest.skip(f"sgl_kernel does not load here: {SGL_WHY}")
    fn = compat.segment_packbits if provider.startswith("compat") else (
        packbits_torch if provider == "torch" else SGL.segment_packbits)
    if provider == "torch":  # host reads: eager only
        recorder.add("packbits/eager", shape, provider, eager_time_us([lambda: fn(x, in_ptr, out_ptr, y, B)], 10),
                     nbytes)
        return
    _time(recorder, "packbits", shape, provider, [lambda: fn(x, in_ptr, out_ptr, y, B)], nbytes)


# ---- the done-when table ---------------------------------------------------------------------------------------

NATIVE = {"build": "eagle3", "verify": "eagle3", "sampling": "eagle3", "packbits": None}


def ratio_table(rows, native: dict, torch_of=lambda p: f"{p}-torch",
                targets: str = "compat / native <= 1.2, compat / torch path < 1") -> str:
    """Per (bench, shape) and compat provider: its time, the native op's, the PyTorch path's (provider
    torch_of(compat provider)), and the two ratios; graph rows first, then the eager ones. The Triton path's
    time (provider "<compat provider>-triton"), where it was timed, stands in the last column."""
    us = {(r.bench, r.shape, r.provider): r.us for r in rows}
    out = [f"done-when ({targets}); us per call",
           f"{'bench':<16} {'shape':<34} {'compat':<18} {'us':>8} {'native':>8} {'torch':>8} {'/native':>8} "
           f"{'/torch':>8}  ok  {'triton':>8}"]
    for timing in ("graph", "eager"):
        for (bench, shape, provider), t in us.items():
            base = bench.split("/")[0]
            if (timing == "eager") != bench.endswith("/eager") or not provider.startswith("compat") or \
                    provider.endswith(("-torch", "-triton")) or base not in native:
                continue
            nat = us.get((bench, shape, native[base])) if native[base] else None
            tor = us.get((bench, shape, torch_of(provider)))
            tri = us.get((bench, shape, f"{provider}-triton"), float("nan"))
            r_nat = t / nat if nat else float("nan")
            r_tor = t / tor if tor else float("nan")
            ok = (r_nat <= 1.2 or nat is None) and (r_tor < 1 or tor is None)
            out.append(f"{bench:<16} {shape:<34} {provider:<18} {t:>8.2f} {nat or float('nan'):>8.2f} "
                       f"{tor or float('nan'):>8.2f} {r_nat:>8.2f} {r_tor:>8.2f}  {'yes' if ok else 'NO ':<3} "
                       f"{tri:>8.2f}")
    return "\n".join(out)


def print_ratios(recorder, capsys, native: dict, name: str, **kw) -> None:
    table = ratio_table(recorder.rows, native, **kw)
    with capsys.disabled():
        print("\n" + table)
    folder = os.environ.get("EAGLE3_BENCH_OUT")
    if folder:
        with open(os.path.join(folder, f"{name}.txt"), "w") as f:
            f.write(table + "\n")


def test_zz_ratios(recorder, capsys):
    print_ratios(recorder, capsys, NATIVE, "compat_ratios")
