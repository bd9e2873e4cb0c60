"""The target and the decode loop on an fp8 e4m3 latent cache (models.cache.KVCacheConfig, issue 23).

On the CPU every attention is the reference (fp8 rows read as fp8 * kv_scale, fp32 accumulation), which gives
exact rules:

- plain greedy decoding on an fp8 cache equals, bit for bit (every step's logits, hence the tokens), the same
  model run on the *dequantised* cache: a cache in a wider dtype whose writes keep dequantise(quantise(row)),
  the values an fp8 cache reads back. Exact because both read the same keys with the same queries: an fp16
  target's fp16 q against an fp32 dequantised cache (q widened exactly; every fp8 * scale product is the fp32
  value the reference forms) at any scales; an fp32 target's bf16 q (what it sends an fp8 cache) against a bf16
  dequantised cache at power-of-two scales (fp8 * 2^k is exact in bf16).
- speculative decoding on an fp8 cache emits plain greedy decoding's tokens on the same cache, chain and tree,
  fixed and calibrated scales; in the batch-invariant mode the caches' kept rows are the same bytes too (the
  accepted verify rows, moved by kv_accept, are the plain steps' rows).

GPU tests (marked gpu; the lead runs them on the H200): the same at bf16 q through the kernels, with the rule
each states, CUDA-graph replay with the scales as device tensors, and the calibration without a host sync.
"""

from __future__ import annotations

import math

import pytest
import torch

from eagle3_ops import cli, ops
from eagle3_ops.engine import PrefillCache, SpecConfig, decode, generate_plain, generate_speculative, torch_glue
from eagle3_ops.engine.oracle import OracleDrafter
from eagle3_ops.models.cache import FP8, FP8_MAX, KV_DTYPES, KVCacheConfig, PagedKV, fp8_dequantize, fp8_quantize
from eagle3_ops.models.config import DrafterConfig, TargetConfig
from eagle3_ops.models.drafter import Drafter
from eagle3_ops.models.target import Target
from tests.conftest import TOLERANCES, assert_equal, rel_err

TINY = TargetConfig.from_preset("tiny")  # 8 layers, MoE, q compression: every piece of the step
L = TINY.num_layers
B, T0, NEW = 2, 13, 12  # T0 13 with page_size 4: the prompt ends mid-page
PAGE = 4
# fp16 at any scales: some layers saturate (amax ~3 over 0.005 is past 448), most do not
ANY_SCALES = tuple(0.005 + 0.0031 * i for i in range(L))
POW2_SCALES = tuple(2.0 ** -(i % 4) for i in range(L))  # 1, 1/2, 1/4, 1/8: fp8 * scale exact in bf16


class DequantisedKV(PagedKV):
    """The reference cache: `dtype` rows holding dequantise(quantise(row, scale[i]), scale[i]), what the fp8 cache
    reads back; a plain (non-fp8) cache to the model and to tree_attention_mla."""

    def __init__(self, scales, dtype, batch, max_len, page_size, device="cpu"):
        super().__init__([(TINY.kv_dim,)] * L, batch, max_len, page_size, dtype=dtype, device=device)
        self.ref_scales = torch.tensor(scales, dtype=torch.float32, device=device)

    def write(self, i, rows, nodes=None):
        s = self.ref_scales[i]
        super().write(i, fp8_dequantize(fp8_quantize(rows, s), s), nodes)


@pytest.fixture(scope="module")
def models():
    """{dtype: (target, drafter)}: tiny fp16 and fp32 pairs."""
    out = {}
    for dt in (torch.float16, torch.float32):
        target = Target.synthesize(TINY, 0, dt).eval()
        drafter = Drafter.synthesize(DrafterConfig.for_target(TINY), target.model.embed_tokens, 1, dt).eval()
        out[dt] = (target, drafter)
    return out


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, TINY.vocab_size, (B, T0), generator=torch.Generator().manual_seed(5))


