"""Hypothesis fuzzing of every op on CUDA against its pure-PyTorch reference (-m gpu; also -m fuzz).

Each example draws shapes (edge sizes 0 / 1 and odd ones), dtypes, strides (every argument a view into a
larger poisoned buffer at a random storage offset, with padded strides where the op accepts them), page
sizes, ragged prefixes, random trees and accept paths; runs the op on CUDA and the reference on CPU copies,
and compares: float outputs by the repo's tolerance rule against the float64 reference, everything else
exactly, whole buffers included (what lies around a view must stay poisoned). About one example in seven
injects a single invalid value where the op documents a skip: the call must not raise, check_errors() must
raise Eagle3InputError with the message the reference raises (and kv_accept must skip that request whole).
After a valid example the error word must be clear.

    EAGLE3_FUZZ_EXAMPLES=200 pytest tests/test_fuzz_gpu.py -m gpu      # on the H200 (200 is the default)
    EAGLE3_FUZZ_DEVICE=cpu pytest tests/test_fuzz_gpu.py               # smoke check of the strategies

With EAGLE3_FUZZ_DEVICE=cpu the CPU op (the reference itself) stands in for the kernel, 5 examples per op
unless EAGLE3_FUZZ_EXAMPLES says otherwise, and the tests lose their gpu marker: a check of the generators
and comparisons on a machine without a GPU, not a CI test.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import eagle3_ops
from eagle3_ops import reference, tree
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import TOLERANCES, assert_equal, poison_, rel_err
from tests.test_build_tree import eagle_like
from tests.test_kv_accept import _skip_expected, assert_same_bits, gpu_caches, paged_layout, random_paths
from tests.test_verify import check_walk_structure, planted

DEVICE = os.environ.get("EAGLE3_FUZZ_DEVICE", "cuda")
EXAMPLES = int(os.environ.get("EAGLE3_FUZZ_EXAMPLES", "200" if DEVICE == "cuda" else "5"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                       HealthCheck.large_base_example])
gpu = pytest.mark.gpu if DEVICE == "cuda" else pytest.mark.fuzz  # the CPU smoke run must not be skipped
pytestmark = pytest.mark.fuzz
DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # what every op takes on CUDA
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _clear_error_word():
    """Start from a clear word: a test file before this one may have left a violation behind."""
    try:
        eagle3_ops.check_errors()
    except Eagle3InputError:
        pass


# ---- arguments as views into poisoned buffers ---------------------------------------------------------


class Buf:
    """One tensor argument: the view `t` into a flat buffer that is poisoned wherever the view does not reach."""

    def __init__(self, flat, shape, stride, offset):
        self.flat, self.shape, self.stride, self.offset = flat, tuple(shape), tuple(stride), offset

    @property
    def t(self):
        return self.flat.as_strided(self.shape, self.stride, self.offset)

    def to(self, device="cpu", dtype=None) -> "Buf":
        """A copy (same strides and storage offset) on `device`, optionally cast."""
        return Buf(self.flat.to(device=device, dtype=dtype or self.flat.dtype, copy=True), self.shape, self.stride,
                   self.offset)

    def outside(self):
        """[flat] bool: the elements the view does not cover."""
        inside = torch.zeros(self.flat.numel(), dtype=torch.bool)
        inside.as_strided(self.shape, self.stride, self.offset).fill_(True)
        return ~inside


def buf(data, values, strided=False) -> Buf:
    """values (a host tensor) placed at a random storage offset (0..3 elements: breaks 16-byte alignment) of a
    poisoned buffer; where `strided`, every dim but the last gets a padded stride (a row-slice view)."""
    shape = tuple(values.shape)
    pad = data.draw(st.sampled_from([0, 1, 3, 8])) if strided and len(shape) > 1 else 0
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(shape[i + 1], 1) + pad
    offset = data.draw(st.integers(0, 3))
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    flat = poison_(torch.empty(offset + extent + data.draw(st.integers(0, 2)), dtype=values.dtype))
    b = Buf(flat, shape, stride, offset)
    b.t.copy_(values)
    return b


def opt(b: Buf | None, device="cpu", dtype=None):
    """A copy of b on device, optionally cast (None stays None)."""
    return None if b is None else b.to(device, dtype)


def view(b):
    return None if b is None else b.t


def same_buffer(got: Buf, want: Buf, what):
    """Exact comparison of whole buffers: the view's values and the poison around it."""
    assert_equal(got.flat.cpu(), want.flat, what)


