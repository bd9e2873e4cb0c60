"""engine.fused: the decode loop's small steps as Triton kernels (triton_kernels/decode_round.py), held to the
PyTorch code beside them (the specification) on fresh random states: Kimi's widths (163840 scores, 7168
hidden), batch 1 and 8, chain and tree widths, finished (frozen) requests, ties, odd sizes, strided rows.
Outputs are poisoned first. On the CPU the kernels run under TRITON_INTERPRET=1 (fp32 / fp16 only); the gpu
test runs them in bf16 on the H200."""

from __future__ import annotations

import os

import pytest
import torch

from eagle3_ops.engine import fused
from tests.conftest import assert_equal, poison_

# each test on the CPU (Triton's interpreter) and, marked gpu, on CUDA
DEVS = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                    reason="Triton on the CPU needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=pytest.mark.gpu)]


def _check_top(x, K):
    """The kernels against the torch path (values) and a stable descending sort (ids: the lower id first on
    ties, where torch's topk leaves the order unspecified)."""
    lp, ids = fused.top_logprobs(x, K, impl="triton")
    ref_lp, _ = fused.top_logprobs(x, K, impl="torch")
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64 and lp.shape == ref_lp.shape
    assert_equal(ids, x.float().sort(dim=-1, descending=True, stable=True).indices[..., :K], "ids")
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("K", [1, 4, 16])
@pytest.mark.parametrize("shape", [(1, 163840), (3, 5, 1000), (2, 1), (4, 4097), (1, 4096), (2, 20)])
def test_top_logprobs_triton_matches_torch(gen, dev, shape, K):
    if shape[-1] < K:
        pytest.skip("fewer scores than K")
    for dtype in (torch.float32, torch.float16):
        x = (torch.randn(*shape, generator=gen) * 4).to(dtype).to(dev)
        _check_top(x, K)


@pytest.mark.parametrize("dev", DEVS)
def test_top_logprobs_ties_infinities_and_strided_rows(gen, dev):
    x = torch.randn(2, 3, 9000, generator=gen)
    x[0, 0] = 1.0  # all tied: id 0
    x[0, 1, 8191] = x[0, 1, 4100] = x[0, 1, 9] = 50.0  # tied maxima in three chunks: the first
    x[1, 0, :4096] = float("-inf")  # a chunk of -inf; and a row of a few finite values
    x[1, 1] = float("-inf")
    x[1, 1, 8999] = 2.0
    x = x.to(dev)
    for K in (1, 3):
        _check_top(x, K)
        _check_top(x[:, 1], K)  # a strided view [B, V] of [B, 3, V], as the chain's drafting reads one step's rows
        _check_top(x[:, 1:3], K)  # [B, 2, V] of [B, 3, V], as the tree's drafting reads its beams' rows (in place)
        _check_top(x.transpose(0, 1), K)  # [3, B, V]: rows in neither order
    lp, ids = fused.top_logprobs(x, 3, impl="triton")
    assert ids[0, 0].tolist() == [0, 1, 2] and ids[0, 1].tolist() == [9, 4100, 8191]
    assert ids[1, 1, 0] == 8999 and lp[1, 1, 0] == 0.0 and ids[1, 1, 1:].tolist() == [0, 1]  # then -inf, lowest id


def test_topk_lse_refuses_other_ranks():
    # decode_round.topk_lse reads [R, V] or [G, RG, V] rows (fused.top_logprobs flattens every other rank first)
    from eagle3_ops.triton_kernels import decode_round

    for shape in [(5,), (2, 2, 2, 5)]:
        with pytest.raises(ValueError, match=r"x must be \[R, V\] or \[G, RG, V\]"):
            decode_round.topk_lse(torch.zeros(shape), 1)


def _round_state(gen, B, N, max_new, frozen, dev):
    """A verify's outputs and the loop's state as a round leaves them: accept_len in [0, N - 1] (the accepted
    nodes a path of distinct increasing ids, -1 padded), emitted -1 padded, `frozen` requests already done."""
    L = max_new + N
    al = torch.randint(0, N, (B,), generator=gen)
    nodes = torch.full((B, N), -1, dtype=torch.int32)
    emitted = torch.full((B, N), -1, dtype=torch.int64)
    for b in range(B):
        path = torch.sort(torch.randperm(N - 1, generator=gen)[:int(al[b])] + 1).values if N > 1 else torch.zeros(0)
        nodes[b, 0] = 0
        nodes[b, 1:int(al[b]) + 1] = path.int()
        emitted[b, :int(al[b]) + 1] = torch.randint(0, 163840, (int(al[b]) + 1,), generator=gen)
    count = torch.randint(1, max_new, (B,), generator=gen)
    count[frozen] = max_new + torch.randint(0, N, (len(frozen),), generator=gen)
    out = torch.randint(-1, 163840, (B, L), generator=gen)
    st = dict(accept_nodes=nodes, accept_len=al.int(), emitted=emitted, count=count, out=out,
              hist=torch.randint(0, 5, (N + 1,), generator=gen), root=torch.randint(0, 163840, (B,), generator=gen),
              tkv_prefix=torch.randint(4096, 4200, (B,), generator=gen).int(),
              dkv_prefix=torch.randint(4096, 4200, (B,), generator=gen).int(), max_new=max_new,
              rows=torch.empty(B * N, dtype=torch.int64), tokens=torch.empty(B, N, dtype=torch.int64),
              positions=torch.empty(B, N, dtype=torch.int64), step=torch.empty(B, dtype=torch.int32))
    return {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in st.items()}


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("B,N,frozen", [(1, 4, []), (1, 1, []), (1, 16, [0]), (8, 4, [2, 5]), (8, 16, []),
                                        (3, 7, [0, 1, 2])])
