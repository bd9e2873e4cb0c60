"""tree_attention_mla over an fp8 e4m3 latent cache (kv_scale: key = fp8 * kv_scale, vLLM's per-tensor MLA
k_scale), the fp8 cache writes (models.cache) and kv_accept on fp8 caches.

The error rule (docs/kernels/tree_attention_mla_fp8.md): the kernel is compared with the float64 reference on
the *dequantised* cache (fp8 * kv_scale, exact in float64), with the same bound as a bf16 / fp16 cache,
||out - ref|| / ||ref|| <= TOLERANCES[q's dtype] (bf16 1e-2, fp16 2e-3) and lse <= TOLERANCES[fp32]: an e4m3
value is exactly a bf16 / fp16 value and the scale is folded into fp32 factors, so the kernel adds no rounding
that a bf16 cache does not have. What the quantisation itself costs (fp8 rows against the rows they came from)
is the storage format's error, not the kernel's: test_quantisation_error_against_the_unquantised_rows bounds it.
Both CUDA kernels that read an fp8 cache are held to it: the sm90 kernel's fp8 build (the op's route on the H200,
test_gpu_sm90_*) and mla_decode's Triton kernel (the fallback: the interpreter tests here, test_gpu_against_float64).
"""

from __future__ import annotations

import re
import zlib

import pytest
import torch

import eagle3_ops
from eagle3_ops import reference, tree
from eagle3_ops.errors import Eagle3InputError
from eagle3_ops.models.cache import FP8_MAX, PagedKV, fp8_dequantize, fp8_quantize
from tests.conftest import TOLERANCES, assert_equal, capture_graph, poison_, rel_err
from tests.test_tree_attention import (KIMI_MLA, KIMI_SCALE, Case, GpuCase, _check_against,
                                       check_bad_values_poison_only_their_request, interpreted, replay_with_new_values)

FP8 = torch.float8_e4m3fn


def quantised(c, scale_of_amax: float = 1.0):
    """c's cache quantised in place of the original: c.k8 (fp8) and c.kv_scale ([] fp32, amax / 448 times
    scale_of_amax: 1 uses e4m3's whole range), and c.k_cache replaced by the exact dequantisation in float64, which
    the truth reads. Returns c."""
    amax = c.k_cache.float().abs().amax()
    c.kv_scale = (amax / FP8_MAX * scale_of_amax).reshape(()).to(torch.float32)
    c.k8 = fp8_quantize(c.k_cache, c.kv_scale)
    c.k_cache = fp8_dequantize(c.k8, c.kv_scale, torch.float64)
    return c


def run_fp8(c, config=None, with_lse=True, kernel=False):
    """tree_attention_mla on the fp8 cache, outputs poisoned first: through torch.ops (CPU: the reference; CUDA:
    the registered launcher), or with kernel=True mla_decode's launcher itself (the interpreter on CPU)."""
    from eagle3_ops.triton_kernels.tree_attention import tree_attention_mla_op

    out = poison_(torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device=c.q.device))
    lse = poison_(torch.empty(c.q.shape[0], c.NH, device=c.q.device)) if with_lse else None
    args = (c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, lse, c.kv_scale)
    if kernel:
        tree_attention_mla_op(*args, config=config)
    else:
        torch.ops.eagle3.tree_attention_mla(*args)
    return out, lse


def fp8_case(gen, *, prefixes=(0, 17, 70), N=7, kind="bushy", page_size=16, NH=4, D=64, Dv=48,
             dtype=torch.float16, scale=None):
    # D 64 / Dv 48: fp8 rows whose latent part (48 bytes) and rope part (16 bytes) are whole 16-byte TMA boxes,
    # the second latent half [32, 64) partly past Dv
    return quantised(Case(gen, mla=True, prefixes=list(prefixes), N=N, kind=kind, page_size=page_size, NH=NH, D=D,
                          Dv=Dv, dtype=dtype, scale=scale))


