"""The plain-PyTorch glue (eagle3_ops.engine.torch_glue), issue 7's comparison: each function gives what the
torch.ops.eagle3 call it stands for gives, and the decode loop with glue="torch" (plain capture, gathered fc,
SGLang's build_tree, argmax + walk, per-layer KV copies) emits the same tokens as with our ops and as plain
greedy decoding."""

from __future__ import annotations

import pytest
import torch

from eagle3_ops import ops, tree
from eagle3_ops.engine import SpecConfig, Timer, decode, generate_plain, generate_speculative, torch_glue
from eagle3_ops.models.config import DrafterConfig, TargetConfig
from eagle3_ops.models.drafter import Drafter
from eagle3_ops.models.target import Target

CFG = TargetConfig.from_preset("tiny")


def test_build_tree_builds_the_same_tree_as_the_op():
    # SGLang orders the nodes by candidate index, ours by score: the same nodes, at the same depths.
    g = torch.Generator().manual_seed(0)
    B, topk, depth, N = 3, 3, 3, 7
    M = topk * topk
    scores = torch.full((B, depth, M), float("-inf"))
    parents = torch.full((B, depth, M), -1, dtype=torch.int64)
    scores[:, 0, :topk] = torch.log_softmax(torch.randn(B, 100, generator=g), -1).topk(topk).values
    for d in range(1, depth):  # EAGLE's beams: each step's top-k, their top-k children
        beams = scores[:, d - 1].topk(topk).indices
        child = torch.log_softmax(torch.randn(B, topk, 100, generator=g), -1).topk(topk).values
        scores[:, d] = (scores[:, d - 1].gather(1, beams)[:, :, None] + child).reshape(B, M)
        parents[:, d] = beams.repeat_interleave(topk, 1)
    draft = torch.randperm(B * depth * M, generator=g).view(B, depth, M)  # distinct tokens
    args = (torch.full((B,), 10**6), draft, scores, parents, torch.tensor([5, 0, 9], dtype=torch.int32))
    (t1, p1, pos1, _), (t2, p2, pos2, _) = torch_glue.build_tree(*args, num_nodes=N), ops.build_tree(*args, num_nodes=N)
    assert torch.equal(t1.sort(1).values, t2.sort(1).values)
    for b in range(B):  # the same depth for each token
        assert dict(zip(t1[b].tolist(), pos1[b].tolist())) == dict(zip(t2[b].tolist(), pos2[b].tolist()))
        # the same parent token for each token
        par1 = {t1[b, i].item(): (t1[b, p1[b, i]].item() if p1[b, i] >= 0 else None) for i in range(N)}
        par2 = {t2[b, i].item(): (t2[b, p2[b, i]].item() if p2[b, i] >= 0 else None) for i in range(N)}
        assert par1 == par2


def test_verify_and_kv_accept_match_the_ops():
    g = torch.Generator().manual_seed(1)
    B, N, V = 4, 6, 40
    parents = tree.random_parents(B, N, g, "bushy")
    tokens = torch.randint(0, V, (B, N), generator=g)
    logits = torch.randn(B * N, V, generator=g)
    logits.view(B, N, V)[:, :, 7] += 5.0  # argmax 7 mostly: some drafts accepted
    tokens[:, 1::2] = 7
    want = ops.verify_greedy(logits, tokens, parents)
    got = torch_glue.verify_greedy(logits, tokens, parents)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    accept_nodes, accept_len, _ = want
    caches = [torch.randn(12, 4, 5, generator=g) for _ in range(3)]
    page_table = torch.randperm(12, generator=g).view(B, 3).int()
    prefix = torch.tensor([1, 0, 5, 2], dtype=torch.int32)
    mine = [c.clone() for c in caches], prefix.clone()
    ops.kv_accept(caches, page_table, prefix, accept_nodes, accept_len)
    torch_glue.kv_accept(mine[0], page_table, mine[1], accept_nodes, accept_len)
    assert all(torch.equal(a, b) for a, b in zip(caches, mine[0])) and torch.equal(prefix, mine[1])



def test_kv_accept_moves_fp8_rows_as_the_op_does():
    """fp8 e4m3 caches (index_copy_ has no float8 kernel on CPU): the glue moves their bytes, as the op."""
    g = torch.Generator().manual_seed(2)
    B, N = 2, 4
    accept_nodes = torch.tensor([[0, 2, 3, 1], [0, 1, 2, 3]], dtype=torch.int32)
    accept_len = torch.tensor([2, 0], dtype=torch.int32)
    caches = [torch.randn(6, 4, 8, generator=g).to(torch.float8_e4m3fn) for _ in range(2)]
    page_table = torch.randperm(6, generator=g).view(B, 3).int()
    prefix = torch.tensor([3, 5], dtype=torch.int32)
    mine = [c.clone() for c in caches], prefix.clone()
    ops.kv_accept(caches, page_table, prefix, accept_nodes, accept_len)
    torch_glue.kv_accept(mine[0], page_table, mine[1], accept_nodes, accept_len)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches, mine[0]))
    assert torch.equal(prefix, mine[1])

