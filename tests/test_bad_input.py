"""Bad input, for every op: starting from valid sample arguments (eagle3_ops.samples), one corruption per
case (a wrong dtype, a wrong shape, a tensor on another device, an out-of-range index). The op must raise
an error that names the argument, and every tensor the caller passed (outputs, mutated inputs, caches,
prefix_lens) must be bit-identical afterwards: a failed call writes nothing.

"Another device" is the meta device: mixing it with CPU tensors must raise ValueError naming the argument
before anything runs (the same check that catches a CPU tensor among CUDA ones)."""

from __future__ import annotations

import pytest
import torch

from eagle3_ops.samples import N, V, sample_args
from tests.conftest import assert_equal

ANY = (ValueError, TypeError, IndexError)
FP8 = getattr(torch, "float8_e4m3fn", None)


def put(i, f):
    """Replace argument i by f(argument i)."""
    def mutate(a):
        a[i] = f(a[i])
    return mutate


def poke(i, idx, value):
    """Write one value into tensor argument i (indices and tables corrupted in place)."""
    def mutate(a):
        a[i][idx] = value
    return mutate


def meta(i):
    return put(i, lambda t: t.to("meta"))


def dtype(i, d):
    return put(i, lambda t: t.to(d))


# (op, id, mutate, expected exceptions, the argument's name the message must carry)
CASES = [
    # ---- capture_aux(hidden, residual, aux, slot, rows) ----
    ("capture_aux", "hidden_int", dtype(0, torch.int32), TypeError, "hidden"),  # integers are not activations
    ("capture_aux", "residual_fp16", dtype(1, torch.float16), TypeError, "residual"),  # must match hidden's dtype
    ("capture_aux", "aux_fp64", dtype(2, torch.float64), TypeError, "aux"),  # the buffer must match hidden's dtype
    ("capture_aux", "rows_float", dtype(4, torch.float32), TypeError, "rows"),  # indices must be int32/int64
    ("capture_aux", "residual_short", put(1, lambda t: t[:6]), ValueError, "residual"),  # T mismatch
    ("capture_aux", "aux_not_multiple_of_H", put(2, lambda t: t[:, :70]), ValueError, "aux"),  # 70 % 24 != 0
    ("capture_aux", "aux_rows_mismatch", put(2, lambda t: torch.cat([t, t[:1]])), ValueError, "aux"),  # R = 4 != 3
    # a column-strided buffer: rows cannot be written as vectors
    ("capture_aux", "aux_last_dim_strided", put(2, lambda t: torch.empty(3, 144)[:, ::2]), ValueError, "aux"),
    ("capture_aux", "rows_2d", put(4, lambda t: t[None]), ValueError, "rows"),  # rows must be [R]
    ("capture_aux", "slot_past_n_aux", put(3, lambda s: 3), ValueError, "slot"),  # n_aux = 3
    ("capture_aux", "hidden_meta", meta(0), ValueError, "hidden"),  # the first tensor on another device
    ("capture_aux", "residual_meta", meta(1), ValueError, "residual"),  # residual on another device
    ("capture_aux", "aux_meta", meta(2), ValueError, "aux"),  # the capture buffer on another device
    ("capture_aux", "rows_meta", meta(4), ValueError, "rows"),  # the row indices on another device
    ("capture_aux", "rows_past_T", poke(4, 1, 7), IndexError, "rows"),  # T = 7
    ("capture_aux", "rows_negative", poke(4, 0, -1), IndexError, "rows"),  # no Python-style wrap-around
    # ---- add_rmsnorm_capture(x, residual, weight, eps, aux, slot, rows) ----
    ("add_rmsnorm_capture", "weight_int", dtype(2, torch.int64), TypeError, "weight"),  # an integer norm weight
    ("add_rmsnorm_capture", "residual_int", dtype(1, torch.int32), TypeError, "residual"),  # an integer residual stream
    ("add_rmsnorm_capture", "aux_bf16", dtype(4, torch.bfloat16), TypeError, "aux"),  # must match residual (fp32)
    ("add_rmsnorm_capture", "weight_short", put(2, lambda t: t[:23]), ValueError, "weight"),  # [H] = [24]
    # H mismatch between x and residual
    ("add_rmsnorm_capture", "residual_narrow", put(1, lambda t: t[:, :23]), ValueError, "residual"),
    ("add_rmsnorm_capture", "aux_rows_mismatch", put(4, lambda t: t[:6]), ValueError, "aux"),  # R = T = 7
    # a negative epsilon could make the rms imaginary
    ("add_rmsnorm_capture", "eps_negative", put(3, lambda e: -1.0), ValueError, "eps"),
    ("add_rmsnorm_capture", "rows_without_aux", lambda a: a.__setitem__(slice(4, 7), [None, 0, torch.tensor([0])]),
     ValueError, "rows"),  # rows select aux rows: meaningless without aux
    ("add_rmsnorm_capture", "x_meta", meta(0), ValueError, "x"),  # the first tensor on another device
    ("add_rmsnorm_capture", "residual_meta", meta(1), ValueError, "residual"),  # residual on another device
    ("add_rmsnorm_capture", "weight_meta", meta(2), ValueError, "weight"),  # the norm weight on another device
    ("add_rmsnorm_capture", "aux_meta", meta(4), ValueError, "aux"),  # the capture buffer on another device
    # T = 7
    ("add_rmsnorm_capture", "rows_past_T", put(6, lambda _: torch.tensor([0, 1, 2, 3, 4, 5, 7])), IndexError, "rows"),
    ("add_rmsnorm_capture", "rows_negative", put(6, lambda _: torch.tensor([0, 1, 2, -3, 4, 5, 6])), IndexError,
     "rows"),
    # ---- fc_proj(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, out) ----
    ("fc_proj", "weight_int8", dtype(1, torch.int8), TypeError, "weight"),  # int8 is not a supported weight
    # the weight is streamed row by row: a transposed (column-major) view is refused, not silently slow
    ("fc_proj", "weight_transposed", put(1, lambda t: t.T.contiguous().T), ValueError, "weight"),
    ("fc_proj", "rows_strided", put(6, lambda t: torch.stack([t, t], 1)[:, 0]), ValueError, "rows"),
    ("fc_proj", "weight_scale_bf16", put(2, lambda _: torch.ones(16, dtype=torch.bfloat16)), TypeError,
     "weight_scale"),  # the scale is fp32
    ("fc_proj", "norm_weight_int", dtype(3, torch.int32), TypeError, "norm_weight"),  # an integer norm weight
    ("fc_proj", "out_int", dtype(7, torch.int32), TypeError, "out"),  # an integer output
    ("fc_proj", "weight_narrow", put(1, lambda t: t[:, :71].contiguous()), ValueError, "weight"),  # K = 72
    ("fc_proj", "weight_scale_short", put(2, lambda _: torch.ones(15)), ValueError, "weight_scale"),  # [Hd] = [16]
    ("fc_proj", "norm_weight_wrong_H", put(3, lambda t: t[:, :23]), ValueError, "norm_weight"),  # n_aux * H != K
    # a norm weight with no norm to apply it to
    ("fc_proj", "norm_weight_with_none_mode", put(5, lambda _: "none"), ValueError, "norm_weight"),
    # only none | norm_before_fc | fc_norm
    ("fc_proj", "norm_mode_unknown", put(5, lambda _: "layer_norm"), ValueError, "norm_mode"),
    ("fc_proj", "out_rows_mismatch", put(7, lambda t: torch.cat([t, t])), ValueError, "out"),  # R = 2 rows
    ("fc_proj", "aux_meta", meta(0), ValueError, "aux"),  # the first tensor on another device
    ("fc_proj", "weight_meta", meta(1), ValueError, "weight"),  # the fc weight on another device
    # the scale on another device
    ("fc_proj", "weight_scale_meta", put(2, lambda _: torch.ones(16, device="meta")), ValueError, "weight_scale"),
    ("fc_proj", "norm_weight_meta", meta(3), ValueError, "norm_weight"),  # the norm weight on another device
    ("fc_proj", "rows_meta", meta(6), ValueError, "rows"),  # the row indices on another device
    ("fc_proj", "out_meta", meta(7), ValueError, "out"),  # the output on another device
    ("fc_proj", "rows_past_T", poke(6, 0, 7), IndexError, "rows"),  # T = 7
    ("fc_proj", "rows_negative", poke(6, 1, -7), IndexError, "rows"),  # no Python-style wrap-around
    # ---- build_tree(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, tokens, parents,
    #                 positions, tree_mask) ----
    # scores must be floating point
    ("build_tree", "draft_scores_int", dtype(2, torch.int64), TypeError, "draft_scores"),
    # prefix_lens is int32 everywhere
    ("build_tree", "prefix_lens_int64", dtype(4, torch.int64), TypeError, "prefix_lens"),
    ("build_tree", "parents_int64", dtype(6, torch.int64), TypeError, "parents"),  # the canonical parents are int32
    ("build_tree", "tree_mask_int64", dtype(8, torch.int64), TypeError, "tree_mask"),  # mask words are int32
    ("build_tree", "draft_scores_short", put(2, lambda t: t[:, :, :3]), ValueError, "draft_scores"),  # M = 4
    ("build_tree", "positions_short", put(7, lambda t: t[:, :4]), ValueError, "positions"),  # N = 5
    ("build_tree", "tree_mask_two_words", put(8, lambda t: t.repeat(1, 1, 2)), ValueError, "tree_mask"),  # W = 1
    ("build_tree", "tokens_too_many_nodes", put(5, lambda t: torch.zeros(2, 14, dtype=torch.int64)), ValueError,
     "tokens"),  # N = 14 > 1 + S * M = 13
    ("build_tree", "draft_parents_meta", meta(3), ValueError, "draft_parents"),  # candidate parents on another device
    ("build_tree", "tokens_meta", meta(5), ValueError, "tokens"),  # an output on another device
    ("build_tree", "tree_mask_meta", meta(8), ValueError, "tree_mask"),  # an output on another device
    ("build_tree", "draft_parents_past_M", poke(3, (1, 2, 1), 4), IndexError, "draft_parents"),  # M = 4
    # only depth 0 may point at the root (-1)
    ("build_tree", "draft_parents_negative", poke(3, (0, 1, 3), -2), IndexError, "draft_parents"),
    # depth-0 candidates are the root's children
    ("build_tree", "draft_parents_depth0_not_root", poke(3, (1, 0, 2), 0), IndexError, "draft_parents"),
    # NaN cannot be ranked (-inf is the padding)
    # (token ids and prefix_lens are only copied and added by build_tree, never used as an index: negative
    # values pass through on both devices, as in verify_*; test_contract_tree.py has the value contract)
    ("build_tree", "root_tokens_strided", put(0, lambda t: torch.stack([t, t], 1)[:, 0]), ValueError, "root_tokens"),
    ("build_tree", "draft_scores_nan", poke(2, (0, 1, 1), float("nan")), ValueError, "draft_scores"),
    # ---- tree_attention_mla(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse) ----
    ("tree_attention_mla", "kv_cache_bf16", dtype(1, torch.bfloat16), TypeError, "kv_cache"),  # must match q
    ("tree_attention_mla", "page_table_int64", dtype(2, torch.int64), TypeError, "page_table"),  # page tables are int32
    # prefix_lens is int32 everywhere
    ("tree_attention_mla", "prefix_lens_int64", dtype(3, torch.int64), TypeError, "prefix_lens"),
    ("tree_attention_mla", "tree_mask_int64", dtype(4, torch.int64), TypeError, "tree_mask"),  # mask words are int32
    ("tree_attention_mla", "out_fp64", dtype(6, torch.float64), TypeError, "out"),  # out must have q's dtype
    ("tree_attention_mla", "lse_bf16", dtype(7, torch.bfloat16), TypeError, "lse"),  # lse is always fp32
    # D = 40 (q's)
    ("tree_attention_mla", "kv_cache_wrong_D", put(1, lambda t: t[..., :39].contiguous()), ValueError, "kv_cache"),
    ("tree_attention_mla", "q_rows_mismatch", put(0, lambda t: t[:9]), ValueError, "q"),  # B * N = 10
    ("tree_attention_mla", "tree_mask_batch", put(4, lambda t: t[:1]), ValueError, "tree_mask"),  # B = 2
    # B = 2
    ("tree_attention_mla", "prefix_lens_batch", put(3, lambda t: torch.cat([t, t[:1]])), ValueError, "prefix_lens"),
    ("tree_attention_mla", "out_Dv_past_D", put(6, lambda t: torch.empty(10, 4, 41)), ValueError, "out"),  # D = 40
    ("tree_attention_mla", "lse_heads", put(7, lambda t: t[:, :3]), ValueError, "lse"),  # NH = 4
    ("tree_attention_mla", "scale_zero", put(5, lambda _: 0.0), ValueError, "scale"),  # a zero scale is never meant
    ("tree_attention_mla", "q_meta", meta(0), ValueError, "q"),  # the first tensor on another device
    ("tree_attention_mla", "kv_cache_meta", meta(1), ValueError, "kv_cache"),  # the cache on another device
    ("tree_attention_mla", "page_table_meta", meta(2), ValueError, "page_table"),  # the page table on another device
    ("tree_attention_mla", "prefix_lens_meta", meta(3), ValueError, "prefix_lens"),  # prefix_lens on another device
    ("tree_attention_mla", "tree_mask_meta", meta(4), ValueError, "tree_mask"),  # the mask on another device
    ("tree_attention_mla", "out_meta", meta(6), ValueError, "out"),  # the output on another device
    ("tree_attention_mla", "lse_meta", meta(7), ValueError, "lse"),  # lse on another device
    # 8 pages; request 0 reads positions 0..7 = its table entries 0 and 1, request 1 positions 0..10
    # a used entry past the 8 pages
    ("tree_attention_mla", "page_table_past_pages", poke(2, (0, 1), 8), IndexError, "page_table"),
    # a used entry below 0
    ("tree_attention_mla", "page_table_negative", poke(2, (1, 2), -1), IndexError, "page_table"),
    ("tree_attention_mla", "prefix_lens_overflow", poke(3, 1, 12), IndexError, "prefix_lens"),  # 12 + 5 > 4 * 4
    ("tree_attention_mla", "prefix_lens_negative", poke(3, 0, -1), IndexError, "prefix_lens"),  # a negative prefix
    ("tree_attention_mla", "scale_inf", put(5, lambda _: float("inf")), ValueError, "scale"),  # never finite
    # a node that does not see itself: not an ancestor-or-self mask (node 2's own bit cleared)
    ("tree_attention_mla", "tree_mask_no_self_bit", poke(4, (0, 2, 0), 0b001), ValueError, "tree_mask"),
    # kernels read index tensors and the latent cache with fixed strides: views that are not contiguous are refused
    ("tree_attention_mla", "kv_cache_strided", put(1, lambda t: torch.cat([t, t], 2)[..., ::2]), ValueError, "kv_cache"),
    ("tree_attention_mla", "tree_mask_strided", put(4, lambda t: torch.cat([t, t], 2)[..., ::2]), ValueError,
     "tree_mask"),
    ("tree_attention_mla", "lse_strided", put(7, lambda t: torch.cat([t, t], 1)[:, ::2]), ValueError, "lse"),
    # ---- tree_attention(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, scale, out, lse) ----
    ("tree_attention", "v_cache_fp16", dtype(2, torch.float16), TypeError, "v_cache"),  # V must have q's dtype
    ("tree_attention", "page_table_int64", dtype(3, torch.int64), TypeError, "page_table"),  # page tables are int32
    ("tree_attention", "lse_fp64", dtype(8, torch.float64), TypeError, "lse"),  # lse is always fp32
    ("tree_attention", "v_cache_heads", put(2, lambda t: t[:, :, :1].contiguous()), ValueError, "v_cache"),  # HKV 2
    ("tree_attention", "k_cache_heads_not_dividing",
     lambda a: a.__setitem__(slice(1, 3), [torch.zeros(8, 4, 3, 16)] * 2),
     ValueError, "k_cache"),  # NH = 4 is not a multiple of HKV = 3 (in both caches)
    ("tree_attention", "q_wrong_Dh", put(0, lambda t: t[..., :15].contiguous()), ValueError, "q"),  # Dh = 16
    # Dv = 16 (v_cache's)
    ("tree_attention", "out_wrong_Dv", put(7, lambda t: t[..., :15].contiguous()), ValueError, "out"),
    # W = ceil(5 / 32) = 1
    ("tree_attention", "tree_mask_words", put(5, lambda t: t.repeat(1, 1, 2)), ValueError, "tree_mask"),
    ("tree_attention", "k_cache_meta", meta(1), ValueError, "k_cache"),  # K on another device
    ("tree_attention", "v_cache_meta", meta(2), ValueError, "v_cache"),  # V on another device
    ("tree_attention", "page_table_meta", meta(3), ValueError, "page_table"),  # the page table on another device
    ("tree_attention", "out_meta", meta(7), ValueError, "out"),  # the output on another device
    ("tree_attention", "lse_meta", meta(8), ValueError, "lse"),  # lse on another device
    # a used entry past the 8 pages
    ("tree_attention", "page_table_past_pages", poke(3, (1, 1), 100), IndexError, "page_table"),
    ("tree_attention", "prefix_lens_overflow", poke(4, 0, 12), IndexError, "prefix_lens"),  # 12 + 5 > 16
    # ---- verify_greedy(logits, tokens, parents) ----
    ("verify_greedy", "logits_int", dtype(0, torch.int64), TypeError, "logits"),  # integer logits
    ("verify_greedy", "parents_strided", put(2, lambda t: torch.cat([t, t], 1)[:, ::2]), ValueError, "parents"),
    ("verify_greedy", "tokens_int32", dtype(1, torch.int32), TypeError, "tokens"),  # tokens are int64
    ("verify_greedy", "parents_int64", dtype(2, torch.int64), TypeError, "parents"),  # the canonical parents are int32
    ("verify_greedy", "logits_rows", put(0, lambda t: t[:9]), ValueError, "logits"),  # B * N = 10
    ("verify_greedy", "parents_short", put(2, lambda t: t[:, :4]), ValueError, "parents"),  # N = 5
    ("verify_greedy", "tokens_meta", meta(1), ValueError, "tokens"),  # the draft tokens on another device
    ("verify_greedy", "parents_meta", meta(2), ValueError, "parents"),  # the tree on another device
    ("verify_greedy", "parents_not_topological", poke(2, (0, 2), 3), ANY, "parents"),  # a child before its parent
    ("verify_greedy", "parents_self_loop", poke(2, (1, 4), 4), ANY, "parents"),  # a node as its own parent
    ("verify_greedy", "parents_root_not_minus_one", poke(2, (1, 0), 0), ANY, "parents"),  # node 0 must be the root
    ("verify_greedy", "parents_second_root", poke(2, (0, 3), -1), ANY, "parents"),  # only node 0 may have parent -1
    # ---- verify_sampling(logits, draft_probs, d2t, tokens, parents, temperature, seed, offset) ----
    # probabilities must be floating point
    ("verify_sampling", "draft_probs_int", dtype(1, torch.int32), TypeError, "draft_probs"),
    ("verify_sampling", "d2t_int32", dtype(2, torch.int32), TypeError, "d2t"),  # d2t is int64
    # temperature is an fp32 device tensor
    ("verify_sampling", "temperature_fp64", dtype(5, torch.float64), TypeError, "temperature"),
    ("verify_sampling", "seed_int32", dtype(6, torch.int32), TypeError, "seed"),  # the Philox key is int64
    ("verify_sampling", "d2t_short", put(2, lambda t: t[:49]), ValueError, "d2t"),  # Vd = 50
    ("verify_sampling", "draft_probs_rows", put(1, lambda t: t[:9]), ValueError, "draft_probs"),  # B * N = 10
    ("verify_sampling", "offset_batch", put(7, lambda t: torch.cat([t, t])), ValueError, "offset"),  # B = 2
    # d2t maps draft_probs' vocabulary: meaningless alone
    ("verify_sampling", "d2t_without_draft_probs", put(1, lambda _: None), ValueError, "d2t"),
    # the draft distribution on another device
    ("verify_sampling", "draft_probs_meta", meta(1), ValueError, "draft_probs"),
    ("verify_sampling", "d2t_meta", meta(2), ValueError, "d2t"),  # the vocabulary map on another device
    ("verify_sampling", "temperature_meta", meta(5), ValueError, "temperature"),  # temperature on another device
    ("verify_sampling", "seed_meta", meta(6), ValueError, "seed"),  # the seed on another device
    ("verify_sampling", "d2t_past_V", poke(2, 49, V - 49), IndexError, "d2t"),  # draft id 49 -> target id V
    ("verify_sampling", "d2t_negative", poke(2, 0, -1), IndexError, "d2t"),  # draft id 0 -> target id -1
    # a node as its own parent (parents[b, j] < j)
    ("verify_sampling", "parents_not_topological", poke(4, (1, 1), 1), ANY, "parents"),
    # temperature >= 0 (0 = greedy)
    ("verify_sampling", "temperature_negative", poke(5, 0, -0.5), ValueError, "temperature"),
    # ---- kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len) ----
    ("kv_accept", "page_table_int64", dtype(1, torch.int64), TypeError, "page_table"),  # page tables are int32
    # prefix_lens is int32 everywhere
    ("kv_accept", "prefix_lens_int64", dtype(2, torch.int64), TypeError, "prefix_lens"),
    # accept_nodes is int32 (verify's output)
    ("kv_accept", "accept_nodes_int64", dtype(3, torch.int64), TypeError, "accept_nodes"),
    # accept_len is int32 (verify's output)
    ("kv_accept", "accept_len_int64", dtype(4, torch.int64), TypeError, "accept_len"),
    ("kv_accept", "caches_page_mismatch", lambda a: a[0].__setitem__(1, a[0][1][:7].clone()), ValueError,
     "caches"),  # layer 1 has 7 pages, layer 0 has 8
    ("kv_accept", "caches_not_contiguous", lambda a: a[0].__setitem__(1, a[0][1].transpose(2, 3)), ValueError,
     "caches"),  # a transposed layer cache: rows are moved as flat memory
    ("kv_accept", "accept_nodes_batch", put(3, lambda t: torch.cat([t, t[:1]])), ValueError, "accept_nodes"),  # B = 2
    ("kv_accept", "accept_len_batch", put(4, lambda t: t[:1]), ValueError, "accept_len"),  # B = 2
    # one layer's cache on another device
    ("kv_accept", "cache_meta", lambda a: a[0].__setitem__(1, a[0][1].to("meta")), ValueError, "caches"),
    ("kv_accept", "page_table_meta", meta(1), ValueError, "page_table"),  # the page table on another device
    ("kv_accept", "prefix_lens_meta", meta(2), ValueError, "prefix_lens"),  # prefix_lens (mutated) on another device
    ("kv_accept", "accept_nodes_meta", meta(3), ValueError, "accept_nodes"),  # accepted nodes on another device
    ("kv_accept", "accept_len_meta", meta(4), ValueError, "accept_len"),  # accept_len on another device
    # accept_nodes may be narrower or wider than the tree: a node is bad when its position leaves the page table
    ("kv_accept", "accept_nodes_past_table", poke(3, (0, 1), 13), IndexError, "accept_nodes"),  # 16 rows, prefix 3
    ("kv_accept", "accept_nodes_padding_inside", poke(3, (1, 3), -1), IndexError, "accept_nodes"),  # a = 3
    ("kv_accept", "accept_len_past_W", poke(4, 1, N), IndexError, "accept_len"),  # at most W - 1 (W = N here)
    ("kv_accept", "accept_len_negative", poke(4, 0, -1), IndexError, "accept_len"),  # a count below 0
    ("kv_accept", "page_table_past_pages", poke(1, (1, 2), 8), IndexError, "page_table"),  # positions 8..10
    ("kv_accept", "prefix_lens_overflow", poke(2, 1, 13), IndexError, "prefix_lens"),  # 13 + a + 1 > 16
]