def close_buffer(got: Buf, truth: Buf, dtype, what, tol=None, nan_rows=()):
    """The view within the tolerance rule of the float64 truth (NaN = unwritten fails), except `nan_rows` (of
    the first dim), which must be all NaN; the rest of the buffer still poison."""
    g = got.to("cpu")
    out = g.outside()
    assert bool(torch.isnan(g.flat[out].double()).all()), f"{what}: written outside its view"
    keep = torch.ones(g.shape[0], dtype=torch.bool)
    keep[list(nan_rows)] = False
    assert bool(torch.isnan(g.t[~keep].double()).all()), f"{what}: rows {list(nan_rows)} are not all NaN"
    err = rel_err(g.t[keep], truth.t[keep])
    tol = TOLERANCES[dtype] if tol is None else tol
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol} ({dtype})"


def loosest(*dtypes):
    """The tolerance of the least precise operand (fp8 weights: the bf16 rule, as the kernels dot them)."""
    return max(TOLERANCES[torch.bfloat16 if d == FP8 else d] for d in dtypes)


def generator(data):
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))


def inject(data) -> bool:
    """About one example in seven carries one invalid value."""
    return data.draw(st.integers(0, 6), label="inject") == 0


def no_error_recorded():
    eagle3_ops.check_errors()  # raises if a valid call recorded a violation


def expect_rejected(call, reference_call):
    """One invalid value: the reference raises Eagle3InputError; the op returns and check_errors() raises the
    same message once (on CPU the op is the reference and raises at the call). Returns what the op returned."""
    event("one invalid value")
    with pytest.raises(Eagle3InputError) as want:
        reference_call()
    result = None
    if DEVICE == "cpu":
        with pytest.raises(Eagle3InputError) as got:
            call()
    else:
        result = call()
        with pytest.raises(Eagle3InputError) as got:
            eagle3_ops.check_errors()
        eagle3_ops.check_errors()  # read once, then clear
    assert str(got.value) == str(want.value)
    return result


def bad_index(data, n):
    """An index outside [0, n): just past either end, or far."""
    return data.draw(st.sampled_from([n, n + 1, -1, -2, n + 1000, 2**31 - 1]), label="bad index")


def index_rows(data, g, T, bad) -> tuple[Buf | None, int | None]:
    """rows [R] int32 | int64 into T rows, or None (all rows); with `bad`, exactly one entry out of range (with
    T = 0 every index is: then R = 1), whose position is returned too."""
    if not bad and data.draw(st.booleans()):
        return None, None
    if bad:
        R = data.draw(st.integers(1, 9)) if T else 1
    else:
        R = data.draw(st.integers(0, 9)) if T else 0
    idx = torch.randint(0, max(T, 1), (R,), generator=g).to(data.draw(st.sampled_from([torch.int32, torch.int64])))
    r = data.draw(st.integers(0, R - 1)) if bad else None
    if bad:
        idx[r] = bad_index(data, T)
    return buf(data, idx), r


def repaired(rows: Buf, r: int) -> Buf:
    """rows with its bad entry r pointed at row 0: what CUDA computes for the other rows."""
    fixed = rows.to()
    fixed.t[r] = 0
    return fixed