def test_accept_update_triton_matches_torch(gen, dev, B, N, frozen):
    for _ in range(3):
        st = _round_state(gen, B, N, 61, frozen, dev)
        mine = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        for k in ("rows", "tokens", "positions", "step"):
            poison_(mine[k]), poison_(st[k])
        fused.accept_update(**mine, impl="triton")
        fused.accept_update(**st, impl="torch")
        for k, v in st.items():
            if torch.is_tensor(v):
                assert_equal(mine[k], v, k)


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("B,N,V,H,step", [(1, 4, 163840, 7168, [3]), (8, 4, 1000, 96, [1, 0, 4, 2, 0, 3, 1, 4]),
                                          (2, 16, 4097, 7168, [16, 0]), (1, 1, 5, 3, [1])])
def test_accept_finish_triton_matches_torch(gen, dev, B, N, V, H, step):
    for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if dev == "cuda" else ()):
        logits = torch.randn(B * N, V, generator=gen).to(dtype).to(dev)
        hidden = torch.randn(B * N, H, generator=gen).to(dtype).to(dev)
        last, g = torch.randn(B, V, generator=gen).to(dtype).to(dev), torch.randn(B, H, generator=gen).to(dtype).to(dev)
        st = torch.tensor(step, dtype=torch.int32, device=dev)
        prefix = torch.randint(10, 4000, (B,), generator=gen).int().to(dev)
        args = [logits, hidden, last.clone(), g.clone(), st, prefix.clone()]
        ref = [logits, hidden, last.clone(), g.clone(), st, prefix.clone()]
        fused.accept_finish(*args, impl="triton")
        fused.accept_finish(*ref, impl="torch")
        for name, a, r in zip(("last_logits", "g", "dkv_prefix"), args[2:4] + args[5:], ref[2:4] + ref[5:]):
            assert_equal(a, r, name)


def test_impl_is_checked():
    with pytest.raises(ValueError, match="impl must be"):
        fused.top_logprobs(torch.zeros(1, 4), 1, impl="cuda")