def _greedy(target, prompts, kv, n):
    """generate_plain's steps by hand on a given cache: (tokens [B, n], every step's logits [B, V])."""
    logits = decode._prefill(target, prompts, kv)
    steps, toks = [logits], [logits.argmax(-1)]
    self_only = torch.ones(prompts.shape[0], 1, 1, dtype=torch.int32)
    for _ in range(n - 1):
        logits = target.forward(toks[-1][:, None], kv.prefix_lens[:, None].long(), kv, self_only)
        kv.advance(1)
        steps.append(logits)
        toks.append(logits.argmax(-1))
    return torch.stack(toks, 1), steps


def _kept_rows(kv, n):
    """Every layer's rows at positions 0..n-1, as stored ([L, B, n, D]; fp8 as its bytes)."""
    page, slot = kv.index(torch.arange(n, device=kv.page_table.device).expand(kv.batch, n))
    rows = [kv.read(i, page, slot) for i in range(len(kv.caches))]
    return torch.stack([r.view(torch.uint8) if r.dtype == FP8 else r for r in rows])


def _recording(monkeypatch, target):
    """Keep every latent cache target.new_kv makes, in order: a run's own first, then a calibrating prefill's."""
    made, new_kv = [], target.new_kv

    def record(*a, **k):
        made.append(new_kv(*a, **k))
        return made[-1]
    monkeypatch.setattr(target, "new_kv", record)
    return made


# ---- plain decoding on fp8 = the model on the dequantised cache ---------------------------------------------


@pytest.mark.parametrize("dtype, scales, ref_dtype, invariant", [
    (torch.float16, ANY_SCALES, torch.float32, False),  # per-layer scales, some saturating
    (torch.float16, (1.0,) * L, torch.float32, False),  # SGLang's unscaled cast (the default)
    (torch.float32, POW2_SCALES, torch.bfloat16, False),  # an fp32 target: bf16 q on both sides
    # the batch-invariant attention (float64: fp8 * scale exact there, so the fp32 reference rows must be exact
    # too: power-of-two scales)
    (torch.float16, POW2_SCALES, torch.float32, True),
], ids=["fp16-per-layer", "fp16-unscaled", "fp32-pow2", "fp16-pow2-invariant"])
def test_plain_on_fp8_equals_the_dequantised_cache(models, prompts, monkeypatch, dtype, scales, ref_dtype, invariant):
    target, _ = models[dtype]
    monkeypatch.setattr(target, "batch_invariant_rows", B if invariant else 0)  # (the decode steps; not the prefill)
    cap = T0 + NEW + 1
    kv8 = target.new_kv(B, cap, page_size=PAGE, config=KVCacheConfig("fp8", scales))
    assert kv8.caches[0].dtype == FP8 and kv8.kv_scales.tolist() == list(torch.tensor(scales).tolist())
    tok8, steps8 = _greedy(target, prompts, kv8, NEW)
    ref = DequantisedKV(scales, ref_dtype, B, cap, PAGE)
    tok_ref, steps_ref = _greedy(target, prompts, ref, NEW)
    for t, (a, b) in enumerate(zip(steps8, steps_ref)):
        assert_equal(a, b, f"step {t} logits")
    assert_equal(tok8, tok_ref, "tokens")
    n = T0 + NEW - 1  # the positions written
    page, slot = kv8.index(torch.arange(n).expand(B, n))
    for i in range(L):  # the fp8 cache reads back the reference's values
        assert_equal(fp8_dequantize(kv8.read(i, page, slot), kv8.scale(i), ref_dtype), ref.read(i, page, slot),
                     f"layer {i} rows")
    # the loop through kv_dtype / kv_scale gives those tokens
    out, _ = generate_plain(target, prompts, NEW, page_size=PAGE, kv_dtype="fp8_e4m3", kv_scale=scales)
    assert_equal(out, tok_ref, "generate_plain tokens")
    # and the cache is quantised: the model-dtype cache's logits differ
    _, steps_wide = _greedy(target, prompts, target.new_kv(B, cap, page_size=PAGE), 2)
    assert not torch.equal(steps_wide[0], steps8[0])


