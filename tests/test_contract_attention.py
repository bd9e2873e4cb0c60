"""tree_attention_mla and tree_attention under the one input contract (eagle3_ops/errors.py, tests/contract.py):
a page id out of [0, num_pages) in a slot that covers positions [0, prefix + N), or a prefix length out of
[0, capacity - N], raises the same Eagle3InputError on CPU as the GPU's error word decodes to, for every kernel
(GQA Triton; MLA's Triton v1, mla_decode with TMA and gathered tiles, and the sm90 CUDA kernel); CUDA writes NaN
in every row of out and lse of that request and computes the others. Page-table slots past a request's length
hold garbage in every case here (an engine's table does): nobody reads or reports them.

Also: grids that tile any batch (the drafter's 64 KV heads at B 1024; MLA past 65535 requests) and the sm90
kernel's fallback when the build has no sm_90a code."""

from __future__ import annotations

import os
import re

import pytest
import torch

import eagle3_ops
from eagle3_ops import tree
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import TOLERANCES, poison_, rel_err, skip_unless_sm90_kernel
from tests.contract import expect_cpu, expect_cuda, expect_cuda_graph

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")

# The layout of every contract case: page size 64, 3 table slots (capacity 192), N 3. Request 0's tree crosses
# into slot 1 (positions 62..64: slot 1 holds only a tree row), request 1 fits slot 0, request 2 reads all three
# slots (slot 0 a whole 64-key tile). 6 pages used + 2 spare: valid page ids 0..7.
PAGE_SIZE, SLOTS, N, PREFIXES, NUM_PAGES = 64, 3, 3, (62, 5, 130), 8
CAP = PAGE_SIZE * SLOTS
SHAPES = {"gqa": dict(mla=False, NH=8, HKV=2, D=16, Dv=24),  # NH / HKV = 4, Dv != Dh
          "mla": dict(mla=True, NH=4, HKV=1, D=40, Dv=32),  # tiny latent (32 + 8 rope dims)
          "kimi": dict(mla=True, NH=16, HKV=1, D=576, Dv=512),  # the sm90 kernel's widths, fewer heads
          "kimi2": dict(mla=True, NH=2, HKV=1, D=576, Dv=512),  # the same, 2 heads (batches past 65535)
          "drafter": dict(mla=False, NH=64, HKV=64, D=128, Dv=128)}  # the Kimi drafter's layer
OP_NAME = {"gqa": "tree_attention", "mla": "tree_attention_mla", "kimi": "tree_attention_mla"}
# (arg, index, value) -> the one violation of a case; `valid` is the same inputs without it
BAD = {"page_past_tree_slot": ("page_table", (0, 1), 99999),  # slot 1 of request 0: read by the tree block only
       "page_just_past": ("page_table", (2, 0), NUM_PAGES),  # a whole prefix tile of request 2
       "page_negative": ("page_table", (2, 2), -1),  # prefix and tree rows of request 2's last slot
       "prefix_negative": ("prefix_lens", (1,), -3),
       "prefix_past_capacity": ("prefix_lens", (1,), CAP - N + 1)}  # its slots 1, 2 hold garbage: not reported


def message(op, bad):
    arg, index, value = BAD[bad]
    hi = NUM_PAGES - 1 if arg == "page_table" else CAP - N
    return f"{op}: {arg}[{', '.join(map(str, index))}] = {value} is out of range (valid: 0..{hi})"


