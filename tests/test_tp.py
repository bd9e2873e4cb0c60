"""Tensor parallelism (eagle3_ops.parallel, docs/tp.md) on the CPU: 4 gloo ranks over the tiny preset, spawned
once for the module (every check runs in the same 4 processes; each test reads its check's result on every
rank), against the TP-1 model built from the same weights. Plus the one-rank group and the pieces that need
no group (the walk, the packing, fp8 experts); the torchrun entry is tests/test_bench_tp.py's.

The shards are the TP-1 model's slices (shard_target), so the sharded model computes the same sums split in
another order: in float64 that cannot flip an argmax, so every token must match TP-1's exactly; in fp32 the
batch-invariant mode is checked the same way.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import pytest
import torch

from eagle3_ops.engine import SpecConfig, generate_plain, generate_speculative
from eagle3_ops.engine.oracle import OracleDrafter
from eagle3_ops.models.config import DrafterConfig, TargetConfig
from eagle3_ops.models.drafter import Drafter
from eagle3_ops.models.target import Target
from eagle3_ops.parallel import (TP, Fp8Experts, TPGlue, generate_speculative_tp, shard_target, tp_drafter,
                                 walk_greedy)
from eagle3_ops.tree import chain_parents, tree_mask

WORLD = 4  # tiny: 4 heads, 8 experts, intermediate 48 / 16, vocabulary 97 (shards of 25, 25, 25, 22)
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _pair(dtype=torch.float64):
    cfg = TargetConfig.from_preset("tiny")
    target = Target.synthesize(cfg, 0, dtype).eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(cfg), target.model.embed_tokens, 1, dtype).eval()
    return target, drafter


def _prompts(B, T0, V, seed=0):
    return torch.randint(0, V, (B, T0), generator=torch.Generator().manual_seed(seed))


def _gather(tp, x):
    """Every rank's x, [world, *x.shape]."""
    out = [torch.empty_like(x) for _ in range(tp.world)]
    torch.distributed.all_gather(out, x.contiguous())
    return torch.stack(out)


# ---- the checks, run on every rank ----------------------------------------------------------------------------


@check
def forward_and_aux(tp):
    """A prefill and a tree verify step: gathered logits ~ TP-1's; the sharded columns are those logits'; every
    rank's aux rows are bit-identical (the all-reduced residual stream) and ~ TP-1's."""
    full, _ = _pair()
    model = shard_target(full, tp)
    B, T0, N = 2, 9, 6
    prompts = _prompts(B, T0, full.cfg.vocab_size)
    ids = [-1, 2, 5, 7]  # the embedding, two middle layers, the last
    outs = []
    for m in (full, model):
        kv = m.new_kv(B, 64)
        aux = torch.full((B * T0, 4 * 32), float("nan"), dtype=torch.float64)
        pre = m.forward(prompts, torch.arange(T0).expand(B, T0), kv, tree_mask(chain_parents(B, T0)), aux, ids)
        kv.advance(T0)
        parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * B, dtype=torch.int32)
        toks = _prompts(B, N, full.cfg.vocab_size, 1)
        depth = torch.tensor([0, 1, 1, 2, 2, 3])
        aux2 = torch.full((B * N, 4 * 32), float("nan"), dtype=torch.float64)
        ctx = model.sharded_logits() if m is model else _null()
        with ctx:
            ver = m.forward(toks, T0 + depth.expand(B, N), kv, tree_mask(parents), aux2, ids)
        outs.append((pre, aux, ver, aux2, kv))
    (pre1, aux1, ver1, aux21, kv1), (pre, aux, ver, aux2, kv) = outs
    torch.testing.assert_close(pre, pre1, rtol=1e-5, atol=1e-5)  # (logits are fp32)
    assert ver.shape == (B * N, model.vocab_hi - model.vocab_lo)
    torch.testing.assert_close(ver, ver1[:, model.vocab_lo:model.vocab_hi], rtol=1e-5, atol=1e-5)
    for a, a1 in ((aux, aux1), (aux2, aux21)):
        every = _gather(tp, a)
        assert all(torch.equal(every[0], every[r]) for r in range(tp.world)), "aux differs between ranks"
        torch.testing.assert_close(a, a1, rtol=1e-4, atol=1e-6)  # (the attention op computes in fp32)
    for c, c1 in zip(kv.caches, kv1.caches):  # every rank keeps the whole latent cache
        torch.testing.assert_close(c, c1, rtol=1e-4, atol=1e-6)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@check
