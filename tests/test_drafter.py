"""The EAGLE-3 drafter: the paged inference step (torch.ops.eagle3) equals the differentiable training
pass, the fc through fc_proj equals its plain-PyTorch form in every norm mode, the attention input is
[input_layernorm(e), hidden_norm(h)], the vocabulary map, checkpoint names and save/load."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from eagle3_ops import tree
from eagle3_ops.models.config import DrafterConfig
from eagle3_ops.models.drafter import Drafter, load_drafter, save_drafter
from eagle3_ops.wiring import CONVENTIONS
from tests.conftest import TOLERANCES, rel_err

pytest.importorskip("safetensors")

# Small but with every structural feature: GQA (4 query heads over 2 KV heads), a draft vocabulary
# smaller than the target's (50 of 97), three aux slots, head_dim 8 so RoPE has 4 frequencies.
CFG = DrafterConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=97,
                    draft_vocab_size=50, target_hidden_size=32, aux_ids=(1, 3, 4), rope_theta=10000.0)
NUM_LAYERS = 8  # the tiny target's depth: aux ids (1, 3, 4) are valid outputs
TOL = TOLERANCES[torch.float32] * 5  # SDPA vs the paged reference attention: different fp32 summation order
VARIANTS = {
    "eagle3": {},
    "norm_before_fc": dict(norm_before_fc=True),
    "fc_norm": dict(fc_norm=True),
    "norm_output": dict(norm_output=True),
}
BASE_KEYS = [
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
]


def _embed(seed: int = 7) -> nn.Embedding:
    emb = nn.Embedding(CFG.vocab_size, CFG.hidden_size)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(emb.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return emb


def _drafter(variant: str = "eagle3", seed: int = 3, cfg: DrafterConfig = CFG, embed=None) -> Drafter:
    return Drafter.synthesize(replace(cfg, **VARIANTS[variant]), _embed() if embed is None else embed, seed=seed)


def _close(out, ref, what):
    err = rel_err(out.detach(), ref.detach())
    assert err < TOL, f"{what}: relative error {err:.3g} >= {TOL}"


# ---- (a) paged inference step == training pass ----------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_steps_match_forward_train(variant, gen):
    """Prefill T tokens as a chain (page_size 4, so the prefix straddles shuffled pages), then single
    steps; every step's logits and hidden equal forward_train over the whole sequence."""
    d = _drafter(variant)
    B, T, steps, H = 2, 6, 3, CFG.hidden_size  # T = 6 is not a multiple of the page size
    L = T + steps
    tokens = torch.randint(0, CFG.vocab_size, (B, L), generator=gen)
    hidden = torch.randn(B, L, H, generator=gen)
    ref_logits, ref_hidden = d.forward_train(tokens, hidden)

    kv = d.new_kv(B, L, page_size=4)
    chain = tree.tree_mask(tree.chain_parents(B, T))
    pos = torch.arange(T).expand(B, T)
    logits, h_out = d(tokens[:, :T], hidden[:, :T].reshape(B * T, H), pos, kv, chain)
    assert kv.prefix_lens.tolist() == [0, 0], "forward must not advance prefix_lens"
    _close(logits.view(B, T, -1), ref_logits[:, :T], "prefill logits")
    _close(h_out.view(B, T, H), ref_hidden[:, :T], "prefill hidden")
    assert logits.dtype == torch.float32 and logits.shape == (B * T, CFG.draft_vocab_size)
    kv.advance(T)
    one = tree.tree_mask(tree.chain_parents(B, 1))
    for s in range(T, L):
        logits, h_out = d(tokens[:, s:s + 1], hidden[:, s], torch.full((B, 1), s), kv, one)
        _close(logits, ref_logits[:, s], f"step {s} logits")
        _close(h_out, ref_hidden[:, s], f"step {s} hidden")
        kv.advance(1)


# ---- (b) a bushy tree step == forward_train on each node's ancestor path --------------------------