def inputs(shape, dtype=torch.float32, B=None, prefixes=PREFIXES, n=N, page_size=PAGE_SIZE, slots=SLOTS, seed=0):
    """Valid inputs on the CPU: a shuffled page table (unused slots hold garbage ids), caches, q, tree_mask."""
    s = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    prefixes = list(prefixes) if B is None else [prefixes[0]] * B
    B = len(prefixes)
    need = [-(-(p + n) // page_size) for p in prefixes]
    pages = sum(need) + 2
    perm = torch.randperm(pages, generator=g).int()
    page_table = torch.randint(-9, 1 << 20, (B, slots), generator=g, dtype=torch.int32)  # garbage past the length
    k = 0
    for b, m in enumerate(need):
        page_table[b, :m] = perm[k:k + m]
        k += m
    cache = (pages, page_size) if s["mla"] else (pages, page_size, s["HKV"])
    t = dict(q=torch.randn(B * n, s["NH"], s["D"], generator=g).to(dtype),
             k_cache=torch.randn(*cache, s["D"], generator=g).to(dtype),
             page_table=page_table, prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
             tree_mask=tree.tree_mask(tree.random_parents(B, n, g, "bushy")))
    if not s["mla"]:
        t["v_cache"] = torch.randn(*cache, s["Dv"], generator=g).to(dtype)
    return t


def op_args(shape, t, out, lse):
    caches = (t["k_cache"],) if SHAPES[shape]["mla"] else (t["k_cache"], t["v_cache"])
    return (t["q"], *caches, t["page_table"], t["prefix_lens"], t["tree_mask"], SHAPES[shape]["D"] ** -0.5, out, lse)


def run(shape, t, config=None):
    """Outputs poisoned, then one call: the op (the reference on CPU tensors, the registered launcher on CUDA), or
    with a config the Triton launcher itself (kernel selection; on CPU tensors: the interpreter)."""
    from eagle3_ops.triton_kernels import tree_attention as ta

    s, q = SHAPES[shape], t["q"]
    out = poison_(torch.empty(q.shape[0], s["NH"], s["Dv"], dtype=q.dtype, device=q.device))
    lse = poison_(torch.empty(q.shape[0], s["NH"], device=q.device))
    args = op_args(shape, t, out, lse)
    if config is None:
        (torch.ops.eagle3.tree_attention_mla if s["mla"] else torch.ops.eagle3.tree_attention)(*args)
    else:
        (ta.tree_attention_mla if s["mla"] else ta.tree_attention)(*args, config=config)
    return out, lse


def truth(shape, t):
    """float64 out and lse of valid inputs, through the CPU reference."""
    t64 = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()) for k, v in t.items()}
    return run(shape, t64)


def corrupt(t, bad):
    arg, index, value = BAD[bad]
    t[arg][index] = value
    return index[0]  # the request


def check_skipped(out, lse, request, ref):
    """The bad request's rows of out and lse NaN (all nodes, all heads), every other row as the reference."""
    rows = slice(request * N, (request + 1) * N)
    assert torch.isnan(out[rows]).all() and torch.isnan(lse[rows]).all(), "the bad request's rows are not all NaN"
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[rows] = False
    err = rel_err(out[keep.to(out.device)], ref[0][keep].to(out.device))
    assert err <= TOLERANCES[out.dtype], f"out of the other requests: rel err {err:.3g}"
    lse_err = rel_err(lse[keep.to(lse.device)], ref[1][keep].to(lse.device))
    assert lse_err <= TOLERANCES[torch.float32], f"lse of the other requests: rel err {lse_err:.3g}"


def case(shape, bad, dtype=torch.float32, config=None):
    """tests/contract.py's make(device): the reference on CPU, the kernel `config` picks on CUDA."""
    def make(device):
        t = inputs(shape, dtype)
        corrupt(t, bad)
        t = {k: v.to(device) for k, v in t.items()}
        outs = []

        def call():
            outs[:] = run(shape, t, None if device == "cpu" else config)

        def guard():
            return outs + [t["q"], t["k_cache"], t["page_table"], t["prefix_lens"], t["tree_mask"]]

        return call, guard
    return make


def expected_cuda(shape, bad, dtype):
    t = inputs(shape, dtype)
    ref = truth(shape, t)
    request = BAD[bad][1][0]
    return lambda guarded: check_skipped(guarded[0], guarded[1], request, ref)


# ---- CPU: the reference --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_cpu_raises_the_contract_message(shape, bad):
    expect_cpu(case(shape, bad), message(OP_NAME[shape], bad))