# ---- capture ------------------------------------------------------------------------------------------


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_capture_aux(data):
    g = generator(data)
    dtype = data.draw(st.sampled_from(DTYPES))
    T = data.draw(st.sampled_from([0, 1, 2, 3, 7, 64]))
    H = data.draw(st.sampled_from([1, 3, 8, 17, 64, 130]))  # scalar widths and 16-byte vector widths
    n_aux = data.draw(st.integers(1, 3))
    slot = data.draw(st.integers(0, n_aux - 1))
    hidden = buf(data, torch.randn(T, H, generator=g).to(dtype), strided=True)
    residual = buf(data, torch.randn(T, H, generator=g).to(dtype), strided=True) if data.draw(st.booleans()) else None
    bad = inject(data)
    rows, r = index_rows(data, g, T, bad)
    R = T if rows is None else rows.shape[0]
    aux = buf(data, poison_(torch.empty(R, n_aux * H, dtype=dtype)), strided=True)

    dev, want = [opt(b, DEVICE) for b in (hidden, residual, aux, rows)], [opt(b) for b in (hidden, residual, aux, rows)]
    call = lambda: torch.ops.eagle3.capture_aux(view(dev[0]), view(dev[1]), dev[2].t, slot, view(dev[3]))  # noqa: E731
    ref = lambda: reference.capture_aux(view(want[0]), view(want[1]), want[2].t, slot, view(want[3]))  # noqa: E731
    if bad:  # CUDA: the bad row's slot block NaN, everything else as usual
        expect_rejected(call, ref)
        want = [opt(b) for b in (hidden, residual, aux)] + [repaired(rows, r)]
        if T:
            ref()
        want[2].t[r, slot * H:(slot + 1) * H] = float("nan")
        if DEVICE == "cpu":
            return
    else:
        call()
        ref()
    same_buffer(dev[2], want[2], "aux")
    no_error_recorded()


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_add_rmsnorm_capture(data):
    g = generator(data)
    x_dtype = data.draw(st.sampled_from(DTYPES + [torch.float64]))
    r_dtype = data.draw(st.sampled_from([x_dtype, torch.float32] if x_dtype in DTYPES[:2] else [x_dtype]))
    w_dtype = data.draw(st.sampled_from([x_dtype, torch.float32] if x_dtype != torch.float64 else [x_dtype]))
    T = data.draw(st.sampled_from([0, 1, 2, 3, 7, 33]))
    H = data.draw(st.sampled_from([1, 3, 8, 17, 64, 130]))
    eps = data.draw(st.sampled_from([0.0, 1e-6, 1e-5]))
    x = buf(data, torch.randn(T, H, generator=g).to(x_dtype), strided=True)
    residual = buf(data, (3 * torch.randn(T, H, generator=g)).to(r_dtype), strided=True)
    weight = buf(data, (1 + 0.1 * torch.randn(H, generator=g)).to(w_dtype))
    aux = rows = None
    slot, bad = 0, inject(data)
    if bad or data.draw(st.booleans()):  # a capture point
        n_aux = data.draw(st.integers(1, 3))
        slot = data.draw(st.integers(0, n_aux - 1))
        rows, r = index_rows(data, g, T, bad)
        R = T if rows is None else rows.shape[0]
        aux = buf(data, poison_(torch.empty(R, n_aux * H, dtype=r_dtype)), strided=True)

    args = (x, residual, weight, aux, rows)
    dev, want = [opt(b, DEVICE) for b in args], [opt(b) for b in args]

    def call(op=torch.ops.eagle3.add_rmsnorm_capture, bufs=dev):
        op(bufs[0].t, bufs[1].t, bufs[2].t, eps, view(bufs[3]), slot, view(bufs[4]))

    ref = lambda: call(reference.add_rmsnorm_capture, want)  # noqa: E731
    if bad:  # CUDA: the bad row's slot block NaN; x, residual and the other rows as usual
        expect_rejected(call, ref)
        want = [opt(b) for b in args[:4]] + [repaired(rows, r)]
        if T:
            ref()
        want[3].t[r, slot * H:(slot + 1) * H] = float("nan")
        if DEVICE == "cpu":
            return
    else:
        call()
        ref()
    same_buffer(dev[1], want[1], "residual")  # the add rounds once: exact
    if aux is not None:
        same_buffer(dev[3], want[3], "aux")
    # x's truth: the float64 norm of the rounded new residual (0 + residual is exact)
    truth = x.to(dtype=torch.float64)
    truth.t.zero_()
    reference.add_rmsnorm_capture(truth.t, want[1].t.double(), weight.t.double(), eps, None, 0, None)
    close_buffer(dev[0], truth, x_dtype, "x")
    no_error_recorded()