def test_tree_step_matches_ancestor_paths(gen):
    d = _drafter()
    B, T, N, H = 2, 5, 9, CFG.hidden_size
    parents = tree.random_parents(B, N, gen, kind="bushy")
    depth = tree.depth(parents).long()
    prefix_tok = torch.randint(0, CFG.vocab_size, (B, T), generator=gen)
    prefix_hid = torch.randn(B, T, H, generator=gen)
    node_tok = torch.randint(0, CFG.vocab_size, (B, N), generator=gen)
    node_hid = torch.randn(B, N, H, generator=gen)

    kv = d.new_kv(B, T + N, page_size=4)
    chain = tree.tree_mask(tree.chain_parents(B, T))
    d(prefix_tok, prefix_hid.reshape(B * T, H), torch.arange(T).expand(B, T), kv, chain)
    kv.advance(T)
    logits, h_out = d(node_tok, node_hid.reshape(B * N, H), T + depth, kv, tree.tree_mask(parents))
    logits, h_out = logits.view(B, N, -1), h_out.view(B, N, H)

    for b in range(B):
        for i in range(N):
            path, j = [], i
            while j != -1:
                path.append(j)
                j = int(parents[b, j])
            path = path[::-1]  # root .. i, depths 0 .. depth[i]
            toks = torch.cat([prefix_tok[b], node_tok[b, path]])[None]
            hids = torch.cat([prefix_hid[b], node_hid[b, path]])[None]
            ref_l, ref_h = d.forward_train(toks, hids)
            _close(logits[b, i], ref_l[0, -1], f"request {b} node {i} logits")
            _close(h_out[b, i], ref_h[0, -1], f"request {b} node {i} hidden")

    # the same tree in one forward_train call: prefix keys as past_kv, the dense tree mask as attn_mask
    _, _, past = d.forward_train(prefix_tok, prefix_hid, return_kv=True)
    dense = tree.mask_to_dense(tree.tree_mask(parents), N)
    mask = torch.cat([torch.ones(B, N, T, dtype=torch.bool), dense], dim=2)
    ref_l, ref_h, (k, v) = d.forward_train(node_tok, node_hid, T + depth, mask, past, return_kv=True)
    _close(logits, ref_l, "tree logits (past_kv + attn_mask)")
    _close(h_out, ref_h, "tree hidden (past_kv + attn_mask)")
    assert k.shape == (B, T + N, CFG.num_kv_heads, CFG.head_dim) and v.shape == k.shape


def test_past_kv_default_mask_continues_the_sequence(gen):
    """forward_train with past_kv and no mask = the second half of one causal pass (default positions)."""
    d = _drafter()
    tokens = torch.randint(0, CFG.vocab_size, (2, 7), generator=gen)
    hidden = torch.randn(2, 7, CFG.hidden_size, generator=gen)
    ref_l, ref_h = d.forward_train(tokens, hidden)
    _, _, past = d.forward_train(tokens[:, :4], hidden[:, :4], return_kv=True)
    l, h = d.forward_train(tokens[:, 4:], hidden[:, 4:], past_kv=past)
    _close(l, ref_l[:, 4:], "logits")
    _close(h, ref_h[:, 4:], "hidden")


# ---- (c) project (fc_proj) == the differentiable fc, every norm mode --------------------------------


@pytest.mark.parametrize("variant", ["eagle3", "norm_before_fc", "fc_norm"])
@pytest.mark.parametrize("target_hidden", [32, 24])  # 24: Ht != H catches [H, n_aux * Ht] mix-ups
def test_project_matches_project_train(variant, target_hidden, gen):
    cfg = replace(CFG, target_hidden_size=target_hidden)
    d = _drafter(variant, cfg=cfg)
    assert d.norm_mode == {"eagle3": "none"}.get(variant, variant)
    T, K = 11, cfg.n_aux * target_hidden
    aux = torch.randn(T, K, generator=gen) * 3.0
    ref = d.project_train(aux)
    _close(d.project(aux), ref, "all rows")
    rows = torch.tensor([7, 0, 7, 10], dtype=torch.int32)  # unordered, repeated, last row
    _close(d.project(aux, rows), ref[rows.long()], "rows")
    out = torch.full((4, cfg.hidden_size), float("nan"))
    assert d.project(aux, rows.long(), out=out) is out
    _close(out, ref[rows.long()], "preallocated out")