@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_cpu_slots_past_the_length_are_not_read(shape):
    # every request's unused slots hold garbage ids (inputs()); changing them changes nothing
    t = inputs(shape)
    out, lse = run(shape, t)
    for b, p in enumerate(PREFIXES):
        t["page_table"][b, -(-(p + N) // PAGE_SIZE):] = -123456
    out2, lse2 = run(shape, t)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_cpu_messages_of_the_brief():
    # the wording, spelled out once: a page id past a 64-page cache, a negative prefix length
    t = inputs("mla")
    t["page_table"][0, 0] = 99999
    with pytest.raises(Eagle3InputError, match=re.escape("tree_attention_mla: page_table[0, 0] = 99999 is out of "
                                                         "range (valid: 0..7)") + "$"):
        run("mla", t)
    t = inputs("gqa")
    t["prefix_lens"][1] = -3
    with pytest.raises(Eagle3InputError, match=re.escape("tree_attention: prefix_lens[1] = -3 is out of range "
                                                         "(valid: 0..189)") + "$"):
        run("gqa", t)


# ---- the Triton kernels on CPU tensors (TRITON_INTERPRET=1) ------------------------------------------------

# kernel selections of triton_kernels/tree_attention.tree_attention_mla at small widths (splits=2: the merge too)
MLA_TRITON = {"v1": dict(kernel="v1", splits=2),
              "mla_decode.tma": dict(kernel="mla_decode", tma=True, BLOCK_N=16, splits=2),
              "mla_decode.gather": dict(kernel="mla_decode", tma=False, BLOCK_N=32, splits=2)}
INTERPRETED = [("gqa", dict(splits=2))] + [("mla", c) for c in MLA_TRITON.values()]


@interpreted
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("shape, config", INTERPRETED, ids=["gqa"] + list(MLA_TRITON))
def test_interpreted_kernels_record_the_violation(shape, config, bad):
    eagle3_ops.check_errors("cpu")  # nothing left over
    ref = truth(shape, inputs(shape))
    t = inputs(shape)
    request = corrupt(t, bad)
    out, lse = run(shape, t, config)
    with pytest.raises(Eagle3InputError, match="^" + re.escape(message(OP_NAME[shape], bad)) + "$"):
        eagle3_ops.check_errors("cpu")
    check_skipped(out, lse, request, ref)


@interpreted
@pytest.mark.parametrize("shape, config", [("gqa", dict(splits=1)), ("mla", dict(MLA_TRITON["mla_decode.tma"],
                                                                              splits=1))], ids=["gqa", "mla"])
def test_interpreted_fp16_one_split(shape, config):
    # fp16, unsplit (out and lse written by the kernel itself): the same record and rows
    eagle3_ops.check_errors("cpu")
    ref = truth(shape, inputs(shape, torch.float16))
    t = inputs(shape, torch.float16)
    request = corrupt(t, "page_negative")
    out, lse = run(shape, t, config)
    with pytest.raises(Eagle3InputError, match="^" + re.escape(message(OP_NAME[shape], "page_negative")) + "$"):
        eagle3_ops.check_errors("cpu")
    check_skipped(out, lse, request, ref)


@interpreted
@pytest.mark.parametrize("shape, config", INTERPRETED, ids=["gqa"] + list(MLA_TRITON))
def test_interpreted_garbage_past_the_length_is_not_reported(shape, config):
    eagle3_ops.check_errors("cpu")
    t = inputs(shape)
    out, lse = run(shape, t, config)
    eagle3_ops.check_errors("cpu")  # raises if the kernel read a garbage slot
    ref = truth(shape, t)
    assert rel_err(out, ref[0]) <= TOLERANCES[torch.float32] and rel_err(lse, ref[1]) <= TOLERANCES[torch.float32]


# ---- CUDA -----------------------------------------------------------------------------------------------

GPU_KERNELS = {"gqa": ("gqa", None),  # the registered launcher
               "mla.v1": ("kimi", dict(kernel="v1")),
               "mla.v1.split": ("kimi", dict(kernel="v1", splits=2)),
               "mla_decode.tma": ("kimi", dict(kernel="mla_decode", tma=True)),  # page size 64: TMA tiles
               "mla_decode.gather.split": ("kimi", dict(kernel="mla_decode", tma=False, splits=2)),
               "sm90": ("kimi", dict(kernel="sm90")),
               "sm90.split": ("kimi", dict(kernel="sm90", splits=2))}


def _needs(kernel):
    if kernel.startswith("sm90"):
        skip_unless_sm90_kernel()


@pytest.mark.gpu
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("kernel", list(GPU_KERNELS))
def test_cuda_records_the_violation(kernel, bad):
    _needs(kernel)
    shape, config = GPU_KERNELS[kernel]
    expect_cuda(case(shape, bad, torch.bfloat16, config), message(OP_NAME[shape], bad),
                expected_cuda(shape, bad, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["page_past_tree_slot", "prefix_past_capacity"])
@pytest.mark.parametrize("kernel", list(GPU_KERNELS))
def test_cuda_graph_records_the_violation(kernel, bad):
    _needs(kernel)
    shape, config = GPU_KERNELS[kernel]
    expect_cuda_graph(case(shape, bad, torch.bfloat16, config), message(OP_NAME[shape], bad))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(GPU_KERNELS))
def test_cuda_garbage_past_the_length_is_not_reported(kernel):
    _needs(kernel)
    shape, config = GPU_KERNELS[kernel]
    eagle3_ops.check_errors()
    t = inputs(shape, torch.bfloat16)
    ref = truth(shape, t)
    out, lse = run(shape, {k: v.cuda() for k, v in t.items()}, config)
    eagle3_ops.check_errors()  # raises if a garbage slot was read
    assert rel_err(out, ref[0].cuda()) <= TOLERANCES[torch.bfloat16]
    assert rel_err(lse, ref[1].cuda()) <= TOLERANCES[torch.float32]


def _truth_uniform(shape, t):
    """float64 out and lse on the GPU, all requests at once (every request the same prefix length)."""
    s, q = SHAPES[shape], t["q"].double()
    B, n = t["tree_mask"].shape[:2]
    P = int(t["prefix_lens"][0])
    ps = t["k_cache"].shape[1]
    pos = torch.arange(P + n, device=q.device)
    pages = t["page_table"][:, pos // ps].long()  # [B, L]
    k = t["k_cache"][pages, pos % ps].double()  # [B, L, (HKV,) D]
    if s["mla"]:
        k = k[:, :, None]
        v = k[..., :s["Dv"]]
    else:
        v = t["v_cache"][pages, pos % ps].double()
    group = s["NH"] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)  # [B, L, NH, .]
    visible = torch.cat([torch.ones(B, n, P, dtype=torch.bool, device=q.device),
                         tree.mask_to_dense(t["tree_mask"].cpu(), n).to(q.device)], 2)  # [B, N, L]
    scores = torch.einsum("bnhd,blhd->bnhl", q.view(B, n, s["NH"], -1), k) * s["D"] ** -0.5
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("bnhl,blhd->bnhd", torch.exp(scores - lse[..., None]), v)
    return out.reshape(B * n, s["NH"], -1), lse.reshape(B * n, s["NH"])


def _check_uniform(shape, t, config):
    out, lse = run(shape, t, config)
    ref_out, ref_lse = _truth_uniform(shape, t)
    assert rel_err(out, ref_out) <= TOLERANCES[out.dtype], f"out: rel err {rel_err(out, ref_out):.3g}"
    assert rel_err(lse, ref_lse) <= TOLERANCES[torch.float32], f"lse: rel err {rel_err(lse, ref_lse):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, dict(splits=2)], ids=["default", "split"])
def test_cuda_gqa_b1024_of_64_kv_heads(config):
    # B x HKV = 65536 (row block) programs: past grid axis 1's 65535 before; the merge's B x HKV x N x G rows too
    t = inputs("drafter", torch.bfloat16, B=1024, prefixes=(3,), n=2, page_size=16, slots=2)
    _check_uniform("drafter", {k: v.cuda() for k, v in t.items()}, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, dict(kernel="v1", splits=2), dict(kernel="mla_decode", tma=False, splits=2)],
                         ids=["default", "v1.split", "mla_decode.split"])
def test_cuda_mla_past_65535_requests(config):
    # B 65539: the sm90 kernel (B on its grid's axis 1) refuses, the Triton kernels take any batch
    from eagle3_ops.triton_kernels.mla_decode import sm90_supported

    t = {k: v.cuda() for k, v in inputs("kimi2", torch.bfloat16, B=65539, prefixes=(3,), n=1, page_size=4,
                                        slots=1).items()}
    out = torch.empty(t["q"].shape[0], 2, 512, dtype=torch.bfloat16, device="cuda")
    assert not sm90_supported(t["q"], t["k_cache"], out, t["page_table"], t["tree_mask"])
    _check_uniform("kimi2", t, config)


@pytest.mark.gpu
def test_cuda_sm90_at_65535_requests():
    skip_unless_sm90_kernel()
    t = {k: v.cuda() for k, v in inputs("kimi2", torch.bfloat16, B=65535, prefixes=(3,), n=1, page_size=4,
                                        slots=1).items()}
    _check_uniform("kimi2", t, dict(kernel="sm90", splits=2))


# ---- the sm90 kernel only where the build really holds it ----------------------------------------------------


@pytest.mark.parametrize("compiled", [True, False])
def test_sm90_probe_reads_the_internal_ops_refusal(monkeypatch, compiled):
    # mla_decode.sm90_compiled: the internal op on empty inputs returns (sm_90a code) or raises
    # NotImplementedError (a trap-only build); asked once per device (here the meta device, with the op mocked)
    from eagle3_ops.triton_kernels import mla_decode

    calls = []

    def op(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits):
        calls.append(q.shape)
        if not compiled:
            raise NotImplementedError("no sm_90a code")

    monkeypatch.setattr(torch.ops.eagle3, "_tree_attention_mla_sm90", op)
    monkeypatch.setattr(mla_decode, "_SM90A", {})
    meta = torch.device("meta")
    assert mla_decode.sm90_compiled(meta) is compiled and mla_decode.sm90_compiled(meta) is compiled
    assert calls == [(0, 1, 576)]


@pytest.mark.gpu
def test_cuda_sm90_probe_matches_the_build():
    # a build without 9.0a in TORCH_CUDA_ARCH_LIST compiles the kernel's body to a trap: the probe says so
    from eagle3_ops import _C
    from eagle3_ops.triton_kernels.mla_decode import sm90_compiled

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("a Hopper GPU")
    archs = re.split(r"[;\s]+", _C.build_info()["cuda_archs"])
    assert sm90_compiled(torch.device("cuda", torch.cuda.current_device())) == any(a.startswith("9.0a") for a in archs)


@pytest.mark.gpu
def test_cuda_sm90_not_compiled_falls_back_to_triton(monkeypatch):
    # the probe mocked to "no sm_90a code": not supported, the default call takes the Triton kernel (correctly),
    # and insisting on the sm90 kernel is a clean ValueError
    from eagle3_ops.triton_kernels import mla_decode

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("a Hopper GPU")
    t = {k: v.cuda() for k, v in inputs("kimi", torch.bfloat16).items()}
    out = torch.empty(t["q"].shape[0], 16, 512, dtype=torch.bfloat16, device="cuda")
    assert mla_decode.sm90_supported(t["q"], t["k_cache"], out, t["page_table"], t["tree_mask"])
    monkeypatch.setattr(mla_decode, "sm90_compiled", lambda device: False)

    def trap(*args, **kwargs):
        raise AssertionError("the sm90 kernel was picked")

    monkeypatch.setattr(mla_decode, "tree_attention_mla_sm90", trap)
    assert not mla_decode.sm90_supported(t["q"], t["k_cache"], out, t["page_table"], t["tree_mask"])
    ref = truth("kimi", t)
    got = run("kimi", t)
    assert rel_err(got[0], ref[0].cuda()) <= TOLERANCES[torch.bfloat16]
    with pytest.raises(ValueError, match="config kernel 'sm90' needs"):
        run("kimi", t, dict(kernel="sm90"))


@pytest.mark.gpu
def test_cuda_runs_on_the_tensors_device():
    # on a second GPU (the current device left at 0): the sm90 kernel, the Triton kernels and the merge on cuda:1
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    t = inputs("kimi", torch.bfloat16)
    ref = truth("kimi", t)
    t1 = {k: v.to("cuda:1") for k, v in t.items()}
    for config in (None, dict(kernel="mla_decode", splits=2), dict(kernel="v1", splits=2)):
        out, lse = run("kimi", t1, config)
        torch.cuda.synchronize(1)
        assert rel_err(out, ref[0].to("cuda:1")) <= TOLERANCES[torch.bfloat16], config
    assert torch.cuda.current_device() == 0