@pytest.fixture(scope="module")
def pair():
    target = Target.synthesize(CFG, seed=0).eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(CFG), target.model.embed_tokens, seed=1).eval()
    return target, drafter


def test_plain_capture_fills_aux_as_the_fused_capture_does(pair):
    target, _ = pair
    tokens = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    ids = [-1, 3, CFG.num_layers - 1]  # the embedding, a middle layer, the last (captured at the final norm)
    auxes = []
    for plain in (False, True):
        target.plain_capture = plain
        kv = target.new_kv(2, 8, page_size=4)
        aux = torch.full((10, 3 * CFG.hidden_size), float("nan"))
        logits = target.forward(tokens, torch.arange(5).expand(2, 5), kv, tree.tree_mask(tree.chain_parents(2, 5)),
                                aux, ids)
        auxes.append((aux, logits))
    target.plain_capture = False
    assert torch.equal(auxes[0][0], auxes[1][0]) and torch.equal(auxes[0][1], auxes[1][1])


@pytest.mark.parametrize("spec", [SpecConfig(steps=3, topk=1, num_tokens=4), SpecConfig(steps=3, topk=2, num_tokens=6)])
def test_loop_with_torch_glue_emits_the_same_tokens(pair, spec):
    target, drafter = pair
    prompts = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    plain, _ = generate_plain(target, prompts, 20)
    ours, s1 = generate_speculative(target, drafter, prompts, 20, spec)
    theirs, s2 = generate_speculative(target, drafter, prompts, 20, spec, glue="torch")
    assert torch.equal(ours, plain) and torch.equal(theirs, plain)
    assert s1.accept_hist == s2.accept_hist
    assert target.plain_capture is False
    with pytest.raises(ValueError, match="glue must be"):
        generate_speculative(target, drafter, prompts, 4, spec, glue="sglang")


def test_chunked_prefill_keeps_the_loop_lossless(pair, monkeypatch):
    # Prompts of 9 tokens prefilled 3 positions at a time (PREFILL_TOKENS 6 over 2 requests): target and
    # drafter extend chunk by chunk; plain and speculative decoding agree, and with the unchunked prefill.
    from eagle3_ops.engine import decode

    target, drafter = pair
    prompts = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    whole, _ = generate_plain(target, prompts, 12)
    monkeypatch.setattr(decode, "PREFILL_TOKENS", 6)
    assert decode._prefill_chunks(2, 9) == [(0, 3), (3, 3), (6, 3)]
    plain, _ = generate_plain(target, prompts, 12)
    spec, _ = generate_speculative(target, drafter, prompts, 12, SpecConfig(steps=3, topk=1, num_tokens=4))
    assert torch.equal(plain, whole) and torch.equal(spec, plain)


@pytest.mark.parametrize("spec", [SpecConfig(steps=3, topk=1, num_tokens=4), SpecConfig(steps=3, topk=2, num_tokens=6)])
@pytest.mark.parametrize("glue", ["eagle3", "torch"])
@pytest.mark.parametrize("mode", ["steps", "round"])
def test_graph_steps_give_the_same_tokens(pair, spec, glue, mode):
    # graphs="steps": every static step through engine/graphs.StepGraph. On the CPU it runs eagerly but its
    # outputs are static tensors overwritten at each call, as a CUDA graph's are: the loop must not read an
    # output after the step's next call. graphs="round" (True): each round through RoundGraph, whose warm-up
    # rounds (run here too, then undone) must leave no trace.
    target, drafter = pair
    prompts = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    plain, _ = generate_plain(target, prompts, 16)
    plain_g, _ = generate_plain(target, prompts, 16, graphs=mode)
    spec_g, st = generate_speculative(target, drafter, prompts, 16, spec, glue=glue, graphs=mode)
    spec_e, se = generate_speculative(target, drafter, prompts, 16, spec, glue=glue)
    assert torch.equal(plain_g, plain) and torch.equal(spec_g, plain) and torch.equal(spec_e, plain)
    assert st.accept_hist == se.accept_hist


@pytest.mark.parametrize("mode", ["steps", "round"])
def test_graphs_keep_sampled_decoding_exact(pair, mode):
    # sampled verification under graphs: the per-round Philox offset lives in the loop's state, so a round
    # graph's warm-up (undone) must not move it: the same tokens as the eager loop
    target, drafter = pair
    prompts = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(8))
    spec = SpecConfig(steps=3, topk=2, num_tokens=6, temperature=0.8, seed=3)
    eager, se = generate_speculative(target, drafter, prompts, 14, spec)
    graphed, sg = generate_speculative(target, drafter, prompts, 14, spec, graphs=mode)
    assert torch.equal(graphed, eager) and sg.accept_hist == se.accept_hist