# ---- the reference (CPU) --------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])  # SGLang's token layout, typical, large
@pytest.mark.parametrize("prefixes, N, kind", [
    ([0, 0, 0], 1, "chain"),  # prefix 0, N 1: a node sees only itself
    ([0, 17, 70], 7, "bushy"),  # ragged, crossing page boundaries at 16 and 64
    ([15, 16, 63], 33, "chain"),  # trees that start on a page's last slot / at a page start; two mask words
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_equals_float64_on_the_dequantised_cache(gen, page_size, prefixes, N, kind, dtype):
    c = fp8_case(gen, prefixes=prefixes, N=N, kind=kind, page_size=page_size, dtype=dtype)
    out, lse = run_fp8(c)
    ref_out, ref_lse = c.truth()
    assert rel_err(out, ref_out) <= TOLERANCES[dtype]  # the reference computes in fp32, rounds out to q's dtype
    assert rel_err(lse, ref_lse) <= TOLERANCES[torch.float32]


def test_reference_scale_is_applied_to_every_dim(gen):
    # The same fp8 bytes under two scales: the scores (latent and rope dims alike) and V both scale with it.
    c = fp8_case(gen, N=3)
    out1, lse1 = run_fp8(c)
    c.kv_scale = c.kv_scale * 2
    out2, lse2 = run_fp8(c)
    k2 = fp8_dequantize(c.k8, c.kv_scale, torch.float64)
    o = torch.empty_like(out2, dtype=torch.float64)
    lse64 = torch.empty_like(lse2)
    reference.tree_attention_mla(c.q.double(), k2, c.page_table, c.prefix_lens, c.tree_mask, c.scale, o, lse64)
    assert rel_err(out2, o) <= TOLERANCES[torch.float16] and rel_err(lse2, lse64) <= TOLERANCES[torch.float32]
    assert rel_err(out1, out2) > 0.1  # the scale is not ignored


def test_strided_q_out_and_page_table(gen):
    # q and out as row slices of larger tensors (row stride free, last dim contiguous), the page table a row slice
    c = fp8_case(gen, prefixes=[3, 40], N=4, dtype=torch.float16)
    want, want_lse = run_fp8(c)
    T, NH, D = c.q.shape
    big_q = torch.zeros(T, NH + 3, D + 8, dtype=c.q.dtype)
    big_q[:, :NH, :D] = c.q
    big_out = torch.full((T, NH + 1, c.Dv + 5), float("nan"), dtype=c.q.dtype)
    big_pt = torch.zeros(2, c.page_table.shape[1] + 7, dtype=torch.int32)
    big_pt[:, :c.page_table.shape[1]] = c.page_table
    out = big_out[:, :NH, :c.Dv]
    lse = torch.empty(T, NH)
    torch.ops.eagle3.tree_attention_mla(big_q[:, :NH, :D], c.k8, big_pt[:, :c.page_table.shape[1]], c.prefix_lens,
                                        c.tree_mask, c.scale, out, lse, c.kv_scale)
    assert_equal(out, want, "strided out")
    assert_equal(lse, want_lse, "lse")


def test_wrapper_passes_kv_scale(gen):
    c = fp8_case(gen, N=2)
    want, want_lse = run_fp8(c)
    out, lse = eagle3_ops.ops.tree_attention_mla(c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale,
                                                 kv_scale=c.kv_scale, return_lse=True, v_dim=c.Dv)
    assert_equal(out, want, "out")
    assert_equal(lse, want_lse, "lse")


def test_opcheck_fp8(gen):
    c = fp8_case(gen, N=2, prefixes=[1, 5])
    out = torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype)
    # (opcheck's test_schema perturbs every input arithmetically, which CPU torch has no fp8 kernel for; the
    # schema's aliasing is checked on the bf16 path in tests/test_registration.py)
    torch.library.opcheck(torch.ops.eagle3.tree_attention_mla.default,
                          (c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None, c.kv_scale),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("change, error, match", [
    ("no_scale", ValueError, r"kv_scale \[\] or \[1\] float32 is required with an fp8 kv_cache"),
    ("scale_with_fp16_cache", ValueError, "kv_scale must be None with a float16 kv_cache"),
    ("q_fp32", TypeError, "q must have dtype bfloat16 | float16 with an fp8 kv_cache"),
    ("scale_fp64", TypeError, "kv_scale must have dtype float32"),
    ("scale_two", ValueError, r"kv_scale must have shape \(\) or \(1,\)"),
    ("scale_2d", ValueError, r"kv_scale must have shape \(\) or \(1,\)"),
    ("scale_meta", ValueError, "kv_scale must be on the same device as q"),
    ("fp8_out", TypeError, "out must have dtype float16"),
    ("e5m2_cache", TypeError, "kv_cache must have dtype float16 | float8_e4m3fn"),
])
def test_bad_arguments(gen, change, error, match):
    c = fp8_case(gen, N=2, prefixes=[1, 5])
    out = poison_(torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype))
    a = dict(q=c.q, kv_cache=c.k8, page_table=c.page_table, prefix_lens=c.prefix_lens, tree_mask=c.tree_mask,
             scale=c.scale, out=out, lse=None, kv_scale=c.kv_scale)
    if change == "no_scale":
        a["kv_scale"] = None
    elif change == "scale_with_fp16_cache":
        a["kv_cache"] = c.k_cache.half()
    elif change == "q_fp32":
        a["q"], a["out"] = c.q.float(), out.float()
    elif change == "scale_fp64":
        a["kv_scale"] = c.kv_scale.double()
    elif change == "scale_two":
        a["kv_scale"] = c.kv_scale.repeat(2)
    elif change == "scale_2d":
        a["kv_scale"] = c.kv_scale.reshape(1, 1)
    elif change == "scale_meta":
        a["kv_scale"] = c.kv_scale.to("meta")
    elif change == "fp8_out":
        a["out"] = out.to(FP8)
    elif change == "e5m2_cache":
        a["kv_cache"] = c.k8.to(torch.float8_e5m2)
    with pytest.raises(error, match=match):
        torch.ops.eagle3.tree_attention_mla(*a.values())
    assert torch.isnan(out).all(), "a refused call wrote into out"

# a kv_scale value that is not finite and > 0: raised by the reference, recorded by the kernel, one message
BAD_SCALE = r"^tree_attention_mla: kv_scale = {} must be finite and > 0$"


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale_value_raises_on_cpu(gen, value):
    c = fp8_case(gen, N=2, prefixes=[1, 5])
    c.kv_scale = torch.tensor(value)
    with pytest.raises(Eagle3InputError, match=BAD_SCALE.format(re.escape(repr(value)))):
        run_fp8(c)


# ---- the cache writes and kv_accept ----------------------------------------------------------------------


def test_fp8_quantize_is_vllms_rule():
    # x / scale in fp32, saturated to +-448 (vLLM's satfinite conversion), round to nearest even, NaN kept
    s = torch.tensor(0.5)
    x = torch.tensor([0.0, 1.0, -1.0, 224.0, 225.0, 1e6, -1e6, 0.5 * 2.0**-9, 0.5 * 3 * 2.0**-10, float("nan")])
    got = fp8_quantize(x, s).float()
    want = torch.tensor([0.0, 2.0, -2.0, 448.0, 448.0, 448.0, -448.0, 2.0**-9, 2.0**-8, float("nan")])
    # 0.5 * 3 * 2^-10 / 0.5 = 1.5 * 2^-9: halfway between subnormals 2^-9 and 2^-8, to even (2 * 2^-9)
    assert_equal(got, want, "fp8_quantize")
    assert_equal(fp8_dequantize(fp8_quantize(x, s), s), want * 0.5, "fp8_dequantize")


def test_quantisation_error_against_the_unquantised_rows(gen):
    # The storage format's error (not the kernel's): e4m3 keeps 3 mantissa bits, so a normal value is within 2^-4
    # of itself relatively, and a value below the normal range within half a subnormal step (2^-10 * scale).
    x = torch.randn(64, 576, generator=gen) * 3
    s = (x.abs().amax() / FP8_MAX).reshape(())
    back = fp8_dequantize(fp8_quantize(x, s), s)
    assert bool(((back - x).abs() <= x.abs() * 2.0**-4 + s * 2.0**-10 + 1e-12).all())
    # and attention over such a cache against the unquantised one: 5.3% here (random 576-dim rows at Kimi's
    # scale give scores of std ~3, a peaked softmax that amplifies the keys' rounding); bounded at 8%
    c = Case(gen, mla=True, prefixes=[40, 90], N=4, kind="bushy", page_size=16, NH=8, D=576, Dv=512,
             dtype=torch.float32, scale=KIMI_SCALE)
    exact, _ = c.truth()
    quantised(c)
    fp8_out, _ = c.truth()
    assert rel_err(fp8_out, exact) <= 0.08


def test_paged_kv_fp8_write_then_attention(gen):
    # models.cache.PagedKV with fp8 caches: write quantises with the layer's scale, tree_attention_mla reads the
    # rows back through kv.scale(i), kv_accept moves them as bytes
    B, N, NH, D, Dv = 2, 4, 4, 64, 48
    kv = PagedKV([(D,), (D,)], B, 64, page_size=16, dtype=FP8, kv_scale=[0.01, 0.02], seed=3)
    rows = torch.randn(B, 10, D, generator=gen)
    kv.write(1, rows)
    kv.advance(6)  # positions 0..5 kept as prefix, 6..9 the tree
    stored = kv.caches[1][kv.index(torch.arange(10).expand(B, 10))]
    assert_equal(stored.view(torch.uint8), fp8_quantize(rows, kv.scale(1)).view(torch.uint8), "written bytes")
    parents = tree.random_parents(B, N, gen, "bushy")
    tm = tree.tree_mask(parents)
    q = torch.randn(B * N, NH, D, generator=gen).half()
    out = torch.empty(B * N, NH, Dv, dtype=torch.half)
    pl = kv.prefix_lens.clone()
    torch.ops.eagle3.tree_attention_mla(q, kv.caches[1], kv.page_table, pl, tm, 0.1, out, None, kv.scale(1))
    want = torch.empty(B * N, NH, Dv, dtype=torch.float64)
    deq = fp8_dequantize(kv.caches[1], kv.scale(1), torch.float64)
    reference.tree_attention_mla(q.double(), deq, kv.page_table, pl, tm, 0.1, want, None)
    assert rel_err(out, want) <= TOLERANCES[torch.float16]
    # kv_accept: accept node 2 (then 3) under the root; rows move bit for bit
    nodes = torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([2, 1], dtype=torch.int32)
    before = kv.caches[1].clone()
    eagle3_ops.ops.kv_accept(kv.caches, kv.page_table, kv.prefix_lens, nodes, lens)
    src = kv.index(torch.tensor([[6, 8, 9], [6, 7, 7]]))
    dst = kv.index(torch.tensor([[6, 7, 8], [6, 7, 7]]))
    assert_equal(kv.caches[1][dst].view(torch.uint8), before[src].view(torch.uint8), "moved rows")
    assert_equal(kv.prefix_lens, torch.tensor([9, 8], dtype=torch.int32), "prefix_lens")


def test_paged_kv_scale_rules():
    assert PagedKV([(8,)], 1, 4).scale(0) is None
    assert float(PagedKV([(8,)], 1, 4, dtype=FP8).scale(0)) == 1.0  # SGLang's unscaled cast
    with pytest.raises(ValueError, match="kv_scale is the scale of an fp8 cache"):
        PagedKV([(8,)], 1, 4, kv_scale=0.5)
    with pytest.raises(ValueError, match="kv_scale must be one finite scale > 0 or one per cache"):
        PagedKV([(8,), (8,)], 1, 4, dtype=FP8, kv_scale=[1.0, 0.0])
    with pytest.raises(ValueError, match="kv_scale must be one finite scale > 0 or one per cache"):
        PagedKV([(8,), (8,)], 1, 4, dtype=FP8, kv_scale=[1.0, 2.0, 3.0])


# ---- the Triton kernel under the interpreter ---------------------------------------------------------------

CONFIGS = {"tma16": dict(tma=True, BLOCK_N=16),  # TMA boxes of fp8 where page_size % 16 == 0
           "gather32": dict(tma=False, BLOCK_N=32),  # gathered whole tiles, two mask words per tree tile
           "tma16.cut": dict(tma=True, BLOCK_N=16, cut=1),  # the bf16 / fp16 default's cut softmax
           "tma16.lazy": dict(tma=True, BLOCK_N=16, rescale_tau=8.0, cut=0)}


# every config at every page size for decode (N 1, the prefix split three ways + the merge) and a one-split tree
# (N 7: the kernel writes out and lse itself); two mask words (N 33, bit 31: the slowest under the interpreter) at
# one page size, with TMA boxes and with gathered tiles
KERNEL_CASES = [(config, page_size, N, kind, splits) for config in CONFIGS for page_size in (1, 16, 64)
                for N, kind, splits in ((1, "chain", 3), (7, "bushy", 1))] + \
               [(config, 16, 33, "chain", 2) for config in ("tma16", "gather32")]


@interpreted
@pytest.mark.parametrize("config, page_size, N, kind, splits", KERNEL_CASES)
def test_kernel_interpreted(gen, config, page_size, N, kind, splits):
    c = fp8_case(gen, N=N, kind=kind, page_size=page_size)
    out, lse = run_fp8(c, dict(CONFIGS[config], splits=splits), kernel=True)
    _check_against(c, out, lse, *c.truth())
    without, _ = run_fp8(c, dict(CONFIGS[config], splits=splits), with_lse=False, kernel=True)
    assert_equal(without, out, "out without lse")


@interpreted
def test_kernel_interpreted_kimi_dims(gen):
    # 576 = 512 + 64 bytes a row: two 256-byte latent boxes and one 64-byte rope box per tile
    c = quantised(Case(gen, mla=True, prefixes=[3, 40], N=4, kind="bushy", page_size=16, NH=8, D=576, Dv=512,
                       dtype=torch.float16, scale=KIMI_SCALE))
    out, lse = run_fp8(c, dict(splits=2, BLOCK_N=16), kernel=True)
    _check_against(c, out, lse, *c.truth())


@interpreted
@pytest.mark.parametrize("q_scale", [1.0, 3e5])  # typical q; |q| past fp16's 65504
def test_kernel_interpreted_bf16_q(gen, q_scale):
    # With an fp8 cache the kernel computes in fp16 (e4m3 -> fp16 is one instruction, -> bf16 an emulated
    # sequence): bf16 q is converted, exact in fp16's normal range, and a tile holding |q| >= 2^15 is scaled by
    # an exact power of two first (folded into the score scale). Its fp16 dots run under the interpreter too.
    c = fp8_case(gen, N=7, dtype=torch.bfloat16)
    c.q = (c.q.float() * q_scale).bfloat16()
    out, lse = run_fp8(c, dict(splits=2, BLOCK_N=16), kernel=True)
    _check_against(c, out, lse, *c.truth())


@interpreted
def test_kernel_interpreted_small_scale_uses_subnormals(gen):
    # A scale 64x the amax rule's: the fp8 values sit in e4m3's low range (subnormals included); the rule holds
    big = quantised(Case(gen, mla=True, prefixes=[0, 17, 70], N=3, kind="bushy", page_size=16, NH=4, D=64, Dv=48,
                         dtype=torch.float16), scale_of_amax=64.0)
    assert int((big.k8.float().abs() < 2.0**-6).sum()) > 0  # some subnormal codes in use
    out, lse = run_fp8(big, dict(splits=2), kernel=True)
    _check_against(big, out, lse, *big.truth())


@interpreted
def test_kernel_interpreted_bad_values_poison_only_their_request(gen):
    c = fp8_case(gen, prefixes=[5, 40, 9], N=7, page_size=16)
    check_bad_values_poison_only_their_request(c, lambda: run_fp8(c, dict(splits=2, BLOCK_N=16), kernel=True))


@interpreted
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_kernel_interpreted_bad_scale_poisons_everything(gen, value):
    c = fp8_case(gen, N=2, prefixes=[1, 5])
    c.kv_scale = torch.tensor(value)
    out, lse = run_fp8(c, dict(splits=2, BLOCK_N=16), kernel=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    with pytest.raises(Eagle3InputError, match=BAD_SCALE.format(re.escape(repr(value)))):  # the reference's message
        eagle3_ops.check_errors(c.q.device)


def test_kernel_refuses_other_kernels(gen):
    from eagle3_ops.triton_kernels.tree_attention import tree_attention_mla_op

    c = fp8_case(gen, N=1, prefixes=[1])
    out = torch.empty(1, c.NH, c.Dv, dtype=c.dtype)
    for kernel in ("v1", "triton"):
        with pytest.raises(ValueError, match="config kernel must be 'sm90' or 'mla_decode' with an fp8 kv_cache"):
            tree_attention_mla_op(c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None, c.kv_scale,
                                  config=dict(kernel=kernel))
    # the sm90 kernel insisted on where it cannot serve (here: CPU tensors, and not Kimi's widths)
    with pytest.raises(ValueError, match="config kernel 'sm90' needs a Hopper GPU"):
        tree_attention_mla_op(c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None, c.kv_scale,
                              config=dict(kernel="sm90"))
    with pytest.raises(ValueError, match="out must have Dv <= 512"):
        tree_attention_mla_op(torch.zeros(1, 2, 1100).half(), torch.zeros(4, 4, 1100).to(FP8), c.page_table,
                              c.prefix_lens, c.tree_mask, c.scale, torch.zeros(1, 2, 1024).half(), None, c.kv_scale)


def test_fp8_routing(gen, monkeypatch):
    """tree_attention_mla_op's choice for an fp8 cache, on CPU with sm90_supported stubbed: the sm90 kernel where
    it serves (kv_scale and config passed on), by default or with kernel 'sm90'; the Triton kernel with
    EAGLE3_MLA_FP8_SM90=0, for kernel 'mla_decode' or a Triton-only key, or where the sm90 kernel does not serve; a
    ValueError for kernel 'sm90' where it does not serve."""
    from eagle3_ops.triton_kernels import tree_attention as ta

    c = fp8_case(gen, N=1, prefixes=[1])
    out = torch.empty(1, c.NH, c.Dv, dtype=c.dtype)
    calls = []
    monkeypatch.setattr(ta, "tree_attention_mla_sm90",
                        lambda *a, kv_scale=None: calls.append(("sm90", a[-1], kv_scale)))
    monkeypatch.setattr(ta, "_mla_decode_launch", lambda *a, kv_scale=None: calls.append(("triton", a[-1], kv_scale)))
    args = (c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None, c.kv_scale)
    monkeypatch.setenv("EAGLE3_MLA_FP8_SM90", "0")  # the opt-out
    for supported, config, want in [(True, None, ("triton", dict(tma=True))),
                                    (True, dict(splits=3), ("triton", dict(tma=True, splits=3)))]:
        monkeypatch.setattr(ta, "sm90_supported", lambda *a, s=supported: s)
        calls.clear()
        ta.tree_attention_mla_op(*args, config=config)
        assert calls == [(*want, c.kv_scale)], (supported, config, calls)
    monkeypatch.delenv("EAGLE3_MLA_FP8_SM90", raising=False)  # the default
    for supported, config, want in [
            (True, None, ("sm90", {})), (True, dict(splits=3), ("sm90", dict(splits=3))),
            (True, dict(kernel="sm90", evict_first=True), ("sm90", dict(evict_first=True))),
            (True, dict(kernel="mla_decode"), ("triton", dict(tma=True))),
            (True, dict(tma=False), ("triton", dict(tma=False))),
            (True, dict(BLOCK_N=32), ("triton", dict(tma=True, BLOCK_N=32))),
            (False, None, ("triton", dict(tma=True))), (False, dict(splits=2), ("triton", dict(tma=True, splits=2)))]:
        monkeypatch.setattr(ta, "sm90_supported", lambda *a, s=supported: s)
        calls.clear()
        ta.tree_attention_mla_op(*args, config=config)
        assert calls == [(*want, c.kv_scale)], (supported, config, calls)
    monkeypatch.setattr(ta, "sm90_supported", lambda *a: False)
    with pytest.raises(ValueError, match="config kernel 'sm90' needs a Hopper GPU"):
        ta.tree_attention_mla_op(*args, config=dict(kernel="sm90"))


def test_sm90_fp8_launcher_passes_the_op_its_arguments(gen, monkeypatch):
    # the sm90 launcher's call of the internal fp8 op (stubbed: a CPU run never reaches the kernel): the schema's 13
    # arguments in order, evict_first plain unsplit unless config says otherwise
    from eagle3_ops.triton_kernels import mla_decode as md

    c = quantised(Case(gen, mla=True, prefixes=[3], N=1, kind="chain", page_size=16, NH=8, D=576, Dv=512,
                       dtype=torch.bfloat16, scale=KIMI_SCALE))
    out = torch.empty(1, 8, 512, dtype=torch.bfloat16)
    calls = []

    class Ops:
        def _tree_attention_mla_sm90_fp8(self, *a):
            calls.append(a)

    monkeypatch.setattr(md.torch.ops, "eagle3", Ops())
    args = (c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None)
    for cfg, evict_first in ((dict(splits=1), False), (dict(splits=1, evict_first=True), True)):
        md.tree_attention_mla_sm90(*args, cfg, kv_scale=c.kv_scale)
        (got,) = calls
        calls.clear()
        assert len(got) == 13, len(got)
        want = (c.q, c.k8, c.kv_scale, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None)
        assert [i for i, (g, w) in enumerate(zip(got, want)) if g is not w] == []
        assert got[9].numel() == 0 and got[10].numel() == 0  # no partials unsplit
        assert got[11:] == (1, evict_first), got[11:]


def test_sm90_supported_says_no_off_the_gpu(gen):
    from eagle3_ops.triton_kernels.mla_decode import sm90_supported

    c = quantised(Case(gen, mla=True, prefixes=[3], N=1, kind="chain", page_size=16, NH=8, D=576, Dv=512,
                       dtype=torch.bfloat16, scale=KIMI_SCALE))
    assert not sm90_supported(c.q, c.k8, torch.empty(1, 8, 512, dtype=torch.bfloat16), c.page_table, c.tree_mask)


# ---- on the H200 ----------------------------------------------------------------------------------------------


def gpu_fp8_case(case, NH=64, dtype=torch.bfloat16, scale_of_amax=1.0):
    N, prefix, B, page_size, kind = case
    return quantised(GpuCase(zlib.crc32(repr((case, NH)).encode()), B=B, prefix=prefix, N=N, kind=kind,
                             page_size=page_size, dtype=dtype, **dict(KIMI_MLA, NH=NH)), scale_of_amax)


def takes_sm90(c) -> bool:
    """Whether the op routes case c to the sm90 kernel's fp8 build (on the H200 with an sm_90a build: always, at
    Kimi's widths; the sm90 tests assert it, so that they cannot pass on the Triton kernel instead)."""
    from eagle3_ops.triton_kernels.mla_decode import sm90_supported

    out = torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device=c.q.device)
    return sm90_supported(c.q, c.k8, out, c.page_table, c.tree_mask)


def sm90_gpu():
    """The sm90 kernel's fp8 build is in this build and the device is a Hopper GPU (else its tests skip)."""
    from eagle3_ops.triton_kernels._device import hopper_kernel
    from eagle3_ops.triton_kernels.mla_decode import sm90_compiled

    dev = torch.device("cuda", torch.cuda.current_device())
    if not (hopper_kernel(dev, "_tree_attention_mla_sm90") and sm90_compiled(dev)
            and hopper_kernel(dev, "_tree_attention_mla_sm90_fp8")):
        pytest.skip("needs a Hopper GPU and a build with csrc/mla_decode_sm90.cu for sm_90a")


# (N, prefix, B, page_size, kind) x local heads: the memory-bound rows of issue 23 (N 1 at 64 / 16 / 8 heads,
# 4-chains at 8 / 16), a 16-node tree, page sizes 1 / 16 / 64 (gathered and TMA tiles), ragged prefixes
GPU_CASES = [((1, 32768, 1, 64, "chain"), 64), ((1, 8192, 8, 64, "chain"), 16), ((1, 4096, 64, 64, "chain"), 8),
             ((4, 8192, 8, 64, "chain"), 8), ((4, 8192, 8, 16, "chain"), 16), ((16, 4096, 8, 64, "bushy"), 64),
             ((16, 4096, 3, 1, "bushy"), 64), ((4, 0, 3, 16, "chain"), 64), ((64, 63, 3, 64, "bushy"), 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("case, NH", GPU_CASES, ids=[f"NH{h}-N{c[0]}-P{c[1]}-B{c[2]}-ps{c[3]}-{c[4]}"
                                                       for c, h in GPU_CASES])
def test_gpu_against_float64(case, NH):
    # the Triton kernel (the fallback where the sm90 kernel does not serve; the op's route on the H200 is the sm90
    # kernel: test_gpu_sm90_against_float64)
    c = gpu_fp8_case(case, NH)
    cfg = dict(kernel="mla_decode")
    out, lse = run_fp8(c, cfg, kernel=True)
    _check_against(c, out, lse, *c.truth())
    without, _ = run_fp8(c, cfg, with_lse=False, kernel=True)
    assert_equal(without, out, "out without lse")


@pytest.mark.gpu
def test_gpu_large_q_does_not_overflow_fp16():
    # bf16 q past fp16's range (|q| ~ 1e5): the kernel's exact power-of-two prescale keeps its fp16 dots finite
    c = gpu_fp8_case((4, 4096, 2, 64, "chain"), 16)
    c.q.mul_(3e4)
    out, lse = run_fp8(c, dict(kernel="mla_decode"), kernel=True)  # (the sm90 kernel's: test_gpu_sm90_large_q)
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tma64", "gather64", "tma32"])
def test_gpu_configs_against_float64(config):
    cfg = {"tma64": dict(tma=True), "gather64": dict(tma=False), "tma32": dict(tma=True, BLOCK_N=32, cut=False)}[config]
    c = gpu_fp8_case((16, 4096, 4, 64, "bushy"), 64)
    out, lse = run_fp8(c, cfg, kernel=True)
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_values_and_scale():
    # Captured once; new q, fp8 cache bytes, prefix lengths, trees *and a new kv_scale* written in place: the
    # replay must equal an eager call on the new values (the scale is read on the device, never baked in).
    c = gpu_fp8_case((16, 5000, 4, 64, "bushy"), 64)
    out = torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device="cuda")
    lse = torch.empty(c.q.shape[0], c.NH, device="cuda")
    graph, _ = capture_graph(lambda: torch.ops.eagle3.tree_attention_mla(
        c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, lse, c.kv_scale))

    def new_cache(g):
        c.kv_scale.copy_(c.kv_scale * 3)
        c.k8.copy_(fp8_quantize(torch.randn(c.k8.shape, generator=g, device="cuda") * 50, torch.tensor(1.0).cuda()))
        c.k_cache = fp8_dequantize(c.k8, c.kv_scale, torch.float64)

    replayed = replay_with_new_values(c, graph, out, lse, new_cache)
    eager = run_fp8(c)
    assert_equal(replayed[0], eager[0], "out replayed vs eager")
    assert_equal(replayed[1], eager[1], "lse replayed vs eager")
    _check_against(c, *eager, *c.truth())


@pytest.mark.gpu
def test_gpu_bad_values_poison_only_their_request():
    c = gpu_fp8_case((7, 300, 3, 16, "bushy"), 64)
    check_bad_values_poison_only_their_request(c, lambda: run_fp8(c))


@pytest.mark.gpu
def test_gpu_bad_scale_poisons_and_bad_arguments_raise():
    c = gpu_fp8_case((4, 100, 2, 16, "chain"), 16)
    c.kv_scale.fill_(0.0)
    out, lse = run_fp8(c)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    with pytest.raises(Eagle3InputError, match=BAD_SCALE.format("0.0")):
        eagle3_ops.check_errors()
    out = poison_(torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device="cuda"))
    with pytest.raises(ValueError, match="kv_scale .* is required with an fp8 kv_cache"):
        torch.ops.eagle3.tree_attention_mla(c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None)
    with pytest.raises(ValueError, match="kv_scale must be on the same device as q"):
        torch.ops.eagle3.tree_attention_mla(c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None,
                                            c.kv_scale.cpu())
    assert torch.isnan(out).all()


@pytest.mark.gpu
def test_gpu_sm90_takes_aligned_fp8_caches():
    from eagle3_ops.triton_kernels.mla_decode import sm90_supported

    sm90_gpu()
    c = gpu_fp8_case((1, 64, 1, 64, "chain"), 64)
    out = torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device="cuda")
    assert sm90_supported(c.q, c.k8, out, c.page_table, c.tree_mask)
    # rows not 16-byte aligned (the data pointer 8 bytes off): the Triton kernel's, and kernel 'sm90' refuses
    flat = torch.empty(c.k8.numel() + 8, dtype=torch.uint8, device="cuda")
    shifted = flat[8:].view(FP8).view(c.k8.shape)
    shifted.view(torch.uint8).copy_(c.k8.view(torch.uint8))
    assert not sm90_supported(c.q, shifted, out, c.page_table, c.tree_mask)
    c.k8 = shifted
    with pytest.raises(ValueError, match="config kernel 'sm90' needs"):
        run_fp8(c, dict(kernel="sm90"), kernel=True)
    got, lse = run_fp8(c)  # and the op still serves it, on the Triton kernel
    _check_against(c, got, lse, *c.truth())