def test_fc_norms_by_hand(gen):
    """Chunk i of the aux row goes through fc_norm[i] (distinct weights per chunk); norm_before_fc is
    one RMSNorm over the whole row. Written out independently of the drafter's helpers."""
    aux = torch.randn(3, CFG.n_aux * CFG.target_hidden_size, generator=gen) * 2.0
    eps, Ht = CFG.rms_norm_eps, CFG.target_hidden_size

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    d = _drafter("fc_norm")
    normed = torch.cat([rms(aux[:, i * Ht:(i + 1) * Ht], d.fc_norm[i].weight) for i in range(CFG.n_aux)], dim=1)
    _close(d.project(aux), normed @ d.fc.weight.T, "fc_norm project")
    _close(d.project_train(aux), normed @ d.fc.weight.T, "fc_norm project_train")
    d = _drafter("norm_before_fc")
    ref = rms(aux, d.input_norm.weight) @ d.fc.weight.T
    _close(d.project(aux), ref, "norm_before_fc project")
    _close(d.project_train(aux), ref, "norm_before_fc project_train")


def test_norm_output_feeds_the_post_norm_hidden(gen):
    """Same weights: norm_output changes only the hidden handed on (norm(h) instead of h), not the logits."""
    plain, post = _drafter("eagle3"), _drafter("norm_output")
    tokens = torch.randint(0, CFG.vocab_size, (2, 4), generator=gen)
    hidden = torch.randn(2, 4, CFG.hidden_size, generator=gen)
    with torch.no_grad():
        l0, h0 = plain.forward_train(tokens, hidden)
        l1, h1 = post.forward_train(tokens, hidden)
        torch.testing.assert_close(l1, l0, rtol=0, atol=0)
        torch.testing.assert_close(h1, plain.norm(h0), rtol=0, atol=0)
    assert rel_err(h1, h0) > 1e-2


@pytest.mark.parametrize("variant", ["norm_before_fc", "fc_norm"])
def test_forward_train_from_aux_is_forward_train_of_fc_and_differentiable(variant, gen):
    d = _drafter(variant)
    B, T, K = 2, 5, CFG.n_aux * CFG.target_hidden_size
    tokens = torch.randint(0, CFG.vocab_size, (B, T), generator=gen)
    aux = torch.randn(B, T, K, generator=gen)
    logits, hidden = d.forward_train_from_aux(tokens, aux)
    ref_l, ref_h = d.forward_train(tokens, d.project(aux.view(B * T, K)).view(B, T, -1))
    _close(logits.detach(), ref_l.detach(), "logits")
    _close(hidden.detach(), ref_h.detach(), "hidden")
    (logits.logsumexp(-1).sum() + hidden.sum()).backward()
    norms = [d.input_norm] if variant == "norm_before_fc" else list(d.fc_norm)
    for n in norms + [d.fc, d.midlayer.self_attn.q_proj]:
        assert n.weight.grad is not None and n.weight.grad.abs().sum() > 0
    assert d.embed.weight.grad is None, "the shared target embedding is frozen"


# ---- (d) the attention input: [input_layernorm(e), hidden_norm(h)], embedding first -----------------


def test_attention_input_is_embedding_first(gen):
    d = _drafter()
    tokens = torch.randint(0, CFG.vocab_size, (2, 4), generator=gen)
    hidden = torch.randn(2, 4, CFG.hidden_size, generator=gen)
    seen = []
    hook = d.midlayer.self_attn.q_proj.register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    with torch.no_grad():
        logits, _ = d.forward_train(tokens, hidden)
    hook.remove()
    x = seen[0]
    layer = d.midlayer
    expect = torch.cat([layer.input_layernorm(d.embed(tokens)), layer.hidden_norm(hidden)], dim=-1)
    assert x.shape[-1] == 2 * CFG.hidden_size
    torch.testing.assert_close(x, expect, rtol=0, atol=0)

    # Swapping the two halves of q/k/v_proj's input columns (what an implementation with the hidden
    # first would compute with these weights) changes the output: the order is observable.
    H = CFG.hidden_size
    with torch.no_grad():
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.weight.copy_(torch.cat([proj.weight[:, H:], proj.weight[:, :H]], dim=1))
        swapped, _ = d.forward_train(tokens, hidden)
    assert rel_err(swapped, logits) > 1e-2