def test_bad_input_is_refused_before_anything_is_written(gen):
    """Wrong shapes, dtypes, strides and K are named, whichever impl, and no caller tensor is touched."""
    with pytest.raises(ValueError, match="K must be in"):
        fused.top_logprobs(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="K must be in"):
        fused.top_logprobs(torch.zeros(2, 4), 0)
    bad = {"accept_len": lambda t: t.long(), "hist": lambda t: t[:-1], "out": lambda t: t[:, :10],
           "count": lambda t: t.int(), "tokens": lambda t: torch.empty(t.shape[1], t.shape[0], dtype=t.dtype).t()}
    for impl in ("torch", "triton"):
        for name, spoil in bad.items():
            st = _round_state(gen, 3, 4, 61, [1], "cpu")
            st[name] = spoil(st[name])
            before = {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
            with pytest.raises(ValueError, match=name):
                fused.accept_update(**st, impl=impl)
            for k, v in before.items():
                assert_equal(st[k], v, f"{k} after a refused call")
        logits, hidden = torch.randn(8, 10, generator=gen), torch.randn(8, 6, generator=gen)
        last, g = torch.zeros(2, 10), torch.zeros(2, 6)
        step, prefix = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([5, 6], dtype=torch.int32)
        with pytest.raises(ValueError, match="g must be"):
            fused.accept_finish(logits, hidden, last, g.half(), step, prefix, impl=impl)
        with pytest.raises(ValueError, match="last_logits must be"):
            fused.accept_finish(logits, hidden, last[:, :5], g, step, prefix, impl=impl)
        with pytest.raises(ValueError, match="share their rows"):
            fused.accept_finish(logits[:7], hidden, last, g, step, prefix, impl=impl)
        assert not last.any() and not g.any() and prefix.tolist() == [5, 6]


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_gpu_top_logprobs_bf16(gen, B):
    for V in (163840, 32000):
        x = (torch.randn(B, 3, V, generator=gen) * 3).to(torch.bfloat16).cuda()
        _check_top(x, 1)
        _check_top(x[:, 1], 1)
        _check_top(x, 4)
        _check_top(x[:, 1:], 4)  # the tree's drafting: a [B, K, V] slice of its block's rows
        _check_top(x.float(), 4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("steps,topk,num_tokens", [(3, 1, 4), (3, 2, 6), (2, 4, 8)])
def test_loop_with_the_kernels_matches_the_loop_without(monkeypatch, steps, topk, num_tokens):
    """The whole decode loop on a tiny pair, its small steps through the kernels (the interpreter) against
    through PyTorch: the same tokens (plain greedy's), the same acceptance histogram and rounds. The ORACLE
    drafter at p = 0.7 makes acceptance vary, so requests finish in different rounds (the others frozen)."""
    from eagle3_ops.engine import SpecConfig, generate_plain, generate_speculative
    from eagle3_ops.engine.oracle import OracleDrafter
    from eagle3_ops.models.config import DrafterConfig, TargetConfig
    from eagle3_ops.models.drafter import Drafter
    from eagle3_ops.models.target import Target

    cfg = TargetConfig.from_preset("tiny")
    target = Target.synthesize(cfg, 0, torch.float32).eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(cfg), target.model.embed_tokens, 1, torch.float32).eval()
    prompts = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(steps * topk))
    spec = SpecConfig(steps, topk, num_tokens)
    plain, _ = generate_plain(target, prompts, 21)
    runs = []
    for use in (False, True):
        monkeypatch.setattr(fused, "_triton", lambda x, impl, use=use: use)
        oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), 0.7, cfg.vocab_size, start=8)
        runs.append(generate_speculative(target, oracle, prompts, 19, spec))
    (ref, ref_st), (mine, st) = runs
    assert torch.equal(mine, plain[:, :19]) and torch.equal(ref, plain[:, :19])
    assert st.accept_hist == ref_st.accept_hist and st.rounds == ref_st.rounds
    assert sum(1 for n in st.accept_hist[2:] if n) >= 2, f"acceptance too uniform to test much: {st.accept_hist}"


@pytest.mark.parametrize("steps,topk", [(4, 3), (3, 2), (2, 4), (4, 1)])
def test_draft_block_masks_are_each_rows_ancestors(steps, topk):
    """The drafting's block mask, checked by meaning: every draft step's row sees itself and exactly its
    beam's ancestors in the block. Each row's parent is found from the hidden states (the fake drafter's
    outputs are distinct per call and row, and a new beam's input is its parent's output)."""
    from eagle3_ops import tree
    from eagle3_ops.engine import SpecConfig, Timer
    from eagle3_ops.engine.decode import _draft_candidates, _Drafting

    B, V, H = 2, 40, 4
    spec = SpecConfig(steps, topk, 1 + topk * (steps - 1) + 1 if topk > 1 else steps + 1)
    NB = (steps - 1) * topk
    gen = torch.Generator().manual_seed(steps * 10 + topk)
    calls = []

    def draft_step(tokens, hidden, positions, mask):
        n = len(calls)
        out_h = (1000.0 * (n + 1) + torch.arange(B * NB, dtype=torch.float32))[:, None].expand(B * NB, H)
        calls.append((hidden.view(B, NB, H)[..., 0].clone(), tree.mask_to_dense(mask, NB)))
        return torch.randn(B * NB, V, generator=gen), out_h.clone()

    d = _Drafting(B, spec, H, torch.float32, "cpu")
    _draft_candidates(draft_step, torch.randn(B, V, generator=gen), torch.zeros(B, H), torch.full((B,), 7),
                      spec, Timer(enabled=False), lambda ids: ids, d)
    assert len(calls) == steps - 1
    for s, (inputs, dense) in enumerate(calls, start=1):
        lo = (s - 1) * topk
        for b in range(B):
            for r in range(lo + topk):  # the rows written so far (later ones see only themselves)
                if r < topk:  # depth 1: the root's children see only themselves
                    want = {r}
                else:  # a deeper beam: its parent's row (whose output, in call depth - 1, it took as input) and
                    # that row's ancestors
                    depth = r // topk + 1
                    prev_out = 1000.0 * (depth - 1) + torch.arange(B * NB, dtype=torch.float32).view(B, NB)
                    parent = int((prev_out[b] == inputs[b, r]).nonzero()[0])
                    want = {r} | {j for j in range(NB) if dense[b, parent, j]}
                assert {j for j in range(NB) if dense[b, r, j]} == want, (s, b, r)
