"""The reference target (eagle3_ops.models.target): the inference step (absorbed MLA over the paged latent
cache, through torch.ops.eagle3) equals the plain causal forward; the aux capture is wired to the layers it
names (HF output_hidden_states[k + 1]); MoE routing, YaRN RoPE and the softmax scale follow docs/models.md;
state_dict names are Hugging Face's and survive a save / load round trip."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3_ops import tree, wiring
from eagle3_ops.models.config import TargetConfig
from eagle3_ops.models.loading import load_target, read_config, save_pretrained
from eagle3_ops.models.rope import apply_rope, yarn_inv_freq
from eagle3_ops.models.target import MoE, Target, route
from tests.conftest import capture_graph, rel_err

TINY = TargetConfig.from_preset("tiny")  # 8 layers, MoE with 2 groups, a dense first layer, q compression
L, H = TINY.num_layers, TINY.hidden_size
B, T, T0 = 2, 13, 7  # T0 = 7 with page_size 4: the prefill straddles a page; 13 ends mid-page
PAGE = 4
TOL = 1e-4  # fp32: the absorbed step reassociates the same math (measured ~4e-7)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes gain nothing from intra-op threads, and on a busy 2-core machine OpenMP ops (index_add_)
    can stall for milliseconds each: run this module single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return Target.synthesize(TINY, seed=0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, TINY.vocab_size, (B, T), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def train_out(model, prompt):
    with torch.no_grad():
        return model.forward_train(prompt, output_hidden_states=True)


def _chain(Bn, N):
    return tree.tree_mask(tree.chain_parents(Bn, N))


def _prefill(model, tokens, kv, aux=None, aux_ids=()):
    Bn, N = tokens.shape
    return model(tokens, torch.arange(N).expand(Bn, N), kv, _chain(Bn, N), aux, aux_ids)


# ---- (a) the inference step equals forward_train ----------------------------------------------------


def test_step_in_pieces_equals_forward_train(model, prompt, train_out):
    ref = train_out[0]  # [B, T, V]
    kv = model.new_kv(B, T, page_size=PAGE)
    logits = _prefill(model, prompt[:, :T0], kv)
    assert logits.shape == (B * T0, TINY.vocab_size) and logits.dtype == torch.float32
    assert kv.prefix_lens.tolist() == [0] * B, "forward must not advance prefix_lens"
    assert rel_err(logits.view(B, T0, -1), ref[:, :T0]) < TOL
    kv.advance(T0)
    for t in range(T0, T):  # decode one token at a time (N = 1)
        step = model(prompt[:, t:t + 1], torch.full((B, 1), t), kv, _chain(B, 1))
        kv.advance(1)
        assert rel_err(step, ref[:, t]) < TOL, f"position {t}"


@pytest.mark.parametrize("overrides", [
    dict(q_lora_rank=None),  # q = x W_q (DeepSeek-V2-Lite style)
    dict(n_group=1, topk_group=1, n_shared_experts=0, first_k_dense_replace=0),  # no groups, no shared expert
], ids=["q_proj", "ungrouped_no_shared"])
def test_step_equals_forward_train_on_variants(prompt, overrides):
    m = Target.synthesize(TargetConfig.from_preset("tiny", num_layers=3, **overrides), seed=1)
    with torch.no_grad():
        ref = m.forward_train(prompt)
    kv = m.new_kv(B, T, page_size=PAGE)
    logits = _prefill(m, prompt[:, :T0], kv)
    kv.advance(T0)
    step = m(prompt[:, T0:T0 + 1], torch.full((B, 1), T0), kv, _chain(B, 1))
    assert rel_err(logits.view(B, T0, -1), ref[:, :T0]) < TOL and rel_err(step, ref[:, T0]) < TOL


# ---- (b) a tree step --------------------------------------------------------------------------------


def test_tree_step_equals_forward_train_on_each_path(model, prompt):
    # Requests at different prefix lengths (7 and 5: request 1's rows 5, 6 are stale and get overwritten).
    # N = 35 nodes: the mask spans two int32 words.
    N, g = 35, torch.Generator().manual_seed(3)
    kv = model.new_kv(B, T0 + N, page_size=PAGE)
    _prefill(model, prompt[:, :T0], kv)
    kv.advance(torch.tensor([T0, T0 - 2], dtype=torch.int32))
    parents = tree.random_parents(B, N, g, "bushy")
    tokens = torch.randint(0, TINY.vocab_size, (B, N), generator=g)
    positions = tree.positions(parents, kv.prefix_lens)
    before = kv.prefix_lens.clone()
    logits = model(tokens, positions, kv, tree.tree_mask(parents)).view(B, N, -1)
    assert torch.equal(kv.prefix_lens, before)
    # Reference: forward_train on prefix + the node's ancestor path, batched by sequence length.
    seqs = {}
    for b in range(B):
        prefix = int(kv.prefix_lens[b])
        for j in range(N):
            path, i = [], j
            while i >= 0:
                path.append(i)
                i = int(parents[b, i])
            seq = torch.cat([prompt[b, :prefix], tokens[b, path[::-1]]])
            assert len(seq) - 1 == int(positions[b, j])  # the node sits at prefix + depth
            seqs.setdefault(len(seq), []).append((b, j, seq))
    with torch.no_grad():
        for items in seqs.values():
            ref = model.forward_train(torch.stack([s for _, _, s in items]))[:, -1]
            for (b, j, _), r in zip(items, ref):
                assert rel_err(logits[b, j], r) < TOL, f"request {b} node {j}"


# ---- (c) the wiring: aux id k is HF output_hidden_states[k + 1] --------------------------------------


@pytest.mark.parametrize("ids", [
    [0, L // 2, L - 1, -1],  # first, middle, last layer and the embedding (explicit opt-in)
    [5, -1, 2, 7, 0, 6, 1, 4, 3],  # every site, slots in shuffled order (slot order is the id order)
], ids=["brief", "all_shuffled"])
def test_aux_capture_is_hf_hidden_states_k_plus_1(model, prompt, train_out, ids):
    ids = wiring.validate_aux_ids(ids, L, allow_embedding=True)
    with pytest.raises(ValueError, match="allow_embedding"):
        wiring.validate_aux_ids(ids, L)  # the embedding is never captured without the opt-in
    hs = train_out[1]
    assert len(hs) == L + 1
    # HF's last entry is *after* the final norm; aux id L-1 is the pre-norm output of layer L-1, i.e. the
    # final norm's input: catch it with a hook.
    pre_norm = {}
    handle = model.model.norm.register_forward_hook(lambda mod, inp, out: pre_norm.setdefault("x", inp[0]))
    try:
        with torch.no_grad():
            model.forward_train(prompt)
    finally:
        handle.remove()
    aux = torch.full((B * T, len(ids) * H), float("nan"))
    _prefill(model, prompt, model.new_kv(B, T, page_size=PAGE), aux, ids)
    assert not aux.isnan().any(), "every slot must be written"
    for slot, k in enumerate(ids):
        got = aux[:, slot * H:(slot + 1) * H].view(B, T, H)
        want = pre_norm["x"] if k == L - 1 else hs[k + 1]
        if k == -1:
            assert torch.equal(got, hs[0]), "id -1 must be the embedding exactly"
        else:
            assert rel_err(got, want) < TOL, f"slot {slot} (id {k})"
        if k == L - 1:
            with torch.no_grad():
                assert rel_err(model.model.norm(got), hs[L]) < TOL  # normed, it is HF's last entry
        for off in (k, k + 2):  # one layer early or late must not pass: the check can see off-by-ones
            if 0 <= off < L:
                assert rel_err(got, hs[off]) > 1e-2, f"slot {slot} (id {k}) also matches hs[{off}]"


def test_aux_needs_a_buffer(model, prompt):
    with pytest.raises(ValueError, match="aux"):
        _prefill(model, prompt[:, :3], model.new_kv(B, 3), None, [1])


# ---- (d) MoE routing ---------------------------------------------------------------------------------


def test_route_hand_checked():
    # tiny: 8 experts in 2 groups of 4, keep 1 group, pick 2, scaling 2.5.
    s = torch.tensor([[0.90, 0.10, 0.10, 0.10, 0.60, 0.60, 0.50, 0.10]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -0.2, 0.2, 0.0])
    # biased: [.9 .1 .1 .1 | .6 .4 .7 .1]. Group score = sum of its top-2 biased: group 0 = 1.0, group 1 = 1.3,
    # so group 1 wins although expert 0 has the best score (a max-per-group rule would keep group 0).
    # In group 1 the top-2 biased are experts 6 (0.7) and 4 (0.6); expert 5 (s = 0.6) loses to its bias.
    # Weights use the unbiased s of 6 and 4: 0.5 and 0.6, normalised, times 2.5.
    idx, w = route(s, bias, TINY)
    assert idx.tolist() == [[6, 4]]
    torch.testing.assert_close(w, torch.tensor([[0.5 / 1.1 * 2.5, 0.6 / 1.1 * 2.5]]), rtol=1e-6, atol=0)
    # Without groups the best two biased scores overall are experts 0 and 6.
    idx, w = route(s, bias, TargetConfig.from_preset("tiny", n_group=1, topk_group=1))
    assert idx.tolist() == [[0, 6]]
    torch.testing.assert_close(w, torch.tensor([[0.9 / 1.4 * 2.5, 0.5 / 1.4 * 2.5]]), rtol=1e-6, atol=0)
    # A negative bias never makes a masked group's expert win (masked scores are -inf, not 0).
    idx, _ = route(torch.full((1, 8), 0.1), torch.tensor([-1.0] * 4 + [-0.5, -0.9, -0.9, -0.9]), TINY)
    assert sorted(idx[0].tolist()) == [4, 5]


def test_moe_layer_equals_a_per_token_brute_force(model):
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = moe(x)  # no gradient, fp32: the grouped GEMMs
        y_loop = moe(x, grouped=False)  # the per-expert gather (training, fp64): same sums
        E, G, K = TINY.n_routed_experts, TINY.n_group, TINY.num_experts_per_tok
        bias = moe.gate.e_score_correction_bias.tolist()
        for t in range(x.shape[0]):
            s = torch.sigmoid(x[t].double() @ moe.gate.weight.double().T).tolist()
            biased = [s[e] + bias[e] for e in range(E)]
            per = E // G
            gscore = [sum(sorted(biased[g * per:(g + 1) * per])[-2:]) for g in range(G)]
            groups = sorted(range(G), key=lambda g: -gscore[g])[:TINY.topk_group]
            cand = sorted((e for g in groups for e in range(g * per, (g + 1) * per)), key=lambda e: -biased[e])[:K]
            total = sum(s[e] for e in cand)
            want = sum(s[e] / total * TINY.routed_scaling_factor * moe.experts[e](x[t]).double() for e in cand)
            want = want + moe.shared_experts(x[t]).double()
            assert rel_err(y[t], want) < 1e-5, f"token {t}"
    assert rel_err(y_loop, y) < 1e-6


def test_moe_experts_keep_hugging_face_names_as_views_of_the_stacks(model):
    moe = model.model.layers[1].mlp
    sd = moe.state_dict()
    I = TINY.moe_intermediate_size
    assert "experts.gate_up" not in sd and sd["experts.3.up_proj.weight"].shape == (I, H)
    assert sd["experts.3.up_proj.weight"].data_ptr() == moe.experts.gate_up[3, I:].data_ptr()
    assert list(sd)[2:5] == ["experts.0.gate_proj.weight", "experts.0.up_proj.weight",
                                    "experts.0.down_proj.weight"]  # HF's order, after the gate's two


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_moe_grouped_path_in_a_cuda_graph(T):
    # The inference MoE (grouped GEMMs, bf16) against the per-expert loop, then captured in a CUDA graph
    # (no host sync) and replayed on new tokens in the same buffer. Kimi's routing: 384 experts, top 8.
    cfg = TargetConfig.from_preset("tiny", n_routed_experts=384, num_experts_per_tok=8, n_group=8, topk_group=4,
                                   hidden_size=128, moe_intermediate_size=64)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    moe = moe.to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = moe(x, grouped=False)
        got = moe(x)
        assert rel_err(got, want) < 2e-2
        graph, out = capture_graph(lambda: moe(x))
        x.copy_(torch.randn(T, 128, generator=g, device="cuda", dtype=torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(x))


# ---- (e) Hugging Face names and the save / load round trip ------------------------------------------


def _hf_keys(cfg):
    keys = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,),
            "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    NH, Hh = cfg.num_heads, cfg.hidden_size
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        keys[p + "input_layernorm.weight"] = (Hh,)
        keys[p + "post_attention_layernorm.weight"] = (Hh,)
        a = p + "self_attn."
        keys[a + "q_a_proj.weight"] = (cfg.q_lora_rank, Hh)
        keys[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        keys[a + "q_b_proj.weight"] = (NH * cfg.qk_head_dim, cfg.q_lora_rank)
        keys[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, Hh)
        keys[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        keys[a + "kv_b_proj.weight"] = (NH * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        keys[a + "o_proj.weight"] = (Hh, NH * cfg.v_head_dim)

        def mlp(prefix, inter):
            keys[prefix + "gate_proj.weight"] = (inter, Hh)
            keys[prefix + "up_proj.weight"] = (inter, Hh)
            keys[prefix + "down_proj.weight"] = (Hh, inter)
        if i < cfg.first_k_dense_replace:
            mlp(p + "mlp.", cfg.intermediate_size)
        else:
            keys[p + "mlp.gate.weight"] = (cfg.n_routed_experts, Hh)
            keys[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                mlp(f"{p}mlp.experts.{e}.", cfg.moe_intermediate_size)
            mlp(p + "mlp.shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts)
    return keys


def test_state_dict_has_exactly_the_hf_names(model):
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = _hf_keys(TINY)
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not extra and not missing, f"extra {extra[:5]}, missing {missing[:5]}"
    assert got == want
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    # q_lora_rank None: q_proj replaces q_a_proj / q_a_layernorm / q_b_proj
    with torch.device("meta"):
        sd = Target(TargetConfig.from_preset("tiny", q_lora_rank=None, num_layers=1)).state_dict()
    assert tuple(sd["model.layers.0.self_attn.q_proj.weight"].shape) == (TINY.num_heads * TINY.qk_head_dim, H)
    assert not any("q_a_" in k or "q_b_" in k for k in sd)


def test_save_load_round_trip(model, prompt, tmp_path):
    save_pretrained(model, tmp_path, extra_config={"note": "test"})
    cfg_json = read_config(tmp_path)
    assert cfg_json["note"] == "test" and cfg_json["architectures"] == ["DeepseekV3ForCausalLM"]
    loaded = load_target(tmp_path)
    assert loaded.cfg == TINY
    a, b = model.state_dict(), loaded.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert torch.equal(loaded.inv_freq, model.inv_freq)
    with torch.no_grad():
        assert torch.equal(loaded.forward_train(prompt[:, :5]), model.forward_train(prompt[:, :5]))
    # bf16: weights cast, routing bias and rope stay fp32 (also through .to(dtype))
    low = load_target(tmp_path, dtype=torch.bfloat16)
    assert low.lm_head.weight.dtype == torch.bfloat16
    assert low.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert low.inv_freq.dtype == torch.float32
    cast = Target.synthesize(TINY, seed=0).to(torch.bfloat16)
    assert cast.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(cast.inv_freq, model.inv_freq)


def test_load_names_missing_and_unexpected_keys(model, tmp_path):
    from safetensors.torch import save_file

    save_pretrained(model, tmp_path)
    state = dict(model.state_dict())
    del state["model.layers.3.self_attn.kv_b_proj.weight"]
    state["model.layers.3.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing keys \(1\): model\.layers\.3\.self_attn\.kv_b_proj\.weight.*"
                                         r"unexpected keys \(1\): model\.layers\.3\.self_attn\.rotary_emb\.inv_freq"):
        load_target(tmp_path)


# ---- (f) the softmax scale ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,scale", [("kimi-k2", 0.130861), ("kimi-k2.5", 0.144680), ("deepseek-v3", 0.135234)])
def test_softmax_scale_is_kimi_md(name, scale):
    assert abs(TargetConfig.from_preset(name).softmax_scale - scale) < 5e-7
    assert TargetConfig.from_preset(name).softmax_scale != 576 ** -0.5


# ---- (g) YaRN RoPE -------------------------------------------------------------------------------------


def test_yarn_inv_freq_by_hand():
    # tiny: R = 4, theta 1e4, original 64, factor 4, beta 32 / 1.
    # corr(32) = 4 ln(64 / (64 pi)) / (2 ln 1e4) = -0.249 -> low = max(-1, 0) = 0;
    # corr(1) = 4 ln(64 / (2 pi)) / (2 ln 1e4) = 0.504 -> high = min(1, 3) = 1; ramp = [0, 1]:
    # freq = [1 (kept), 1e4 ** -0.5 / 4 (interpolated)].
    torch.testing.assert_close(yarn_inv_freq(TINY), torch.tensor([1.0, 0.01 / 4]), rtol=1e-7, atol=0)
    # Kimi-K2: R = 64, theta 5e4, factor 32, beta 1 / 1: corr(1) = 64 ln(4096 / 2 pi) / (2 ln 5e4) = 19.16,
    # low = 19, high = 20: dims i <= 19 keep theta^(-2i/64), i >= 20 are divided by 32.
    i = torch.arange(32, dtype=torch.float64)
    want = 50000.0 ** (-2 * i / 64) / torch.where(i >= 20, 32.0, 1.0)
    torch.testing.assert_close(yarn_inv_freq(TargetConfig.from_preset("kimi-k2")), want.float(), rtol=1e-7, atol=0)


def test_rope_pairs_position_zero_and_relative_positions():
    inv_freq = yarn_inv_freq(TargetConfig.from_preset("kimi-k2"))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 64, generator=g)
    assert torch.equal(apply_rope(x, torch.zeros(3, 5, dtype=torch.int64), inv_freq), x)  # position 0: identity
    # interleaved pairs: e_0 at position p becomes (cos, sin) in dims (0, 1)
    e0 = torch.zeros(64)
    e0[0] = 1
    out = apply_rope(e0, torch.tensor(3), inv_freq)
    torch.testing.assert_close(out[:2], torch.tensor([math.cos(3 * inv_freq[0]), math.sin(3 * inv_freq[0])]))
    assert out[2:].abs().max() == 0
    # q . k depends only on the position difference (positions broadcast over a heads dim)
    q, k = torch.randn(2, 4, 64, generator=g), torch.randn(2, 64, generator=g)
    def dot(pq, pk):
        rq = apply_rope(q, torch.tensor([pq, pq]), inv_freq)  # [2, 4, 64], positions [2]
        rk = apply_rope(k, torch.tensor([pk, pk]), inv_freq)
        return torch.einsum("bhd,bd->bh", rq.double(), rk.double())
    for shift in (1, 17, 1000):
        torch.testing.assert_close(dot(9 + shift, 4 + shift), dot(9, 4), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(dot(9, 4), dot(9, 5), atol=1e-3)
    assert apply_rope(x.bfloat16(), torch.ones(3, dtype=torch.int64), inv_freq).dtype == torch.bfloat16


# ---- bf16 and gradients --------------------------------------------------------------------------------


def test_bf16_step_tracks_forward_train(prompt):
    # bf16 roundings flip near-tied MoE routing decisions, and a flipped token differs by O(1) in either
    # forward (measured: 0.2 relative error for both against fp32 on tiny), so the numeric check runs an
    # all-dense variant (~0.9% measured) and the MoE model only has to run and stay finite.
    for cfg, tol in ((TargetConfig.from_preset("tiny", first_k_dense_replace=L), 3e-2), (TINY, None)):
        low = Target.synthesize(cfg, seed=0, dtype=torch.bfloat16)
        kv = low.new_kv(B, T, page_size=PAGE)
        assert kv.caches[0].dtype == torch.bfloat16 and kv.caches[0].shape[-1] == TINY.kv_dim
        aux = torch.full((B * T, 2 * H), float("nan"), dtype=torch.bfloat16)
        logits = _prefill(low, prompt, kv, aux, [1, L - 1])
        assert logits.dtype == torch.float32 and logits.isfinite().all() and not aux.isnan().any()
        if tol is not None:
            with torch.no_grad():
                assert rel_err(logits.view(B, T, -1), low.forward_train(prompt)) < tol


def test_forward_train_is_differentiable(model, prompt):
    model.zero_grad()
    logits = model.forward_train(prompt[:, :6])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, TINY.vocab_size), prompt[:, 1:6].reshape(-1))
    loss.backward()
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.7.self_attn.kv_b_proj.weight", "lm_head.weight",
                 "model.embed_tokens.weight", "model.layers.0.self_attn.q_a_layernorm.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)


# ---- (g) batch-invariant mode: a token's logits do not depend on the step it is verified in -------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_mode_gives_plain_and_verify_steps_bit_identical_logits(dtype):
    # A 4-token chain verified in one step must give, row for row, the logits of 4 plain one-token steps,
    # and capture the same aux rows: bit for bit with batch_invariant_rows = 4 (every step padded to 4 rows,
    # float64 attention), whatever the GEMMs do with the row count.
    cfg = TargetConfig.from_preset("tiny", num_layers=3)
    m = Target.synthesize(cfg, seed=4, dtype=dtype).eval()
    m.batch_invariant_rows = 4
    g = torch.Generator().manual_seed(6)
    prompt, chain = torch.randint(0, cfg.vocab_size, (1, 11), generator=g), torch.randint(0, cfg.vocab_size, (1, 4),
                                                                                          generator=g)
    ids = [0, 1, 2]
    runs = []
    for verify in (False, True):
        kv = m.new_kv(1, 32, page_size=4)
        m.forward(prompt, torch.arange(11)[None], kv, tree.tree_mask(tree.chain_parents(1, 11)))
        kv.advance(11)
        if verify:
            aux = torch.empty(4, 3 * cfg.hidden_size, dtype=dtype)
            logits = m.forward(chain, torch.arange(11, 15)[None], kv, tree.tree_mask(tree.chain_parents(1, 4)), aux,
                               ids)
        else:
            rows, auxes = [], []
            for i in range(4):
                a = torch.empty(1, 3 * cfg.hidden_size, dtype=dtype)
                rows.append(m.forward(chain[:, i:i + 1], torch.tensor([[11 + i]]), kv,
                                      torch.ones(1, 1, 1, dtype=torch.int32), a, ids))
                auxes.append(a)
                kv.advance(1)
            logits, aux = torch.cat(rows), torch.cat(auxes)
        runs.append((logits, aux))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