def moe_grouped(tp):
    """The expert-parallel MoE's grouped path (fp32, torch._grouped_mm over the local experts) ~ TP-1's."""
    full, _ = _pair(torch.float32)
    model = shard_target(full, tp)
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(3))
    tpm = shard_target(full, tp, moe="tp")  # every expert's columns split instead
    for i in (1, 4):
        torch.testing.assert_close(model.model.layers[i].mlp(x), full.model.layers[i].mlp(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tpm.model.layers[i].mlp(x), full.model.layers[i].mlp(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.layers[0].mlp(x), full.model.layers[0].mlp(x), rtol=1e-5, atol=1e-5)


@check
def argmax_vocab_parallel(tp):
    """TP.argmax over each rank's columns equals torch.argmax of the whole rows: ties (small integers) within and
    across shards, -0.0 against +0.0, -inf rows, NaN."""
    V = 97
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-3, 3, (64, V), generator=g).float()
    logits[0] = 0.0
    logits[0, 60] = -0.0  # ties with +0.0 at a lower index than ... the first +0.0 is column 0
    logits[1, :30] = -0.0
    logits[2] = float("-inf")
    logits[3, 80] = float("nan")
    logits[4, 10] = float("nan")
    logits[4, 90] = float("nan")
    logits[5] = torch.randn(V, generator=g) * 1e30
    from eagle3_ops.parallel import vocab_range

    lo, hi = vocab_range(V, tp.rank, tp.world)
    got = tp.argmax(logits[:, lo:hi], lo)
    want = logits.argmax(-1)
    assert torch.equal(got, want), f"rows {(got != want).nonzero().flatten().tolist()}: {got} vs {want}"


@check
def fc_sharded(tp):
    """TPDrafter.project (each rank's Hd / TP columns, one all-gather) equals the whole drafter's project, rows
    gathered or not; the replicated mode too."""
    full, drafter = _pair(torch.float32)
    aux = torch.randn(11, drafter.cfg.n_aux * 32, generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([3, 0, 10, 3])
    for fc in ("sharded", "replicated"):
        d = tp_drafter(drafter, tp, fc)
        if fc == "sharded":
            assert d.fc.weight.shape[0] == drafter.cfg.hidden_size // tp.world
        for r in (None, rows):
            torch.testing.assert_close(d.project(aux, r), drafter.project(aux, r), rtol=1e-6, atol=1e-6)


def _tp_pair(tp, dtype=torch.float64, fc="sharded", invariant=0):
    full, drafter = _pair(dtype)
    full.batch_invariant_rows = invariant
    model = shard_target(full, tp)
    return full, drafter, model, tp_drafter(drafter, tp, fc)


@check
def decode_equals_tp1(tp):
    """float64: plain decoding under TP (moe "ep" and "tp") and speculative (a chain with moe "tp", the
    vocab-parallel verify and the sharded fc; a tree with moe "ep", the gathered verify and the replicated fc)
    emit TP-1's tokens on every rank, with TP-1's acceptance."""
    full, drafter, model, d = _tp_pair(tp)
    prompts = _prompts(3, 10, full.cfg.vocab_size, 7)
    ref, _ = generate_plain(full, prompts, 10)
    plain, _ = generate_plain(model, prompts, 10)
    assert torch.equal(plain, ref), "plain under TP differs from TP-1"
    tpm = shard_target(full, tp, moe="tp")
    plain, _ = generate_plain(tpm, prompts, 10)
    assert torch.equal(plain, ref), "plain under TP (moe='tp') differs from TP-1"
    for spec, verify, fc, m in ((SpecConfig(3, 1, 4), "vocab", "sharded", tpm),
                                (SpecConfig(3, 2, 6), "gathered", "replicated", model)):
        dd = d if fc == "sharded" else tp_drafter(drafter, tp, fc)
        out, stats = generate_speculative_tp(m, dd, prompts, 10, spec, verify=verify)
        assert torch.equal(out, ref), f"{spec} {verify}: first mismatch at {(out != ref).nonzero()[0].tolist()}"
        assert torch.equal(_gather(tp, out)[0], out)
        if verify == "vocab":
            _, wstats = generate_speculative(full, drafter, prompts, 10, spec)
            assert wstats.accept_hist == stats.accept_hist, "acceptance differs from TP-1's"


@check
def batch_invariant_fp32(tp):
    """fp32 in the batch-invariant mode: speculative under TP (the ORACLE drafter at p = 0.7) emits plain TP-1's
    tokens, and plain under TP equals them too."""
    full, drafter, model, d = _tp_pair(tp, torch.float32, invariant=3 * 4)
    prompts = _prompts(3, 8, full.cfg.vocab_size, 9)
    ref, _ = generate_plain(full, prompts, 12)
    plain, _ = generate_plain(model, prompts, 12)
    assert torch.equal(plain, ref)
    reference = torch.cat([prompts, ref], 1)
    oracle = OracleDrafter(d, reference, 0.7, full.cfg.vocab_size, seed=1, start=7)
    out, stats = generate_speculative_tp(model, oracle, prompts, 12, SpecConfig(3, 1, 4))
    assert torch.equal(out, ref), f"first mismatch at {(out != ref).nonzero()[0].tolist()}"
    assert 1.0 < stats.acceptance_length < 4.0


@check
def sampling_equals_tp1(tp):
    """Lossless sampling under TP (logits gathered, the same seeds on every rank): TP-1's tokens, on every rank."""
    full, drafter, model, d = _tp_pair(tp)
    prompts = _prompts(2, 8, full.cfg.vocab_size, 4)
    spec = SpecConfig(3, 2, 5, temperature=0.8, seed=3)
    want, _ = generate_speculative(full, drafter, prompts, 12, spec)
    out, _ = generate_speculative_tp(model, d, prompts, 12, spec)
    assert torch.equal(out, want), f"first mismatch at {(out != want).nonzero()[0].tolist()}"
    every = _gather(tp, out)
    assert all(torch.equal(every[0], every[r]) for r in range(tp.world))


def _worker(rank: int, world: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    tp = TP()
    results = {}
    for name, fn in CHECKS.items():
        t0 = time.perf_counter()
        try:
            fn(tp)
            results[name] = "ok"
            if rank == 0 and os.environ.get("EAGLE3_TP_TIMES"):
                print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception:  # reported by the test of that name
            results[name] = traceback.format_exc()
        torch.distributed.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(WORLD, str(d / "init"), str(d)), nprocs=WORLD, join=True)
    return [json.load(open(d / f"rank{r}.json")) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(CHECKS))
def test_tp4_gloo(tp_results, name):
    for rank, res in enumerate(tp_results):
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"


# ---- without a group --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["forward_and_aux", "moe_grouped", "fc_sharded", "argmax_vocab_parallel"])
def test_tp1_group(name, monkeypatch):
    """The one-rank group runs the same sharded code (no collective), against the same TP-1 results."""
    monkeypatch.setattr(torch.distributed, "all_gather",
                        lambda out, x: [o.copy_(x) for o in out])
    CHECKS[name](TP())


def test_walk_greedy_matches_verify_greedy():
    """walk_greedy from the argmax equals verify_greedy over the logits, on random trees whose drafts often carry
    their parent's argmax (vocabulary 5) and a child token shared by two siblings."""
    g = torch.Generator().manual_seed(0)
    for B, N in ((1, 1), (3, 7), (2, 33)):
        parents = torch.full((B, N), -1, dtype=torch.int32)
        for j in range(1, N):
            parents[:, j] = torch.randint(0, j, (B,), generator=g)
        tokens = torch.randint(0, 5, (B, N), generator=g)
        logits = torch.randn(B * N, 5, generator=g)
        want = torch.ops.eagle3.verify_greedy(logits, tokens, parents)
        got = walk_greedy(logits.argmax(-1).view(B, N), tokens, parents)
        for w, x in zip(want, got):
            assert torch.equal(w, x), (w, x)


def test_glue_gathered_without_shards():
    """TPGlue outside sharded_logits() passes whole logits to verify_greedy."""
    full, _ = _pair(torch.float32)
    model = shard_target(full, TP())
    logits = torch.randn(8, 97)
    tokens, parents = torch.randint(0, 97, (2, 4)), chain_parents(2, 4)
    got = TPGlue(TP(), model, "vocab").verify_greedy(logits, tokens, parents)
    for w, x in zip(torch.ops.eagle3.verify_greedy(logits, tokens, parents), got):
        assert torch.equal(w, x)


def test_fp8_experts_reference():
    """Fp8Experts: per-row quantisation within e4m3's rounding of the weights; the grouped GEMMs (the CPU path)
    equal each expert's dequantised SwiGLU."""
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(3, 2 * 16, 32, generator=g), torch.randn(3, 32, 16, generator=g)
    ex = Fp8Experts.from_weights(gate_up, down)
    gq, uq, dq = ex.weights(1)
    torch.testing.assert_close(torch.cat([gq, uq]), gate_up[1], rtol=0.07, atol=0.02)
    a = torch.randn(7, 32, generator=g)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    h = ex.gate_up_mm(a, offs)
    torch.testing.assert_close(h[:2], a[:2] @ torch.cat(ex.weights(0)[:2]).T)
    torch.testing.assert_close(h[2:6], a[2:6] @ torch.cat(ex.weights(2)[:2]).T)
    torch.testing.assert_close(ex[2](a[2:6]), ex.down_mm(torch.nn.functional.silu(h[:, :16]) * h[:, 16:], offs)[2:6])


@pytest.mark.gpu
def test_fp8_experts_cuda_matches_reference():
    """The CUDA path (torch._scaled_grouped_mm, W8A8) within fp8 activation rounding of the dequantised reference,
    at Kimi's expert shape (H 7168, I 2048) and decode-sized groups (1, 3, 17 rows; an empty group)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    E, H, I = 4, 7168, 2048
    ex = Fp8Experts(E, H, I).cuda()
    ex.synthesize_(g, 61)
    a = torch.randn(21, H, device="cuda", generator=g).bfloat16()
    offs = torch.tensor([1, 4, 4, 21], dtype=torch.int32, device="cuda")
    got = ex.gate_up_mm(a, offs).float()
    ref = ex.cpu().gate_up_mm(a.cpu(), offs.cpu()).float()
    err = (got.cpu() - ref).norm() / ref.norm()
    assert err < 0.05, f"relative error {err:.4f}"


@pytest.mark.parametrize("world,experts,moe", [(1, None, "ep"), (4, None, "ep"), (4, torch.float8_e4m3fn, "ep"),
                                               (4, torch.float8_e4m3fn, "tp")])
def test_memory_plan_counts_a_built_model(world, experts, moe):
    """parallel.memory.rank_bytes' weights (no model built) equal a built rank's own parameter bytes (tiny on the
    meta device, rank 0 of `world`; fp8 experts with their scales), and its caches new_kv's."""
    from eagle3_ops.parallel.memory import rank_bytes
    from eagle3_ops.parallel.target import TPTarget

    cfg = TargetConfig.from_preset("tiny")
    dcfg = DrafterConfig.for_target(cfg)
    tp = TP()
    tp.world = world
    with torch.device("meta"):
        model = TPTarget(cfg, tp, experts, moe).to(torch.bfloat16)
        drafter = Drafter(dcfg, model.model.embed_tokens).to(torch.bfloat16)
    built = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("_scale"))
    plan = rank_bytes(cfg, dcfg, world, 3, 40, expert_bytes=1 if experts else 2, fc="replicated", moe=moe)
    weights = sum(v for k, v in plan.items() if k not in ("latent_cache", "drafter", "drafter_cache", "total"))
    assert weights == built
    d_built = sum(p.numel() * 2 for n, p in drafter.named_parameters() if "embed" not in n)
    assert plan["drafter"] == d_built
    kv = model.new_kv(3, 40, page_size=8, device="meta")
    assert plan["latent_cache"] == sum(c.numel() * 2 for c in kv.caches) * 40 / kv.capacity


def test_synthesize_tp_replicated_weights_agree():
    """synthesize_tp draws the replicated tensors (embedding, latent projections, gate and its bias, norms) alike
    on every rank and the shards per rank; with fp8 experts (kept fp8 through .to(dtype)) the forward runs."""
    from eagle3_ops.parallel import synthesize_tp

    cfg = TargetConfig.from_preset("tiny")
    ranks = []
    for r in range(2):
        tp = TP()
        tp.rank, tp.world = r, 2
        ranks.append(synthesize_tp(cfg, tp, 3, torch.float32, "cpu", torch.float8_e4m3fn))
    a, b = (dict(m.state_dict()) for m in ranks)
    for name in (n for n in a if not n.endswith("_scale")):  # (the fp8 scales are constants)
        same = torch.equal(a[name].float(), b[name].float())
        replicated = any(k in name for k in ("embed_tokens", "q_a_proj", "kv_a_proj_with_mqa", "mlp.gate.", "norm"))
        assert same == replicated or (same and a[name].numel() == 1), name
    assert ranks[0].model.layers[1].mlp.experts.gate_up.dtype == torch.float8_e4m3fn
    one = synthesize_tp(cfg, TP(), 3, torch.float32, "cpu", torch.float8_e4m3fn)  # (no group: world 1)
    B, N = 2, 3
    logits = one.forward(torch.zeros(B, N, dtype=torch.int64), torch.arange(N).expand(B, N), one.new_kv(B, 8),
                         tree_mask(chain_parents(B, N)))
    assert logits.shape == (B * N, cfg.vocab_size) and torch.isfinite(logits).all()


def test_moe_experts_read():
    """One token reads k experts in all: tp 1/world of each (k / world experts' worth a rank), ep the same on
    average but the busiest rank more; many tokens use nearly every expert and the two meet."""
    from eagle3_ops.parallel.memory import moe_experts_read

    cfg = TargetConfig.from_preset("kimi-k2")
    one = moe_experts_read(cfg, 8, 1, trials=500)
    assert one["distinct"] == 8 and one["tp"] == 1.0 and abs(one["ep_mean"] - 1.0) < 1e-6 and one["ep_max"] >= 2
    many = moe_experts_read(cfg, 8, 512, trials=50)
    assert many["ep_max"] / many["tp"] < 1.05