# ---- speculative decoding on fp8 = plain decoding on fp8 ------------------------------------------------------


@pytest.mark.parametrize("dtype, invariant, spec, scale, glue", [
    (torch.float16, True, SpecConfig(3, 1, 4), ANY_SCALES, "eagle3"),  # Kimi's chain
    (torch.float16, True, SpecConfig(3, 2, 6), "calibrate", "eagle3"),  # a tree, calibrated scales
    (torch.float16, True, SpecConfig(3, 1, 4), "calibrate", "torch"),  # the plain-PyTorch glue (uint8 moves)
    (torch.float32, False, SpecConfig(3, 2, 6), ANY_SCALES, "eagle3"),  # the fast path: bf16 q, no padding
], ids=["fp16-chain", "fp16-tree-calibrated", "fp16-chain-torch-glue", "fp32-tree-fast"])
def test_speculative_on_fp8_equals_plain_on_fp8(models, prompts, monkeypatch, dtype, invariant, spec, scale, glue):
    target, drafter = models[dtype]
    # batch-invariant: plain and verify steps give each token bit-identical rows and logits, so the caches must
    # match byte for byte too; the fp32 fast path is compared by tokens (its rows differ with the step's shape)
    monkeypatch.setattr(target, "batch_invariant_rows", B * spec.num_tokens if invariant else 0)
    made = _recording(monkeypatch, target)
    plain, _ = generate_plain(target, prompts, NEW, page_size=PAGE, kv_dtype="fp8", kv_scale=scale)
    plain_kv, n = made[0], len(made)
    # an ORACLE drafter at p 0.8 (the target's own tokens, some corrupted): accepted and rejected drafts both
    oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), 0.8, TINY.vocab_size, start=T0 - 1)
    fast, st = generate_speculative(target, oracle, prompts, NEW, spec, page_size=PAGE, glue=glue, kv_dtype="fp8",
                                    kv_scale=scale)
    spec_kv = made[n]
    assert_equal(fast, plain, "speculative tokens")
    assert st.acceptance_length > 1.5 and st.accept_hist[1] > 0  # rows were moved and rows were dropped
    assert spec_kv.caches[0].dtype == FP8 and not spec_kv.calibrating
    assert len(made) == (2 * n if scale == "calibrate" else n + 1)
    if scale == "calibrate":  # a calibrating prefill (into a model-dtype cache made after the run's), the same scales
        assert made[-1].caches[0].dtype == dtype and made[-1].capacity >= T0
        assert_equal(spec_kv.kv_scales, plain_kv.kv_scales, "calibrated scales")
    if invariant:
        assert_equal(_kept_rows(spec_kv, T0 + NEW - 1), _kept_rows(plain_kv, T0 + NEW - 1), "kept cache bytes")