def _tensors(args):
    """Every CPU tensor the caller passes, lists (caches) included."""
    out = []
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                out.append(t)
    return out


@pytest.mark.parametrize("name, mutate, exc, arg", [pytest.param(c[0], c[2], c[3], c[4], id=f"{c[0]}-{c[1]}")
                                                    for c in CASES])
def test_bad_input_raises_naming_the_argument_and_writes_nothing(name, mutate, exc, arg):
    args = list(sample_args(name))
    getattr(torch.ops.eagle3, name)(*sample_args(name))  # the sample itself is valid
    mutate(args)
    passed = _tensors(args)
    before = [t.clone() for t in passed]
    with pytest.raises(exc, match=arg.replace("[", r"\[")):
        getattr(torch.ops.eagle3, name)(*args)
    for i, (t, b) in enumerate(zip(passed, before)):
        assert_equal(t, b, f"tensor #{i} ({tuple(t.shape)} {t.dtype}) after the failed call")


def test_every_op_is_covered():
    ops = {c[0] for c in CASES}
    assert ops == {"capture_aux", "add_rmsnorm_capture", "fc_proj", "build_tree", "tree_attention_mla",
                   "tree_attention", "verify_greedy", "verify_sampling", "kv_accept"}
    for op in ops:  # every op has at least one dtype, shape, device and index corruption
        kinds = {c[1].split("_")[-1] for c in CASES if c[0] == op}
        assert "meta" in kinds, op


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_fc_proj_fp8_without_scale():
    # an fp8 weight is meaningless without its per-channel scale
    args = list(sample_args("fc_proj"))
    args[1] = args[1].to(FP8)
    out_before = args[7].clone()
    with pytest.raises(ValueError, match="weight_scale"):
        torch.ops.eagle3.fc_proj(*args)
    assert_equal(args[7], out_before)