# ---- fc -----------------------------------------------------------------------------------------------


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_fc_proj(data):
    g = generator(data)
    a_dtype = data.draw(st.sampled_from(DTYPES))
    o_dtype = data.draw(st.sampled_from([a_dtype] + DTYPES))
    w_dtype = data.draw(st.sampled_from([a_dtype, a_dtype, FP8] + DTYPES))
    T = data.draw(st.sampled_from([0, 1, 2, 5, 17, 70]))  # 70: past the streaming kernel's 64 rows
    H = data.draw(st.sampled_from([1, 3, 8, 16, 33]))
    n_aux = data.draw(st.integers(1, 3))
    Hd = data.draw(st.sampled_from([1, 5, 16, 40]))
    K = n_aux * H
    norm_mode = data.draw(st.sampled_from(["none", "norm_before_fc", "fc_norm"]))
    eps = data.draw(st.sampled_from([1e-6, 1e-5]))
    aux = buf(data, (2 * torch.randn(T, K, generator=g)).to(a_dtype), strided=True)
    w = torch.randn(Hd, K, generator=g) / K ** 0.5
    scale = None
    if w_dtype == FP8 or data.draw(st.integers(0, 3)) == 0:
        scale = (w.abs().amax(dim=1) / 448).clamp_min(1e-12) if w_dtype == FP8 else 0.5 + torch.rand(Hd, generator=g)
        w = w / scale[:, None] if w_dtype == FP8 else w
        scale = buf(data, scale.float())
    weight = buf(data, w.to(w_dtype))
    norm_weight = None
    if norm_mode == "fc_norm":
        norm_weight = buf(data, (1 + 0.2 * torch.randn(n_aux, H, generator=g)).to(data.draw(st.sampled_from(DTYPES))))
    elif norm_mode == "norm_before_fc" and data.draw(st.booleans()):
        norm_weight = buf(data, (1 + 0.2 * torch.randn(K, generator=g)).to(data.draw(st.sampled_from(DTYPES))))
    bad = inject(data)
    rows, r = index_rows(data, g, T, bad)
    R = T if rows is None else rows.shape[0]
    out = buf(data, poison_(torch.empty(R, Hd, dtype=o_dtype)), strided=True)

    args = (aux, weight, scale, norm_weight, rows, out)
    dev, want = [opt(b, DEVICE) for b in args], [opt(b) for b in args]

    def call(op=torch.ops.eagle3.fc_proj, bufs=dev):
        op(bufs[0].t, bufs[1].t, view(bufs[2]), view(bufs[3]), eps, norm_mode, view(bufs[4]), bufs[5].t)

    ref = lambda: call(reference.fc_proj, want)  # noqa: E731
    if bad:  # CUDA: the bad row of out NaN, the others as usual
        expect_rejected(call, ref)
        if DEVICE == "cpu" or T == 0:  # (T = 0: the one row is the bad one)
            return
        rows = repaired(rows, r)
    else:
        call()
    truth = out.to(dtype=torch.float64)
    nw64 = None if norm_weight is None else norm_weight.t.double()
    reference.fc_proj(aux.t.double(), weight.t.double(), view(scale), nw64, eps, norm_mode, view(rows), truth.t)
    close_buffer(dev[5], truth, o_dtype, "out", tol=loosest(a_dtype, o_dtype, w_dtype), nan_rows=[r] if bad else [])
    no_error_recorded()