def test_kv_accept_moves_fp8_rows_as_the_torch_glue_does(gen):
    # ours on the fp8 caches, the plain-PyTorch glue on their uint8 views (how the loop calls it): the same bytes;
    # raw random bytes include NaN patterns, which a move must carry unchanged
    kv = PagedKV([(40,)] * 3, 3, 32, page_size=4, dtype=FP8, seed=2)
    for c in kv.caches:
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.shape, generator=gen, dtype=torch.uint8))
    kv.advance(torch.tensor([5, 0, 17], dtype=torch.int32))
    nodes = torch.tensor([[0, 2, 5, -1, -1, -1], [0, 1, 2, 3, 4, 5], [0, 4, -1, -1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([2, 5, 1], dtype=torch.int32)
    theirs = [c.clone() for c in kv.caches]
    theirs_lens = kv.prefix_lens.clone()
    ops.kv_accept(kv.caches, kv.page_table, kv.prefix_lens, nodes, lens)
    torch_glue.kv_accept([c.view(torch.uint8) for c in theirs], kv.page_table, theirs_lens, nodes, lens)
    for i, (a, b) in enumerate(zip(kv.caches, theirs)):
        assert_equal(a.view(torch.uint8), b.view(torch.uint8), f"cache {i} bytes")
    assert_equal(kv.prefix_lens, theirs_lens, "prefix_lens")
    assert kv.prefix_lens.tolist() == [8, 6, 19]


# ---- calibration ----------------------------------------------------------------------------------------------


def test_calibrated_scales_are_amax_over_the_whole_prefill(models, prompts, monkeypatch):
    # chunks of 5 positions (PREFILL_TOKENS // B): the scale must cover all three chunks, not the first one
    monkeypatch.setattr(decode, "PREFILL_TOKENS", 5 * B)
    target, _ = models[torch.float16]
    wide = target.new_kv(B, T0, page_size=PAGE)  # the same chunked prefill on a model-dtype cache
    want_logits = decode._prefill(target, prompts, wide)
    kv = target.new_kv(B, T0 + 4, page_size=PAGE, config=KVCacheConfig("fp8_e4m3", "calibrate"))
    assert kv.calibrating and kv.kv_scales.tolist() == [1.0] * L
    logits = decode._prefill(target, prompts, kv)
    assert_equal(logits, want_logits, "prefill logits (the prefill attends over its unquantised rows)")
    assert not kv.calibrating and kv.prefix_lens.tolist() == [T0] * B
    page, slot = kv.index(torch.arange(T0).expand(B, T0))
    firsts = []
    for i in range(L):
        rows = wide.read(i, *wide.index(torch.arange(T0).expand(B, T0)))
        scale = rows.abs().amax().float() / FP8_MAX
        assert_equal(kv.kv_scales[i], scale, f"layer {i} scale")
        assert_equal(kv.read(i, page, slot).view(torch.uint8), fp8_quantize(rows, scale).view(torch.uint8),
                     f"layer {i} rows")
        firsts.append(float(rows[:, :5].abs().amax()) / FP8_MAX)
    assert len(set(kv.kv_scales.tolist())) == L  # one per layer
    assert firsts != kv.kv_scales.tolist()  # (the first chunk's amax alone would give other scales)


def test_calibration_of_an_all_zero_prefill_keeps_1():
    src = PagedKV([(8,)] * 2, 2, 6, page_size=4)
    src.caches[1].fill_(-3.5)
    src.advance(6)
    kv = PagedKV([(8,)] * 2, 2, 10, page_size=4, dtype=FP8, kv_scale="calibrate")
    kv.calibrate_from(src, 6)
    assert kv.kv_scales.tolist() == [1.0, 3.5 / FP8_MAX] and kv.prefix_lens.tolist() == [6, 6]
    with pytest.raises(ValueError, match="calibrate_from needs an fp8 cache"):
        PagedKV([(8,)] * 2, 2, 10).calibrate_from(src, 6)


def test_prefill_cache_keeps_the_calibrated_scales(models, prompts):
    target, drafter = models[torch.float16]
    spec = SpecConfig(3, 1, 4)
    want, _ = generate_speculative(target, drafter, prompts, 8, spec, kv_dtype="fp8", kv_scale="calibrate")
    cache = PrefillCache()
    for _ in range(2):  # fills it, then starts from it
        out, _ = generate_speculative(target, drafter, prompts, 8, spec, kv_dtype="fp8", kv_scale="calibrate",
                                      prefill_cache=cache)
        assert_equal(out, want, "tokens")
    assert cache.state["kv_scales"] is not None and cache.state["kv"] == ("float8_e4m3fn", "calibrate")
    for kw in (dict(), dict(kv_dtype="fp8", kv_scale=0.01)):  # another cache's prefill is refused
        with pytest.raises(ValueError, match="prefill_cache holds a prefill into a"):
            generate_speculative(target, drafter, prompts, 8, spec, prefill_cache=cache, **kw)


# ---- options ----------------------------------------------------------------------------------------------------


def test_option_spellings(models):
    target, _ = models[torch.float32]
    for name, dt in [("auto", torch.float32), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp8", FP8),
                     ("fp8_e4m3", FP8)]:
        assert target.new_kv(1, 8, config=KVCacheConfig(name)).caches[0].dtype == dt
    assert cli.KV_CACHE_DTYPES == tuple(KV_DTYPES)  # the CLI's torch-free copy
    assert target.new_kv(1, 8).caches[0].dtype == torch.float32  # default: the model's dtype
    kv = target.new_kv(1, 8, config=KVCacheConfig("fp8", 0.25))
    assert kv.kv_scales.tolist() == [0.25] * L and kv.scale(3).shape == ()


BAD = [  # (kv_dtype, kv_scale, error, the message)
    ("fp8_e5m2", None, ValueError, "kv_dtype must be one of auto, bf16, bfloat16, fp8, fp8_e4m3, got 'fp8_e5m2'"),
    ("fp16", None, ValueError, "kv_dtype must be one of"),
    ("fp8", 0.0, ValueError, "kv_scale must be finite and > 0"),
    ("fp8", -1.0, ValueError, "kv_scale must be finite and > 0"),
    ("fp8", math.inf, ValueError, "kv_scale must be finite and > 0"),
    ("fp8", math.nan, ValueError, "kv_scale must be finite and > 0"),
    ("fp8", (0.1, 0.0), ValueError, "kv_scale must be finite and > 0"),
    ("fp8", "amax", ValueError, "kv_scale must be a number > 0, one per layer, or 'calibrate', got 'amax'"),
    ("bf16", 0.5, ValueError, "kv_scale is the scale of an fp8 cache: it needs kv_dtype fp8"),
    ("auto", "calibrate", ValueError, "kv_scale is the scale of an fp8 cache"),
    ("fp8", (0.1, 0.2, 0.3), ValueError, rf"kv_scale must be one finite scale > 0 or one per cache \({L}\)"),
]


@pytest.mark.parametrize("kv_dtype, kv_scale, error, match", BAD, ids=[f"{d}-{s}" for d, s, _, _ in BAD])
def test_bad_options_are_refused_naming_the_argument(models, prompts, kv_dtype, kv_scale, error, match):
    target, drafter = models[torch.float32]
    with pytest.raises(error, match=match):
        generate_plain(target, prompts, 2, kv_dtype=kv_dtype, kv_scale=kv_scale)
    with pytest.raises(error, match=match):
        generate_speculative(target, drafter, prompts, 2, kv_dtype=kv_dtype, kv_scale=kv_scale)


def test_fp8_refuses_a_float64_target():
    target = Target.synthesize(TINY, 0, torch.float64)
    with pytest.raises(ValueError, match="kv_dtype fp8_e4m3 needs a float32 / bfloat16 / float16 target"):
        target.new_kv(1, 8, config=KVCacheConfig("fp8"))


CLI_BAD = [
    (["demo", "--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype: invalid choice: 'fp8_e5m2'"),
    (["demo", "--kv-cache-dtype", "fp8", "--kv-scale", "0"], "--kv-scale: must be finite and > 0, got 0"),
    (["demo", "--kv-cache-dtype", "fp8", "--kv-scale", "big"], "--kv-scale: must be 'calibrate', a number > 0"),
    (["demo", "--kv-scale", "0.5"], "--kv-scale is the scale of an fp8 cache: it needs --kv-cache-dtype fp8"),
    (["demo", "--kv-cache-dtype", "fp8", "--dtype", "float64"], "--kv-cache-dtype fp8 needs --dtype float32 or"),
    (["demo", "--kv-cache-dtype", "fp8", "--kv-scale", "0.1,0.2"],
     "--kv-scale takes one scale or one per layer (8 for preset byte-small), got 2"),
]


@pytest.mark.parametrize("argv, says", CLI_BAD, ids=[" ".join(a[1:]) for a, _ in CLI_BAD])
def test_cli_refuses_bad_kv_flags(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load_pair", lambda *a, **k: pytest.fail("a model was loaded before the flags were checked"))
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and says in err, err


def test_bench_e2e_refuses_bad_kv_flags(capsys):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_e2e

    for argv, says in [(["--kv-scale", "0.5"], "kv_scale is the scale of an fp8 cache"),
                       (["--kv-cache-dtype", "fp8", "--kv-scale", "0"], "kv_scale must be finite and > 0"),
                       (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype: invalid choice")]:
        with pytest.raises(SystemExit) as e:
            bench_e2e.main(["--device", "cpu", *argv])
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_demo_on_an_fp8_cache(capsys):
    """The shipped pair (fp32) on a calibrated fp8 cache: the speculative run lossless against plain on it."""
    rc = cli.main(["demo", "--batch", "2", "--max-new", "12", "--kv-cache-dtype", "fp8", "--kv-scale", "calibrate"])
    out = capsys.readouterr().out
    assert "latent cache fp8 e4m3 (amax / 448 per layer, calibrated on the prefill)" in out
    assert rc == 0 and "outputs identical to plain greedy decoding: yes" in out, out


# ---- GPU: the same at bf16 q through the kernels ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_models():
    target = Target.synthesize(TINY, 0, torch.bfloat16, device="cuda").eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(TINY), target.model.embed_tokens, 1, torch.bfloat16,
                                 device="cuda").eval()
    return target, drafter


def _greedy_forced(target, prompts, kv, tokens):
    """Every step's logits with the tokens given (teacher-forced: two caches compared on the same inputs)."""
    steps = [decode._prefill(target, prompts, kv)]
    self_only = torch.ones(prompts.shape[0], 1, 1, dtype=torch.int32, device=prompts.device)
    for t in range(tokens.shape[1] - 1):
        steps.append(target.forward(tokens[:, t:t + 1], kv.prefix_lens[:, None].long(), kv, self_only))
        kv.advance(1)
    return steps


@pytest.mark.gpu
def test_gpu_plain_on_fp8_against_the_dequantised_cache(gpu_models):
    # Power-of-two scales: a bf16 or fp32 dequantised cache holds exactly the values the fp8 cache reads back.
    # Teacher-forced on the same tokens: a = the fp8 cache (bf16 q, mla_decode's fp8 kernel), b = the bf16
    # dequantised cache (bf16 q, the bf16 kernel), c = the fp32 dequantised cache (fp32 q and out: the same math
    # without bf16's roundings). Rule (the kernels' tolerance rule, at the model's output): a's logits are at most
    # twice as far from c's as b's are, over every step.
    target, _ = gpu_models
    Bg, P, n = 3, 77, 16
    prompts = torch.randint(0, TINY.vocab_size, (Bg, P), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    tokens = generate_plain(target, prompts, n, kv_dtype="fp8", kv_scale=POW2_SCALES)[0]
    kv8 = target.new_kv(Bg, P + n + 1, page_size=16, config=KVCacheConfig("fp8", POW2_SCALES))
    a = torch.stack(_greedy_forced(target, prompts, kv8, tokens))
    b, c = (torch.stack(_greedy_forced(target, prompts, DequantisedKV(POW2_SCALES, dt, Bg, P + n + 1, 16, "cuda"),
                                       tokens)) for dt in (torch.bfloat16, torch.float32))
    err_a, err_b = rel_err(a, c), rel_err(b, c)
    assert err_a <= 2 * err_b + 1e-5, (err_a, err_b)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [ANY_SCALES, "calibrate"])
def test_gpu_speculative_on_fp8_equals_plain_batch_invariant(gpu_models, monkeypatch, scale):
    # bf16 target, fp8 cache: the batch-invariant mode makes plain and verify steps bit-identical, so the tokens
    # and the kept cache bytes (written by the fp8 write path, moved by the CUDA kv_accept) must match exactly
    target, drafter = gpu_models
    spec = SpecConfig(3, 1, 4)
    prompts = torch.randint(0, TINY.vocab_size, (3, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    monkeypatch.setattr(target, "batch_invariant_rows", 3 * spec.num_tokens)
    made = _recording(monkeypatch, target)
    plain, _ = generate_plain(target, prompts, 16, kv_dtype="fp8", kv_scale=scale)
    plain_kv, n = made[0], len(made)
    oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), 0.8, TINY.vocab_size, start=39)
    fast, st = generate_speculative(target, oracle, prompts, 16, spec, kv_dtype="fp8", kv_scale=scale)
    assert_equal(fast, plain, "speculative tokens")
    assert st.acceptance_length > 1.5
    assert_equal(_kept_rows(made[n], 40 + 15).cpu(), _kept_rows(plain_kv, 40 + 15).cpu(), "kept cache bytes")


@pytest.mark.gpu
def test_gpu_graphs_replay_fp8_with_the_scales_on_the_device(gpu_models):
    # CUDA graphs capture kv_scale as a device tensor: a replay after the scales change in place equals an eager
    # forward at the new scales (the same kernels on the same inputs: exact), and the round graphs' run equals
    # the eager run's tokens
    from eagle3_ops.engine.graphs import StepGraph, new_pool

    target, drafter = gpu_models
    prompts = torch.randint(0, TINY.vocab_size, (2, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    kv = target.new_kv(2, 64, config=KVCacheConfig("fp8", ANY_SCALES))
    decode._prefill(target, prompts, kv)
    mask = torch.ones(2, 1, 1, dtype=torch.int32, device="cuda")
    tok = torch.randint(0, TINY.vocab_size, (2, 1), device="cuda")
    pos = kv.prefix_lens[:, None].long()
    step = StepGraph(lambda t, p: target.forward(t, p, kv, mask), new_pool("cuda"))
    step(tok, pos)  # captured
    kv.kv_scales.mul_(1.5)
    replayed = step(tok, pos).clone()
    eager = target.forward(tok, pos, kv, mask)
    assert_equal(replayed, eager, "replay after the scales changed")
    for graphs in (False, True):
        out, _ = generate_speculative(target, drafter, prompts, 12, SpecConfig(3, 1, 4), graphs=graphs,
                                      kv_dtype="fp8", kv_scale="calibrate")
        if not graphs:
            want = out
    assert_equal(out, want, "round graphs against eager")
    plain_eager, _ = generate_plain(target, prompts, 12, kv_dtype="fp8", kv_scale=ANY_SCALES)
    plain_graphs, _ = generate_plain(target, prompts, 12, kv_dtype="fp8", kv_scale=ANY_SCALES, graphs=True)
    assert_equal(plain_graphs, plain_eager, "plain step graphs against eager")


@pytest.mark.gpu
def test_gpu_calibration_does_not_sync_the_host(gpu_models):
    target, _ = gpu_models
    prompts = torch.randint(0, TINY.vocab_size, (2, 50), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    src = target.new_kv(2, 50)
    decode._prefill(target, prompts, src)
    kv = target.new_kv(2, 70, config=KVCacheConfig("fp8", "calibrate"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kv.calibrate_from(src, 50)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = src.read(0, *src.index(torch.arange(50, device="cuda").expand(2, 50)))
    assert_equal(kv.kv_scales[0], rows.abs().amax().float() / FP8_MAX, "layer 0 scale")