def test_graphs_refuse_the_batch_invariant_mode(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="graphs must be"):
        generate_speculative(target, drafter, torch.zeros(1, 3, dtype=torch.long), 2, graphs="always")
    target.batch_invariant_rows = 8
    try:
        with pytest.raises(ValueError, match="batch-invariant mode"):
            generate_plain(target, torch.zeros(1, 3, dtype=torch.long), 2, graphs=True)
    finally:
        target.batch_invariant_rows = 0


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [SpecConfig(steps=3, topk=1, num_tokens=4), SpecConfig(steps=3, topk=2, num_tokens=6)])
def test_gpu_graphed_loop_matches_eager(spec):
    # The same loop with real CUDA graphs (capture, then replays with new inputs in the static buffers), bf16
    # (the grouped MoE is sync-free in bf16 only): graphed runs give the eager runs' tokens, bit for bit.
    target = Target.synthesize(CFG, seed=0, dtype=torch.bfloat16, device="cuda").eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(CFG), target.model.embed_tokens, seed=1,
                                 dtype=torch.bfloat16, device="cuda").eval()
    prompts = torch.randint(0, CFG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(6)).cuda()
    plain, _ = generate_plain(target, prompts, 20)
    plain_g, pg = generate_plain(target, prompts, 20, graphs=True)
    spec_e, se = generate_speculative(target, drafter, prompts, 20, spec)
    assert torch.equal(plain_g, plain)
    # per-step graphs with a fenced timer; whole-round graphs untimed, and with CUDA events recorded inside
    # the graph (read after each replay)
    fence, events = Timer(device="cuda"), Timer(device="cuda", mode="events")
    spec_s, ss = generate_speculative(target, drafter, prompts, 20, spec, graphs="steps", timer=fence)
    spec_r, sr = generate_speculative(target, drafter, prompts, 20, spec, graphs=True)
    spec_t, stt = generate_speculative(target, drafter, prompts, 20, spec, graphs="round", timer=events)
    for out, st in ((spec_s, ss), (spec_r, sr), (spec_t, stt)):
        assert torch.equal(out, spec_e) and st.accept_hist == se.accept_hist
        assert 0 < st.setup_seconds  # the captures, timed apart from the decode phase
    assert 0 < pg.setup_seconds < pg.seconds - pg.prefill_seconds
    # the captures are taken out of the fenced components
    decode = ss.seconds - ss.prefill_seconds - ss.setup_seconds
    assert all(t > 0 for t in fence.times.values()) and sum(fence.times.values()) - sum(ss.prefill_times.values()) \
        <= decode * 1.001
    # inside the round graph: every component timed at every replay, and within the rounds' spans
    parts = {k: v - stt.prefill_times.get(k, 0.0) for k, v in events.times.items()}
    assert set(parts) >= {"target", "draft", "fc", "build_tree", "verify", "kv_accept"}
    assert all(v > 0 for v in parts.values()) and 0 < sum(parts.values()) <= stt.round_seconds * 1.001
    with pytest.raises(ValueError, match="fenced Timer"):
        generate_speculative(target, drafter, prompts, 4, spec, graphs=True, timer=Timer(device="cuda"))
    with pytest.raises(ValueError, match="needs a bf16 target"):
        generate_plain(target.float(), prompts, 2, graphs=True)


def test_graph_setup_is_taken_out_of_the_timer():
    # _setup_seconds: each graph's capture time leaves the component it was timed in, and is summed
    class Captured:
        def __init__(self, s):
            self.setup_seconds = s

    timer = Timer()
    timer.times.update(target=1.0, draft=2.0, fc=0.5)
    total = decode._setup_seconds(timer, dict(target=[Captured(0.25)], draft=[Captured(0.5), Captured(0.125)],
                                              fc=[Captured(0.0)]))
    assert total == 0.875 and dict(timer.times) == dict(target=0.75, draft=1.375, fc=0.5)
    off = Timer(enabled=False)
    assert decode._setup_seconds(off, dict(target=[Captured(0.25)])) == 0.25 and not off.times


def test_timer_reads_only_the_latest_graphs_marks():
    # after_replay adds the sections recorded inside the graph being replayed; a new capture (new_graph)
    # drops an earlier graph's marks, so a Timer reused across runs does not count them again
    class Ev:
        def __init__(self, t):
            self.t = t

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    timer = Timer(mode="events")
    timer._graph_marks.append(("target", Ev(0.0), Ev(1.0)))  # as a capture records them (ms)
    for _ in range(3):
        timer.after_replay()
    timer.new_graph()
    timer._graph_marks.append(("target", Ev(0.0), Ev(2.0)))
    for _ in range(3):
        timer.after_replay()
    assert abs(timer.times["target"] - 0.009) < 1e-12