# ---- tree ---------------------------------------------------------------------------------------------


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_build_tree(data):
    g = generator(data)
    bad = inject(data)
    B = data.draw(st.sampled_from([1, 2, 3, 5] if bad else [0, 1, 2, 3, 5]))
    if data.draw(st.booleans()):  # EAGLE-like cumulative log-probs, -inf padded
        S, topk = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([1, 2, 3]))
        draft_tokens, scores, draft_parents = eagle_like(g, B, S, topk, 32000)
        M = topk * topk
    else:  # arbitrary scores from a few levels: caps and ties everywhere
        S, M = data.draw(st.integers(1 if bad else 0, 4)), data.draw(st.integers(1, 7))
        scores = torch.randint(0, data.draw(st.sampled_from([2, 4, 50])), (B, S, M), generator=g).float() * -0.5
        scores[torch.rand(B, S, M, generator=g) < 0.15] = float("-inf")
        draft_parents = torch.randint(0, M, (B, S, M), generator=g)
        draft_parents[:, :1] = -1
        draft_tokens = torch.randint(0, 32000, (B, S, M), generator=g)
    scores = scores.to(data.draw(st.sampled_from(DTYPES)))
    draft_parents = draft_parents.to(data.draw(st.sampled_from([torch.int32, torch.int64])))
    N = data.draw(st.integers(1, 1 + S * M))
    if bad:
        b, d, m = (data.draw(st.integers(0, n - 1)) for n in (B, S, M))
        what = data.draw(st.sampled_from(["nan", "parent"]))
        if what == "nan":
            scores[b, d, m] = float("nan")
        elif d == 0:  # depth-0 candidates are the root's children: -1 only
            draft_parents[b, 0, m] = data.draw(st.sampled_from([0, M - 1, -2]))
        else:
            draft_parents[b, d, m] = bad_index(data, M)
    inputs = [buf(data, t) for t in (torch.randint(0, 32000, (B,), generator=g), draft_tokens, scores, draft_parents,
                                     torch.randint(0, 100000, (B,), generator=g, dtype=torch.int32))]
    shapes = (((B, N), torch.int64), ((B, N), torch.int32), ((B, N), torch.int64),
              ((B, N, (N + 31) // 32), torch.int32))  # tokens, parents, positions, tree_mask
    outputs = [buf(data, poison_(torch.empty(shape, dtype=dt))) for shape, dt in shapes]
    dev, want = [opt(b, DEVICE) for b in inputs + outputs], [opt(b) for b in inputs + outputs]
    call = lambda: torch.ops.eagle3.build_tree(*(b.t for b in dev))  # noqa: E731
    ref = lambda: reference.build_tree(*(b.t for b in want))  # noqa: E731
    if bad:
        expect_rejected(call, ref)
        if DEVICE == "cpu" or (what == "parent" and d > 0):  # (a parent read as the root: no reference form)
            return
        # CUDA builds the tree of the NaN read as -inf, or of the depth-0 parent ignored (-1)
        want = [opt(b) for b in inputs + outputs]
        want[2 if what == "nan" else 3].t[b, d, m] = float("-inf") if what == "nan" else -1
        ref()
    else:
        call()
        ref()
    for got, w, name in zip(dev[5:], want[5:], ("tokens", "parents", "positions", "tree_mask")):
        same_buffer(got, w, name)
    no_error_recorded()


# ---- attention ----------------------------------------------------------------------------------------

# (NH, D, Dv): one head, odd dims, D - Dv = 0, Kimi's absorbed MLA (64 heads, 576 = 512 + 64)
MLA_DIMS = [(1, 16, 8), (2, 40, 32), (3, 72, 64), (4, 64, 64), (64, 576, 512)]
# (NH, HKV, Dh, Dv): MHA, GQA groups of 2 and 4, Dv != Dh, a Llama head
GQA_DIMS = [(1, 1, 8, 8), (4, 2, 16, 24), (8, 2, 32, 16), (6, 3, 64, 64), (8, 2, 128, 128)]


def _attention_case(data, mla):
    """Inputs of one tree-attention example (with one bad value in request `bad`, unless None), the same
    without the bad value, the outputs, and `bad`."""
    g = generator(data)
    dtype = data.draw(st.sampled_from(DTYPES))
    dims = data.draw(st.sampled_from(MLA_DIMS if mla else GQA_DIMS))
    B = data.draw(st.sampled_from([1, 2, 3, 5]))  # (B = 0: the reference's torch.cat refuses an empty batch)
    N = data.draw(st.sampled_from([1, 2, 3, 7, 16, 33]))  # 33: a second mask word
    if dims[1] == 576:
        B, N = min(B, 2), min(N, 7)
    ps = data.draw(st.sampled_from([1, 3, 16, 64]))
    prefixes = [data.draw(st.sampled_from([0, 1, ps - 1, ps, 2 * ps + 1, 50])) for _ in range(B)]
    need = [-(-(p + N) // ps) for p in prefixes]
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, generator=g).int()
    page_table = perm[-1].repeat(B, max(need) + data.draw(st.integers(0, 2)))  # unused entries: a spare page
    k = 0
    for b, n in enumerate(need):
        page_table[b, :n] = perm[k:k + n]
        k += n
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    parents = tree.random_parents(B, N, g, data.draw(st.sampled_from(["bushy", "chain", "wide"])))
    if mla:
        NH, D, Dv = dims
        caches = [torch.randn(num_pages, ps, D, generator=g)]
    else:
        NH, HKV, D, Dv = dims
        caches = [torch.randn(num_pages, ps, HKV, D, generator=g), torch.randn(num_pages, ps, HKV, Dv, generator=g)]
    scale = data.draw(st.sampled_from([D ** -0.5, 0.130861, 1.0]))
    q = buf(data, torch.randn(B * N, NH, D, generator=g).to(dtype), strided=True)
    caches = [buf(data, c.to(dtype)) for c in caches]
    clean = [buf(data, page_table, strided=True), buf(data, prefix_lens), buf(data, tree.tree_mask(parents))]
    meta, bad = clean, None
    if inject(data):
        bad = data.draw(st.integers(0, B - 1))
        meta = [m.to() for m in clean]
        if data.draw(st.booleans()):  # a page the request reads, out of range
            pos = data.draw(st.integers(0, prefixes[bad] + N - 1))
            meta[0].t[bad, pos // ps] = data.draw(st.sampled_from([num_pages, num_pages + 7, -1]))
        else:  # a prefix that leaves no room for the tree, or negative
            meta[1].t[bad] = data.draw(st.sampled_from([page_table.shape[1] * ps - N + 1, -1]))
    out = buf(data, poison_(torch.empty(B * N, NH, Dv, dtype=dtype)), strided=True)
    lse = buf(data, poison_(torch.empty(B * N, NH))) if data.draw(st.booleans()) else None
    return dtype, scale, [q] + caches + meta, [q] + caches + clean, out, lse, bad


def _fuzz_attention(data, mla):
    dtype, scale, inputs, clean, out, lse, bad = _attention_case(data, mla)
    op = torch.ops.eagle3.tree_attention_mla if mla else torch.ops.eagle3.tree_attention
    spec = reference.tree_attention_mla if mla else reference.tree_attention
    dev = [b.to(DEVICE) for b in inputs]
    dev_out, dev_lse = out.to(DEVICE), opt(lse, DEVICE)
    call = lambda: op(*(b.t for b in dev), scale, dev_out.t, view(dev_lse))  # noqa: E731
    skipped = []
    if bad is not None:  # CUDA: every row of the bad request's out and lse NaN, the others as usual
        host = [b.to() for b in inputs]
        expect_rejected(call, lambda: spec(*(b.t for b in host), scale, out.to().t, view(opt(lse))))
        if DEVICE == "cpu":
            return
        N = inputs[-1].shape[1]
        skipped = range(bad * N, (bad + 1) * N)
    else:
        call()
    truth_out, truth_lse = out.to(dtype=torch.float64), opt(lse)
    floats = len(clean) - 3
    spec(*(b.t.double() for b in clean[:floats]), *(b.t for b in clean[floats:]), scale, truth_out.t,
         view(truth_lse))
    close_buffer(dev_out, truth_out, dtype, "out", nan_rows=skipped)
    if lse is not None:
        close_buffer(dev_lse, truth_lse, torch.float32, "lse", nan_rows=skipped)
    no_error_recorded()


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_tree_attention_mla(data):
    _fuzz_attention(data, mla=True)


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_tree_attention(data):
    _fuzz_attention(data, mla=False)


# ---- verify -------------------------------------------------------------------------------------------


def _tree_case(data, g, dtype, B_choices, N_choices, V_choices):
    """A planted tree (deep greedy paths, equal siblings) and its logits; maybe one bad parent."""
    B, N, V = (data.draw(st.sampled_from(c)) for c in (B_choices, N_choices, V_choices))
    kind = data.draw(st.sampled_from(["bushy", "chain", "wide", "beam"]))
    logits, tokens, parents = planted(int(torch.randint(0, 2**31, (1,), generator=g)), B, N, V, kind, dtype=dtype,
                                      integer=data.draw(st.booleans()))
    return logits, tokens, parents


def _bad_parent(data, parents) -> tuple[int, int]:
    """One parent that breaks the canonical form: the root's is not -1, or another's is not an earlier node."""
    B, N = parents.shape
    b, j = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, N - 1))
    parents[b, j] = data.draw(st.sampled_from([0, 1, -2])) if j == 0 else \
        data.draw(st.sampled_from([j, N, -1, -2, 2**31 - 1]))
    return b, j


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_verify_greedy(data):
    g = generator(data)
    dtype = data.draw(st.sampled_from(DTYPES + [torch.float64]))
    bad = inject(data)
    logits, tokens, parents = _tree_case(data, g, dtype, [1, 2, 3, 7] if bad else [0, 1, 2, 3, 7],
                                         [1, 2, 3, 8, 33, 64], [1, 2, 7, 111, 4099, 32000])
    if bad:
        b, j = _bad_parent(data, parents)
    inputs = [buf(data, logits, strided=True), buf(data, tokens), buf(data, parents)]
    dev = [b.to(DEVICE) for b in inputs]
    call = lambda: torch.ops.eagle3.verify_greedy(*(b.t for b in dev))  # noqa: E731
    ref = lambda: reference.verify_greedy(*(b.t for b in inputs))  # noqa: E731
    if bad:
        got = expect_rejected(call, ref)
        if DEVICE == "cpu":
            return
        # CUDA walks on: a root parent is ignored; node j is never accepted, as a child of the root whose
        # token matches nothing (tokens outside [0, V) never do)
        tokens, parents = tokens.clone(), parents.clone()
        parents[b, j] = -1 if j == 0 else 0
        if j:
            tokens[b, j] = logits.shape[1] + 1
        want = reference.verify_greedy(logits, tokens, parents)
    else:
        got, want = call(), ref()
    for gt, w, name in zip(got, want, ("accept_nodes", "accept_len", "emitted")):
        assert gt.device.type == DEVICE and gt.dtype == w.dtype, name
        assert_equal(gt.cpu(), w, name)
    no_error_recorded()


def _fragile(args, b, tries=4) -> bool:
    """Whether request b's sampled walk turns on a near-tie (a draw within ~1e-5 of its threshold, which fp32
    probabilities may fall on either side of): the float64 reference with logits and draft probabilities
    perturbed by 1e-5 relative gives a different walk."""
    logits, dp, d2t, tokens, parents, temperature, seed, offset = args
    want = [o[b] for o in reference.verify_sampling(*args)]
    g = torch.Generator().manual_seed(b)

    def noisy(t):
        return None if t is None else t.double() * (1 + 1e-5 * torch.randn(t.shape, generator=g, dtype=torch.float64))

    for _ in range(tries):
        got = reference.verify_sampling(noisy(logits), noisy(dp), d2t, tokens, parents, temperature, seed, offset)
        if any(not torch.equal(o[b], w) for o, w in zip(got, want)):
            return True
    return False


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_verify_sampling(data):
    # The kernel draws the reference's Philox uniforms, so walks agree exactly: always at temperature 0 and
    # with one-hot-like rows, otherwise except where the reference itself turns on a near-tie (_fragile).
    g = generator(data)
    dtype = data.draw(st.sampled_from(DTYPES))
    bad = inject(data)
    logits, tokens, parents = _tree_case(data, g, dtype, [1, 2, 5] if bad else [0, 1, 2, 5], [1, 2, 3, 8, 33],
                                         [1, 2, 7, 111, 1000])
    B, N = tokens.shape
    V = logits.shape[1]
    rows = data.draw(st.sampled_from(["plain", "peaked", "hot"]))
    if rows == "peaked":
        logits = (logits.float() * 2.5).to(dtype)
    elif rows == "hot":  # p exactly one-hot in float64 and float32 at any temperature: deterministic
        logits = logits.float()
        logits[torch.arange(B * N), logits.argmax(-1)] += 1e4
        logits = logits.to(dtype)
    q = data.draw(st.sampled_from(["one_hot", "draft_probs", "d2t"]))
    dp = d2t = None
    if q != "one_hot":
        Vd = V if q == "draft_probs" else data.draw(st.integers(1, V))
        dp = torch.softmax(torch.randn(B * N, Vd, generator=g) * 2, -1).to(data.draw(st.sampled_from(DTYPES)))
        if q == "d2t":  # injective, increasing: EAGLE's draft-to-target map
            d2t = torch.sort(torch.randperm(V, generator=g)[:Vd]).values - torch.arange(Vd)
    temperature = torch.tensor([0.0, 0.3, 1.0, 1.7])[torch.randint(0, 4, (B,), generator=g)]
    seed = torch.randint(0, 2**62, (B,), generator=g)  # both Philox key words in use
    offset = torch.randint(0, 2**62, (B,), generator=g)
    fixes = None  # what CUDA computes instead: (argument, index, value) edits that repair the bad value
    if bad:
        what = data.draw(st.sampled_from(["parent", "temperature"] + (["d2t"] if d2t is not None else [])))
        if what == "parent":  # (the node is never visited: no reference form)
            _bad_parent(data, parents)
        elif what == "temperature":  # sampled greedily
            b = data.draw(st.integers(0, B - 1))
            temperature[b] = data.draw(st.sampled_from([-1.0, -1e-3, float("nan")]))
            fixes = [(5, b, 0.0)]
        else:  # that draft id's probability dropped from q (d2t[i] = -i: its mass of 0 lands on token 0)
            i = data.draw(st.integers(0, d2t.shape[0] - 1))
            d2t[i] = data.draw(st.sampled_from([V - i, -i - 1, 2**40]))
            fixes = [(2, i, -i), (1, (slice(None), i), 0.0)]
    inputs = [buf(data, logits, strided=True), None if dp is None else buf(data, dp, strided=True),
              None if d2t is None else buf(data, d2t)] + \
        [buf(data, t) for t in (tokens, parents, temperature, seed, offset)]
    dev = [opt(b, DEVICE) for b in inputs]
    call = lambda: torch.ops.eagle3.verify_sampling(*(view(b) for b in dev))  # noqa: E731
    args = [view(b) for b in inputs]
    if bad:
        got = expect_rejected(call, lambda: reference.verify_sampling(*args))
        if DEVICE == "cpu" or fixes is None:
            return
        args = [None if a is None else a.clone() for a in args]
        for arg, index, value in fixes:
            args[arg][index] = value
    else:
        got = call()
    got = [o.cpu() for o in got]
    want = reference.verify_sampling(*args)
    check_walk_structure(got, logits, tokens, parents)
    for b in range(B):
        if all(torch.equal(gt[b], w[b]) for gt, w in zip(got, want)):
            continue
        t = float(args[5][b])
        assert t > 0 and rows != "hot" and _fragile(args, b), \
            f"request {b} (temperature {t}): got {[o[b].tolist() for o in got]}, want {[o[b].tolist() for o in want]}"
    no_error_recorded()


# ---- kv -----------------------------------------------------------------------------------------------


@gpu
@FUZZ
@given(data=st.data())
def test_fuzz_kv_accept(data):
    g = generator(data)
    bad = inject(data)
    B = data.draw(st.sampled_from([1, 2, 3, 6] if bad else [0, 1, 2, 3, 6]))
    N = data.draw(st.sampled_from([1, 2, 3, 8, 33]))
    ps = data.draw(st.sampled_from([1, 3, 16, 64]))
    prefixes = [data.draw(st.sampled_from([0, 1, ps - 1, ps, 2 * ps + 3, 40])) for _ in range(B)]
    if B:
        page_table, num_pages = paged_layout(g, prefixes, N, ps)  # disjoint pages per request
    else:
        page_table, num_pages = torch.zeros(0, 1, dtype=torch.int32), 2
    layers = gpu_caches(g, num_pages, ps)  # every row width the kernel copies differently (16-, 4-, 1-byte units)
    pick = data.draw(st.integers(1, 2 ** len(layers) - 1))
    caches = [c for i, c in enumerate(layers) if pick >> i & 1]
    parents = tree.random_parents(B, N, g, data.draw(st.sampled_from(["bushy", "chain", "wide"])))
    if data.draw(st.booleans()):  # a root-first path, as verify accepts
        accept_nodes, accept_len = random_paths(g, parents)
    else:  # any nodes in any order (the op allows it: every row is read before any is written)
        accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
        accept_len = torch.randint(0, N, (B,), generator=g, dtype=torch.int32)
        for b in range(B):
            accept_nodes[b, :int(accept_len[b]) + 1] = torch.randperm(N, generator=g)[:int(accept_len[b]) + 1].int()
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    if bad:
        b = data.draw(st.integers(0, B - 1))
        a, P = int(accept_len[b]), prefixes[b]
        what = data.draw(st.sampled_from(["accept_len", "accept_nodes", "page_table", "prefix_lens"]))
        cap = page_table.shape[1] * ps  # the op checks positions against the table, not against N
        if what == "accept_len":
            accept_len[b] = data.draw(st.sampled_from([N, N + 100, -1]))
        elif what == "accept_nodes":
            accept_nodes[b, data.draw(st.integers(0, a))] = bad_index(data, cap - P)
        elif what == "page_table":  # the page of a row that moves (its source or its destination)
            i = data.draw(st.integers(0, a))
            pos = P + (int(accept_nodes[b, i]) if data.draw(st.booleans()) else i)
            page_table[b, pos // ps] = data.draw(st.sampled_from([num_pages, -3]))
        else:
            prefix_lens[b] = data.draw(st.sampled_from([cap - a, -1]))
    caches = [buf(data, c) for c in caches]
    meta = [buf(data, page_table, strided=True), buf(data, prefix_lens), buf(data, accept_nodes), buf(data, accept_len)]
    dev, want = [b.to(DEVICE) for b in caches + meta], [b.to() for b in caches + meta]
    k = len(caches)
    call = lambda: torch.ops.eagle3.kv_accept([b.t for b in dev[:k]], *(b.t for b in dev[k:]))  # noqa: E731
    ref = lambda: reference.kv_accept([b.t for b in want[:k]], *(b.t for b in want[k:]))  # noqa: E731
    if bad:
        expect_rejected(call, ref)
        if DEVICE != "cpu":  # the broken request is skipped whole; the others still move
            skipped, skipped_prefix = _skip_expected([c.t for c in caches], page_table, prefix_lens, accept_nodes,
                                                     accept_len, b)
            for i, (d, w) in enumerate(zip(dev[:k], skipped)):
                assert_same_bits(d.t.cpu(), w, f"caches[{i}] (request {b} skipped)")
            assert_equal(dev[k + 1].t.cpu(), skipped_prefix, f"prefix_lens (request {b} skipped)")
        return
    call()
    ref()
    for i, (d, w) in enumerate(zip(dev[:k], want[:k])):
        assert_same_bits(d.flat.cpu(), w.flat, f"caches[{i}]")
    for d, w, name in zip(dev[k:], want[k:], ("page_table", "prefix_lens", "accept_nodes", "accept_len")):
        same_buffer(d, w, name)
    no_error_recorded()