def test_hand_computed_single_token():
    """T = 1: the token attends only to itself, so attention = v (each query head reads KV head
    h // group) and RoPE drops out; the whole layer is written out by hand, embedding first."""
    d = _drafter(seed=11)
    tok = torch.tensor([[42]])
    h = torch.randn(1, 1, CFG.hidden_size, generator=torch.Generator().manual_seed(5))
    L = d.midlayer

    def rms(x, w, eps=CFG.rms_norm_eps):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    e = d.embed.weight[42]
    x = torch.cat([rms(e, L.input_layernorm.weight), rms(h[0, 0], L.hidden_norm.weight)])
    v = (L.self_attn.v_proj.weight @ x).view(CFG.num_kv_heads, CFG.head_dim)
    attn = v.repeat_interleave(CFG.num_heads // CFG.num_kv_heads, dim=0).reshape(-1)
    h1 = h[0, 0] + L.self_attn.o_proj.weight @ attn
    n = rms(h1, L.post_attention_layernorm.weight)
    gate, up = L.mlp.gate_proj.weight @ n, L.mlp.up_proj.weight @ n
    h2 = h1 + L.mlp.down_proj.weight @ (gate * torch.sigmoid(gate) * up)
    logits = d.lm_head.weight @ rms(h2, d.norm.weight)
    with torch.no_grad():
        got_l, got_h = d.forward_train(tok, h)
    torch.testing.assert_close(got_l[0, 0], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h[0, 0], h2, rtol=1e-5, atol=1e-5)


# ---- (e) the draft -> target vocabulary map --------------------------------------------------------


def test_d2t_map(gen):
    d = _drafter()
    Vd, V = CFG.draft_vocab_size, CFG.vocab_size
    targets = d.to_target_ids(torch.arange(Vd))
    assert targets.dtype == torch.int64 and bool((targets[1:] > targets[:-1]).all()) and int(targets.max()) < V
    assert torch.equal(d.t2d.nonzero().flatten(), targets)  # t2d marks exactly the draft vocabulary
    selected = torch.randperm(V, generator=gen)[:Vd]  # any order, not only sorted
    d.set_vocab_map(selected)
    assert torch.equal(d.to_target_ids(torch.arange(Vd)), selected)
    assert torch.equal(d.to_target_ids(torch.tensor([[3, 0], [Vd - 1, 3]])),
                       selected[torch.tensor([[3, 0], [Vd - 1, 3]])])
    assert int(d.t2d.sum()) == Vd and bool(d.t2d[selected].all())
    with pytest.raises(ValueError, match="distinct"):
        d.set_vocab_map(torch.zeros(Vd, dtype=torch.int64))
    fresh = Drafter(CFG, _embed())  # default map: draft id i is target id i
    assert torch.equal(fresh.to_target_ids(torch.arange(Vd)), torch.arange(Vd))


# ---- (f) checkpoint names, save/load, conventions --------------------------------------------------


@pytest.mark.parametrize("variant,extra", [
    ("eagle3", []), ("norm_output", []), ("norm_before_fc", ["input_norm.weight"]),
    ("fc_norm", ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]),
])
def test_state_dict_keys_are_hf_names(variant, extra):
    d = _drafter(variant)
    sd = d.state_dict()
    assert sorted(sd) == sorted(BASE_KEYS + extra)
    assert sd["fc.weight"].shape == (CFG.hidden_size, CFG.n_aux * CFG.target_hidden_size)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (CFG.num_heads * CFG.head_dim, 2 * CFG.hidden_size)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (CFG.num_kv_heads * CFG.head_dim, 2 * CFG.hidden_size)
    assert sd["lm_head.weight"].shape == (CFG.draft_vocab_size, CFG.hidden_size)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (CFG.draft_vocab_size,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (CFG.vocab_size,)
    if extra:
        assert sd[extra[0]].numel() == (CFG.n_aux if variant == "norm_before_fc" else 1) * CFG.target_hidden_size
    owned = Drafter(replace(CFG, **VARIANTS[variant]))  # no shared embedding: the drafter owns one
    assert sorted(owned.state_dict()) == sorted(BASE_KEYS + extra + ["embed_tokens.weight"])
    assert not owned.embed_tokens.weight.requires_grad


def test_both_fc_norm_modes_refused():
    with pytest.raises(ValueError, match="at most one"):
        Drafter(replace(CFG, norm_before_fc=True, fc_norm=True), _embed())


@pytest.mark.parametrize("variant", ["fc_norm", "norm_before_fc", "norm_output"])
def test_save_load_round_trip(variant, tmp_path, gen):
    emb = _embed()
    d = _drafter(variant, embed=emb)
    save_drafter(d, tmp_path, convention="input", num_layers=NUM_LAYERS)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # "input" = ours + 1
    loaded = load_drafter(tmp_path, emb, NUM_LAYERS)
    assert loaded.cfg == d.cfg and loaded.cfg.aux_ids == (1, 3, 4)
    assert loaded.embed is emb and "embed_tokens.weight" not in loaded.state_dict()
    for k, t in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], t), k
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    tokens = torch.randint(0, CFG.vocab_size, (2, 5), generator=gen)
    aux = torch.randn(2, 5, CFG.n_aux * CFG.target_hidden_size, generator=gen)
    for a, b in zip(d.forward_train_from_aux(tokens, aux), loaded.forward_train_from_aux(tokens, aux)):
        assert torch.equal(a, b)
    half = load_drafter(tmp_path, emb, NUM_LAYERS, dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.d2t.dtype == torch.int64 and half.t2d.dtype == torch.bool


def test_load_owned_embedding_and_checkpoint_layouts(tmp_path):
    """No shared embedding: embed_tokens.weight comes from the file. Keys written as speculators does
    ("layers.0." for "midlayer.", a "model." prefix) and without t2d load too."""
    from safetensors.torch import load_file, save_file

    d = Drafter.synthesize(CFG, None, seed=2)
    save_drafter(d, tmp_path, num_layers=NUM_LAYERS)
    loaded = load_drafter(tmp_path, None, NUM_LAYERS)
    assert torch.equal(loaded.embed.weight, d.embed.weight)
    sd = load_file(tmp_path / "model.safetensors")
    renamed = {("model." if k.startswith("norm") else "") + k.replace("midlayer.", "layers.0."): t
               for k, t in sd.items() if k != "t2d"}
    save_file(renamed, tmp_path / "model.safetensors")
    again = load_drafter(tmp_path, None, NUM_LAYERS)
    for k, t in d.state_dict().items():
        assert torch.equal(again.state_dict()[k], t), k


def test_unknown_convention_refused(tmp_path):
    emb = _embed()
    save_drafter(_drafter(embed=emb), tmp_path, num_layers=NUM_LAYERS)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["eagle_config"]["eagle_aux_hidden_state_layer_convention"] = "hf-ish"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path, emb, NUM_LAYERS)
    assert all(repr(c) in str(err.value) for c in CONVENTIONS)
    with pytest.raises(ValueError) as err:  # an unknown convention passed by the caller
        load_drafter(tmp_path, emb, NUM_LAYERS, convention="outputs")
    assert all(repr(c) in str(err.value) for c in CONVENTIONS)
    del hf["eagle_config"]["eagle_aux_hidden_state_layer_convention"]  # ids without a convention
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="does not say which layers"):
        load_drafter(tmp_path, emb, NUM_LAYERS)
    assert load_drafter(tmp_path, emb, NUM_LAYERS, convention="output").cfg.aux_ids == (1, 3, 4)


def test_save_needs_num_layers(tmp_path):
    with pytest.raises(TypeError, match="num_layers"):
        save_drafter(_drafter(), tmp_path)