# The sm90 kernel's fp8 build at issue 23's shapes and the edges of its tile code: (N, prefix, B, page_size, kind) x
# local heads x splits (None: the launcher's rule). Memory-bound rows (N 1 at 64 / 16 / 8 heads, 4-chains at 8 / 16),
# a 16-node tree at 64 heads, prefix 0 (the tree tile alone), trees starting at a page's last slot (63) and at a page
# start (64), page sizes 1 / 16 / 64, a prefix of one partial tile, two mask words (N 64), forced splits.
SM90_CASES = [((1, 32768, 1, 64, "chain"), 64, None), ((1, 32768, 1, 64, "chain"), 16, None),
              ((1, 32768, 1, 16, "chain"), 8, None), ((1, 8192, 8, 64, "chain"), 16, 1),
              ((4, 8192, 8, 64, "chain"), 8, None), ((4, 8192, 8, 1, "chain"), 16, None),
              ((4, 8192, 8, 64, "chain"), 16, 5), ((16, 4096, 8, 16, "bushy"), 64, None),
              ((16, 4096, 3, 1, "bushy"), 64, 3), ((1, 0, 4, 1, "chain"), 16, None), ((4, 0, 3, 16, "chain"), 64, 2),
              ((4, 63, 3, 64, "chain"), 64, None), ((4, 64, 3, 16, "chain"), 8, 1), ((16, 10, 2, 64, "bushy"), 8, 1),
              ((64, 63, 3, 64, "bushy"), 16, None), ((1, 4096, 64, 64, "chain"), 8, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("case, NH, splits", SM90_CASES,
                         ids=[f"NH{h}-N{c[0]}-P{c[1]}-B{c[2]}-ps{c[3]}-{c[4]}-s{s}" for c, h, s in SM90_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_sm90_against_float64(case, NH, splits, dtype, monkeypatch):
    sm90_gpu()
    monkeypatch.delenv("EAGLE3_MLA_FP8_SM90", raising=False)  # the op's default route to it
    c = gpu_fp8_case(case, NH, dtype)
    assert takes_sm90(c)
    cfg = dict(kernel="sm90", **({"splits": splits} if splits else {}))
    out, lse = run_fp8(c, cfg, kernel=True)
    _check_against(c, out, lse, *c.truth())
    without, _ = run_fp8(c, cfg, with_lse=False, kernel=True)
    assert_equal(without, out, "out without lse")
    if splits is None:  # the op's own route is this kernel: the same bytes
        routed, routed_lse = run_fp8(c)
        assert_equal(routed, out, "out through torch.ops")
        assert_equal(routed_lse, lse, "lse through torch.ops")


@pytest.mark.gpu
def test_gpu_sm90_fp8_op_checks_its_arguments():
    # the internal op checks what its launcher does not (the public op's checks come first: _validate)
    sm90_gpu()
    c = gpu_fp8_case((4, 100, 2, 16, "chain"), 64)
    out = torch.empty(c.q.shape[0], 64, 512, dtype=c.dtype, device="cuda")
    po, plse = torch.empty(2, 2, 4 * 64, 512, device="cuda"), torch.empty(2, 2, 4 * 64, device="cuda")
    op = torch.ops.eagle3._tree_attention_mla_sm90_fp8
    common = (c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, None, po, plse, 2)
    op(c.q, c.k8, c.kv_scale, *common)  # as given: no error
    with pytest.raises(TypeError, match="kv_cache must have dtype"):
        op(c.q, c.k8.view(torch.uint8), c.kv_scale, *common)
    with pytest.raises(TypeError, match="kv_scale must have dtype"):
        op(c.q, c.k8, c.kv_scale.double(), *common)
    with pytest.raises(ValueError, match=re.escape("kv_scale must have shape [] or [1]")):
        op(c.q, c.k8, c.kv_scale.repeat(2), *common)
    with pytest.raises(ValueError, match="kv_scale must be on the same device"):
        op(c.q, c.k8, c.kv_scale.cpu(), *common)
    with pytest.raises(ValueError, match="kv_cache must have 16-byte aligned rows"):
        shifted = torch.empty(c.k8.numel() + 8, dtype=torch.uint8, device="cuda")[8:].view(FP8).view(c.k8.shape)
        op(c.q, shifted, c.kv_scale, *common)


@pytest.mark.gpu
@pytest.mark.parametrize("evict_first", [False, True])
def test_gpu_sm90_l2_policy_changes_nothing(evict_first):
    sm90_gpu()
    c = gpu_fp8_case((1, 8192, 8, 64, "chain"), 16)
    out, lse = run_fp8(c, dict(kernel="sm90", splits=4, evict_first=evict_first), kernel=True)
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [3e4, 1e30])  # |q| past fp16's 65504: the exact power-of-two prescale
def test_gpu_sm90_large_q(q_scale):
    sm90_gpu()
    c = gpu_fp8_case((4, 4096, 2, 64, "chain"), 16)
    c.q.copy_((c.q.float() * q_scale).bfloat16())
    out, lse = run_fp8(c, dict(kernel="sm90"), kernel=True)
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
def test_gpu_sm90_inf_in_q_leaves_the_blocks_other_rows_exact():
    # One block (4 nodes x 16 heads): an inf in node 0's head 0, |q| ~ 3e4 (past fp16) in node 1. The infinity sets no
    # prescale of its own, so the other rows of the block are converted exactly and still meet the rule.
    sm90_gpu()
    c = gpu_fp8_case((4, 3000, 2, 64, "chain"), 16)
    c.q[1].copy_((c.q[1].float() * 3e4).bfloat16())
    c.q[0, 0, 5] = float("inf")
    out, lse = run_fp8(c, dict(kernel="sm90"), kernel=True)
    ref_out, ref_lse = c.truth()
    _check_against(c, out, lse, ref_out, ref_lse, rows=slice(1, None))


@pytest.mark.gpu
def test_gpu_sm90_small_scale_uses_subnormals():
    sm90_gpu()
    c = gpu_fp8_case((4, 2000, 3, 16, "chain"), 16, scale_of_amax=64.0)
    assert int((c.k8.float().abs() < 2.0**-6).sum()) > 0  # some subnormal codes in use
    out, lse = run_fp8(c, dict(kernel="sm90"), kernel=True)
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_sm90_graph_replay_with_new_values_and_scale(splits):
    # as test_gpu_graph_replay_with_new_values_and_scale, with the sm90 kernel named and the split count fixed
    sm90_gpu()
    c = gpu_fp8_case((16, 5000, 4, 64, "bushy"), 64)
    cfg = dict(kernel="sm90", splits=splits)
    out = torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device="cuda")
    lse = torch.empty(c.q.shape[0], c.NH, device="cuda")
    from eagle3_ops.triton_kernels.tree_attention import tree_attention_mla_op

    graph, _ = capture_graph(lambda: tree_attention_mla_op(c.q, c.k8, c.page_table, c.prefix_lens, c.tree_mask,
                                                           c.scale, out, lse, c.kv_scale, config=cfg))

    def new_cache(g):
        c.kv_scale.copy_(c.kv_scale * 3)
        c.k8.copy_(fp8_quantize(torch.randn(c.k8.shape, generator=g, device="cuda") * 50, torch.tensor(1.0).cuda()))
        c.k_cache = fp8_dequantize(c.k8, c.kv_scale, torch.float64)

    replayed = replay_with_new_values(c, graph, out, lse, new_cache)
    eager = run_fp8(c, cfg, kernel=True)
    assert_equal(replayed[0], eager[0], "out replayed vs eager")
    assert_equal(replayed[1], eager[1], "lse replayed vs eager")
    _check_against(c, *eager, *c.truth())


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2])
def test_gpu_sm90_bad_values_poison_only_their_request(splits):
    sm90_gpu()
    c = gpu_fp8_case((7, 300, 3, 16, "bushy"), 64)
    cfg = dict(kernel="sm90", splits=splits)
    check_bad_values_poison_only_their_request(c, lambda: run_fp8(c, cfg, kernel=True))


@pytest.mark.gpu
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_gpu_sm90_bad_scale_poisons_everything(value):
    sm90_gpu()
    c = gpu_fp8_case((4, 100, 2, 16, "chain"), 16)
    c.kv_scale.fill_(value)
    out, lse = run_fp8(c, dict(kernel="sm90", splits=2), kernel=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    with pytest.raises(Eagle3InputError, match=BAD_SCALE.format(re.escape(repr(value)))):
        eagle3_ops.check_errors()


@pytest.mark.gpu
def test_gpu_paged_kv_write_accept_attend():
    # The engine's path on the GPU: PagedKV fp8 writes (index_put through uint8), kv_accept of the 576-byte rows,
    # attention reading them back: against the float64 reference on the dequantised cache.
    B, N, NH, D, Dv = 4, 4, 16, 576, 512
    kv = PagedKV([(D,)] * 2, B, 4096, page_size=64, dtype=FP8, kv_scale=[0.02, 0.03], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    kv.write(0, torch.randn(B, 3000, D, generator=g, device="cuda", dtype=torch.bfloat16))
    kv.advance(3000 - N)
    # accepted paths whose rows move (2 -> 1, 3 -> 2, ...): the CUDA op's bytes against the CPU reference's
    nodes = torch.tensor([[0, 2, 3, 1], [0, 1, 2, 3], [0, 3, 1, 2], [0, 2, 1, 3]], dtype=torch.int32)
    lens = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    want, want_prefix = [c.cpu() for c in kv.caches], kv.prefix_lens.cpu()
    eagle3_ops.ops.kv_accept(want, kv.page_table.cpu(), want_prefix, nodes, lens)
    eagle3_ops.ops.kv_accept(kv.caches, kv.page_table, kv.prefix_lens, nodes.cuda(), lens.cuda())
    for i, (got, w) in enumerate(zip(kv.caches, want)):
        assert_equal(got.cpu().view(torch.uint8), w.view(torch.uint8), f"caches[{i}] after kv_accept")
    assert_equal(kv.prefix_lens.cpu(), want_prefix, "prefix_lens")
    kv.write(0, torch.randn(B, N, D, generator=g, device="cuda", dtype=torch.bfloat16))
    parents = tree.random_parents(B, N, torch.Generator().manual_seed(6), "chain")
    tm = tree.tree_mask(parents).cuda()
    q = torch.randn(B * N, NH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(B * N, NH, Dv, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B * N, NH, device="cuda")
    torch.ops.eagle3.tree_attention_mla(q, kv.caches[0], kv.page_table, kv.prefix_lens, tm, KIMI_SCALE, out, lse,
                                        kv.scale(0))
    c = GpuCase.__new__(GpuCase)
    c.mla, c.N, c.NH, c.Dv, c.dtype, c.scale = True, N, NH, Dv, torch.bfloat16, KIMI_SCALE
    c.q, c.page_table, c.prefix_lens, c.parents, c.tree_mask = q, kv.page_table, kv.prefix_lens, parents, tm
    c.k_cache, c.v_cache = fp8_dequantize(kv.caches[0], kv.scale(0), torch.float64), None
    _check_against(c, out, lse, *c.truth())
