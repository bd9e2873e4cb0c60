"""eagle3_ops.compat.vllm.RejectionSampler with its inputs built as vLLM's GPU model runner builds them
(_calc_spec_decode_metadata: flat int32 draft ids, device cu_num_draft_tokens, logits rows request-major,
drafts then bonus): hand-made cases with exact outputs, ragged and empty drafts, greedy + random mixes,
with and without draft_probs, one-hot targets (deterministic outcomes), chi-square tests of the output
distribution, seeded reproducibility, the zero-copy and gathered layouts agreeing, bad input; the same on
CUDA tensors, against the native op, and under CUDA-graph replay (-m gpu)."""

from __future__ import annotations

import os
import re

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import eagle3_ops  # noqa: F401
from eagle3_ops.compat.vllm import MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID, RejectionSampler, SamplerOutput
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import assert_equal, capture_graph

P = PLACEHOLDER_TOKEN_ID


# ---- inputs as vLLM builds them ---------------------------------------------------------------------


def spec_metadata(num_draft_tokens, cu_num_scheduled_tokens=None, input_ids=None, device="cpu"):
    """SpecDecodeMetadata's fields from num_draft_tokens as _calc_spec_decode_metadata derives them:
    per request draft + 1 sampled rows (the last scheduled ones), drafts then bonus. Without a schedule every
    request is scheduled exactly its sampled rows. Returns (metadata, logits_indices)."""
    n = np.asarray(num_draft_tokens, dtype=np.int64)
    sampled = n + 1
    cu_sched = np.cumsum(sampled) if cu_num_scheduled_tokens is None else np.asarray(cu_num_scheduled_tokens)
    cu_sampled = np.cumsum(sampled)
    first = cu_sampled - sampled  # each request's first sampled row
    logits_indices = np.concatenate([np.arange(c - s, c) for c, s in zip(cu_sched, sampled)])
    target = np.concatenate([f + np.arange(k) for f, k in zip(first, n)]) if n.sum() else np.zeros(0, np.int64)
    bonus = cu_sampled - 1
    if input_ids is None:
        input_ids = torch.arange(int(cu_sched[-1]), dtype=torch.int32) % 97
    # the drafts are the inputs one position after each target row (vLLM: input_ids[logits_indices][target + 1])
    drafts = input_ids[torch.from_numpy(logits_indices)][torch.from_numpy(target + 1)]
    i32 = dict(dtype=torch.int32, device=device)
    meta = SimpleNamespace(
        draft_token_ids=drafts.to(device), num_draft_tokens=[int(k) for k in n], max_spec_len=int(n.max()),
        cu_num_draft_tokens=torch.tensor(np.cumsum(n), **i32), cu_num_sampled_tokens=torch.tensor(cu_sampled, **i32),
        target_logits_indices=torch.tensor(target, **i32), bonus_logits_indices=torch.tensor(bonus, **i32),
        logits_indices=torch.tensor(logits_indices, **i32))
    return meta, logits_indices


def sampling_metadata(temperature=None, top_k=None, top_p=None, generators=None, mask=None):
    """SamplingMetadata's fields the rejection sampler reads; temperature None = all greedy."""
    t = temperature
    return SimpleNamespace(
        temperature=t, all_greedy=t is None, all_random=t is not None and bool((t != 0).all()),
        top_k=top_k, top_p=top_p, generators=generators or {}, allowed_token_ids_mask=mask,
        no_penalties=True, bad_words_token_ids={}, max_num_logprobs=None)


def planted_logits(argmax_rows, V=32, device="cpu"):
    """Logits whose row r has its argmax at argmax_rows[r] (+10 over a N(0, 1) floor)."""
    g = torch.Generator().manual_seed(len(argmax_rows))
    z = torch.randn(len(argmax_rows), V, generator=g)
    z[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 10.0
    return z.to(device)


def case(drafts, argmax_rows, V=32, device="cpu"):
    """A greedy case from per-request draft lists and the argmax of each request's rows (drafts + bonus)."""
    meta, _ = spec_metadata([len(d) for d in drafts], device=device)
    flat = [t for d in drafts for t in d]
    meta.draft_token_ids = torch.tensor(flat, dtype=torch.int32, device=device)
    return meta, planted_logits([t for r in argmax_rows for t in r], V, device)


class FixedSampler:
    """Stands in for vLLM's Sampler: returns the given bonus ids, records what it was called with."""

    def __init__(self, bonus):
        self.bonus, self.calls = bonus, []

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False):
        self.calls.append((logits.shape, predict_bonus_token))
        return SamplerOutput(self.bonus)


def out_of(rs, meta, logits, sm, draft_probs=None):
    return rs(meta, draft_probs, logits, sm).sampled_token_ids


# ---- greedy, hand-made, exact ------------------------------------------------------------------------

GREEDY_CASES = [
    # (drafts per request, argmax per row: drafts' rows then the bonus row, expected output)
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),                      # perfect match: the bonus follows
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, P, P]]),                      # mismatch at 1: the argmax, then -1
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, P]]),       # ragged: padded to max_spec_len + 1
    ([[1]], [[2, 3]], [[2, P]]),                                        # first draft rejected
    ([[]], [[5]], [[5]]),                                               # no drafts at all: the bonus alone
    ([[1, 2, 3], [], [4]], [[1, 2, 3, 9], [8], [4, 5]],                # a request at 0 drafts among others
     [[1, 2, 3, 9], [8, P, P, P], [4, 5, P, P]]),
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, P], [4, 8, P, P]]),
]


@pytest.mark.parametrize("drafts,rows,expected", GREEDY_CASES)
@pytest.mark.parametrize("bonus_from", ["op", "sampler"])
def test_greedy_hand_made(drafts, rows, expected, bonus_from):
    meta, logits = case(drafts, rows)
    sampler = FixedSampler(torch.tensor([[r[-1]] for r in rows])) if bonus_from == "sampler" else None
    out = out_of(RejectionSampler(sampler), meta, logits, sampling_metadata())
    assert out.dtype == torch.int32
    assert_equal(out, torch.tensor(expected, dtype=torch.int32))
    if sampler is not None:  # called once, on the bonus rows, as vLLM calls it
        assert sampler.calls == [(torch.Size([len(drafts), logits.shape[1]]), True)]


def test_sampler_bonus_replaces_ours_only_after_full_acceptance():
    # request 0 accepts both drafts: the sampler's 30 (not the argmax 9); request 1 rejects: its argmax 6 stays
    meta, logits = case([[1, 2], [3, 4]], [[1, 2, 9], [6, 4, 7]])
    out = out_of(RejectionSampler(FixedSampler(torch.tensor([[30], [31]]))), meta, logits, sampling_metadata())
    assert_equal(out, torch.tensor([[1, 2, 30], [6, P, P]], dtype=torch.int32))


def test_vllm_scheduler_example_layout():
    # the worked example of vLLM's _calc_spec_decode_metadata: prefills (0 drafts) between decodes
    meta, logits_indices = spec_metadata([3, 0, 2, 0, 1], cu_num_scheduled_tokens=[4, 104, 107, 207, 209])
    assert logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert meta.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert meta.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert meta.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    d = meta.draft_token_ids.tolist()  # inputs 1, 2, 3, 105, 106, 208 (mod 97)
    assert d == [1, 2, 3, 105 % 97, 106 % 97, 208 % 97]
    # argmax per sampled row: request 0 accepts all 3 (then bonus 40), 2 accepts 1 of 2, 4 rejects its only draft
    logits = planted_logits([1, 2, 3, 40, 41, d[3], 50, 42, 43, 44, 45], V=64)
    out = out_of(RejectionSampler(), meta, logits, sampling_metadata())
    want = [[1, 2, 3, 40], [41, P, P, P], [d[3], 50, P, P], [43, P, P, P], [44, P, P, P]]
    assert_equal(out, torch.tensor(want, dtype=torch.int32))


# ---- random requests ----------------------------------------------------------------------------------


def one_hot_logits(tokens, V=32, device="cpu"):
    """Each row puts all its mass on one token (exp(-60) elsewhere): sampling from it is deterministic."""
    z = torch.full((len(tokens), V), -60.0)
    z[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return z.to(device)


@pytest.mark.parametrize("with_probs", [False, True])
def test_random_one_hot_targets_are_deterministic(with_probs):
    # request 0 random, every draft the target's token: all accepted, bonus = the bonus row's token (ours: 9)
    # request 1 greedy inside a mixed batch: its 2nd draft misses the argmax 6
    # request 2 random, 1st draft (4) not the target's token (3): rejected, the recovered token is 3
    # request 3 random with no drafts: only the bonus, drawn from its one-hot row (12)
    meta, _ = spec_metadata([2, 2, 2, 0])
    meta.draft_token_ids = torch.tensor([1, 2, 5, 7, 4, 8], dtype=torch.int32)
    logits = one_hot_logits([1, 2, 9, 5, 6, 11, 3, 8, 10, 12])
    probs = None
    if with_probs:  # each draft proposed with probability 1/2 (the other half on token 0)
        probs = torch.zeros(6, 32)
        probs[torch.arange(6), meta.draft_token_ids.long()] = 0.5
        probs[:, 0] += 0.5
    want = torch.tensor([[1, 2, 9], [5, 6, P], [3, P, P], [12, P, P]], dtype=torch.int32)
    for greedy_t in (0.0, -1.0):  # vLLM's greedy placeholder now, and before it became 0
        sm = sampling_metadata(temperature=torch.tensor([1.0, greedy_t, 0.8, 1.0]))
        assert_equal(out_of(RejectionSampler(), meta, logits, sm, probs), want)


V_SMALL = 6
CHI2_DF5_P1E3 = 20.515  # the chi-square quantile at 1 - 1e-3 with 5 degrees of freedom (V_SMALL - 1)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_follows_the_target(with_probs, temperature):
    """The first emitted token (an accepted draft or the recovered one) is an exact draw from the target at
    that temperature, whatever the draft proposes: chi-square over 3000 requests, vLLM's test's setting."""
    B, k = 3000, 2
    g = torch.Generator().manual_seed(7)
    target = torch.tensor([1.2, 0.3, -0.5, 0.9, 0.0, -1.0])
    q = torch.tensor([0.05, 0.4, 0.1, 0.05, 0.3, 0.1])
    meta, _ = spec_metadata([k] * B)
    if with_probs:  # drafts drawn from q, as a sampling drafter proposes
        meta.draft_token_ids = torch.multinomial(q, B * k, replacement=True, generator=g).to(torch.int32)
        probs = q.repeat(B * k, 1)
    else:  # drafts by argmax of the draft model (EAGLE without probs, ngram): always token 1
        meta.draft_token_ids = torch.ones(B * k, dtype=torch.int32)
        probs = None
    logits = target.repeat(B * (k + 1), 1)
    torch.manual_seed(11)  # the per-request Philox keys come from the default generator
    out = out_of(RejectionSampler(), meta, logits, sampling_metadata(torch.full((B,), temperature)), probs)
    counts = torch.bincount(out[:, 0].long(), minlength=V_SMALL)
    assert chi2(counts, torch.softmax(target / temperature, -1)) < CHI2_DF5_P1E3, counts.tolist()


def test_seeded_requests_reproduce_and_advance_their_generator():
    B, k, V = 6, 3, 50
    meta, _ = spec_metadata([k] * B)
    meta.draft_token_ids = torch.randint(0, V, (B * k,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(B * (k + 1), V, generator=torch.Generator().manual_seed(2))
    temp = torch.ones(B)

    def run(seeds, default_seed):
        gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        torch.manual_seed(default_seed)
        out = out_of(RejectionSampler(), meta, logits, sampling_metadata(temp, generators=gens))
        return out, gens

    a, gens = run({0: 5, 3: 6}, 100)
    b, _ = run({0: 5, 3: 6}, 200)  # the unseeded requests draw anew, the seeded ones repeat
    assert_equal(a[[0, 3]], b[[0, 3]], "seeded rows")
    assert all(g.initial_seed() == s for g, s in zip(gens.values(), (5, 6)))
    fresh = torch.Generator().manual_seed(5)
    assert not torch.equal(gens[0].get_state(), fresh.get_state()), "the seeded generator did not advance"


def test_zero_copy_and_gathered_layouts_agree():
    """vLLM's own row order (zero copy into the op) and the same rows shuffled with the indices saying where
    (gathered): identical outputs, greedy and random (same Philox keys), with and without draft_probs."""
    B, k, V = 5, 3, 40
    g = torch.Generator().manual_seed(3)
    meta, _ = spec_metadata([k] * B)
    meta.draft_token_ids = torch.randint(0, V, (B * k,), dtype=torch.int32, generator=g)
    logits = torch.randn(B * (k + 1), V, generator=g) * 3
    probs = torch.softmax(torch.randn(B * k, V, generator=g), -1)
    # one spare row, so that the shuffled logits are not taken as vLLM's order but gathered through the indices
    perm = torch.cat([torch.randperm(B * (k + 1), generator=g), torch.tensor([0])])
    shuffled = SimpleNamespace(**vars(meta))
    inverse = torch.argsort(perm[:-1])  # row r of the original is row inverse[r] of logits[perm]
    shuffled.target_logits_indices = inverse[meta.target_logits_indices.long()].to(torch.int32)
    shuffled.bonus_logits_indices = inverse[meta.bonus_logits_indices.long()].to(torch.int32)
    for sm in (sampling_metadata(), sampling_metadata(torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0]))):
        for dp in (None, probs):
            torch.manual_seed(0)
            a = out_of(RejectionSampler(), meta, logits, sm, dp)
            torch.manual_seed(0)
            b = out_of(RejectionSampler(), shuffled, logits[perm], sm, dp)
            assert_equal(a, b)


@pytest.mark.parametrize("which", ["top_k", "top_p"])
def test_top_k_top_p_of_one_token_is_greedy(which):
    # top-k 1, or a top-p small enough to keep only the largest token, turns a random request greedy
    B, k, V = 4, 3, 30
    g = torch.Generator().manual_seed(5)
    meta, _ = spec_metadata([3, 1, 0, 2])
    logits = torch.randn(meta.bonus_logits_indices.shape[0] + len(meta.draft_token_ids), V, generator=g)
    argmax = logits.argmax(-1)
    meta.draft_token_ids = argmax[meta.target_logits_indices.long()].to(torch.int32)
    meta.draft_token_ids[2] = (meta.draft_token_ids[2] + 1) % V  # request 0 misses its 3rd draft
    kw = dict(top_k=torch.ones(B, dtype=torch.int64)) if which == "top_k" else dict(top_p=torch.full((B,), 1e-6))
    out = out_of(RejectionSampler(), meta, logits, sampling_metadata(torch.full((B,), 1.5), **kw))
    want = out_of(RejectionSampler(), meta, logits, sampling_metadata())
    assert_equal(out, want)


def test_allowed_token_ids_mask():
    # request 0 may not emit 1 (its first draft, the argmax): rejected, the next best allowed token instead
    meta, logits = case([[1, 2], [3, 4]], [[1, 2, 5], [3, 4, 7]])
    logits[0, 9] = 9.0  # the best allowed token in row 0
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[0, 1] = True
    out = out_of(RejectionSampler(), meta, logits, sampling_metadata(mask=mask))
    assert_equal(out, torch.tensor([[9, P, P], [3, 4, 7]], dtype=torch.int32))


class RowLogprobs:
    """vLLM's LogprobsTensors as parse_output uses it: one logprob per output slot, filter(mask) then tolists(cu)."""

    def __init__(self, logprobs, cu=None):
        self.logprobs, self.cu = logprobs, cu

    def filter(self, mask):
        return RowLogprobs(self.logprobs[mask])

    def tolists(self, cu):
        return [self.logprobs[a:b].tolist() for a, b in zip(cu[:-1], cu[1:])]


def test_parse_output():
    out = torch.tensor([[1, 2, P], [5, P, P], [7, 8, 9]], dtype=torch.int32)
    assert RejectionSampler.parse_output(out, 9) == ([[1, 2], [5], [7, 8]], None)
    # older vLLM: the cumulative counts (before discarding), asked for by keyword
    assert RejectionSampler.parse_output(out, 100, [1], return_cu_num_tokens=True) == ([[1, 2], [], [7, 8, 9]],
                                                                                       [0, 2, 3, 6])
    # vLLM 0.33.0 (GPUModelRunner): logprobs_tensors=..., filtered to the valid slots, split per request; the
    # discarded request keeps its logprobs rows, as vLLM's
    slot_logprobs = -torch.arange(9, dtype=torch.float32).view(3, 3).flatten()
    tokens, logprobs = RejectionSampler.parse_output(out, 9, [1], logprobs_tensors=RowLogprobs(slot_logprobs))
    assert tokens == [[1, 2], [], [7, 8]]
    assert logprobs == [[-0.0, -1.0], [-3.0], [-6.0, -7.0]]
    with pytest.raises(TypeError, match="return_cu_num_tokens is keyword-only"):
        RejectionSampler.parse_output(out, 9, (), True)


# ---- bad input: refused before anything runs, naming vLLM's field ------------------------------------


def _good():
    meta, logits = case([[1, 2], [3]], [[1, 2, 5], [3, 4]])
    return meta, logits, sampling_metadata(torch.tensor([1.0, 0.0])), torch.softmax(torch.randn(3, 32), -1)


class MinTokensLogitsProcessor:
    """vLLM's processor as its forward sees it: min_toks maps a request to its (min_tokens, ...) while below it."""

    def __init__(self, min_toks):
        self.min_toks = min_toks


def _procs(min_toks):
    """SamplingMetadata.logitsprocs as vLLM builds it (min_tokens is non-argmax-invariant)."""
    return SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[MinTokensLogitsProcessor(min_toks)])


def _set(obj, **kw):
    new = SimpleNamespace(**vars(obj))
    for k, v in kw.items():
        setattr(new, k, v)
    return new


BAD = [
    # (what, change(meta, logits, sm, probs) -> the same four, error type, text the message must hold)
    ("draft ids length", lambda m, z, s, p: (_set(m, draft_token_ids=m.draft_token_ids[:2]), z, s, p),
     ValueError, "metadata.draft_token_ids must have shape (num_tokens)"),
    ("draft ids dtype", lambda m, z, s, p: (_set(m, draft_token_ids=m.draft_token_ids.float()), z, s, p),
     TypeError, "metadata.draft_token_ids must have dtype"),
    ("cu length", lambda m, z, s, p: (_set(m, cu_num_draft_tokens=m.cu_num_draft_tokens[:1]), z, s, p),
     ValueError, "metadata.cu_num_draft_tokens must have shape (batch_size)"),
    ("cu values", lambda m, z, s, p: (_set(m, cu_num_draft_tokens=torch.tensor([1, 3], dtype=torch.int32)), z, s, p),
     Eagle3InputError, "metadata.cu_num_draft_tokens[0] = 1"),
    ("counts a tensor", lambda m, z, s, p: (_set(m, num_draft_tokens=torch.tensor([2, 1])), z, s, p),
     TypeError, "metadata.num_draft_tokens must be a non-empty host list"),
    ("max_spec_len", lambda m, z, s, p: (_set(m, max_spec_len=3), z, s, p),
     ValueError, "metadata.max_spec_len must be max(num_draft_tokens) = 2"),
    ("target index out of range", lambda m, z, s, p: (
        _set(m, target_logits_indices=torch.tensor([0, 1, 9], dtype=torch.int32)), z[:-1], s, p),
     Eagle3InputError, "metadata.target_logits_indices[2] = 9 is out of range (valid: 0..3)"),
    ("indices on another device", lambda m, z, s, p: (
        _set(m, bonus_logits_indices=m.bonus_logits_indices.to("meta")), z, s, p),
     ValueError, "metadata.bonus_logits_indices must be on logits' device (cpu) or the CPU, got meta"),
    ("logits 1-D", lambda m, z, s, p: (m, z[0], s, p), ValueError, "logits must have 2 dimensions"),
    ("logits int", lambda m, z, s, p: (m, z.long(), s, p), TypeError, "logits must have dtype"),
    ("draft_probs vocab", lambda m, z, s, p: (m, z, s, p[:, :5]), ValueError,
     "draft_probs must have shape (num_tokens, vocab_size) = (3, 32)"),
    ("temperature dtype", lambda m, z, s, p: (m, z, _set(s, temperature=s.temperature.double()), p), TypeError,
     "sampling_metadata.temperature must have dtype float32"),
    ("temperature negative", lambda m, z, s, p: (m, z, _set(s, temperature=torch.tensor([1.0, -0.5])), p),
     Eagle3InputError, "sampling_metadata.temperature[1] = -0.5 must be >= 0"),
    ("top_k shape", lambda m, z, s, p: (m, z, _set(s, top_k=torch.ones(3, dtype=torch.int64)), p), ValueError,
     "sampling_metadata.top_k must have shape (batch_size)"),
    ("generator index", lambda m, z, s, p: (m, z, _set(s, generators={2: torch.Generator()}), p), ValueError,
     "sampling_metadata.generators has request index 2"),
    ("penalties", lambda m, z, s, p: (m, z, _set(s, no_penalties=False), p), NotImplementedError,
     "sampling_metadata.no_penalties is False"),
    ("bad words", lambda m, z, s, p: (m, z, _set(s, bad_words_token_ids={0: [[2]]}), p), NotImplementedError,
     "sampling_metadata.bad_words_token_ids"),
    ("logprobs", lambda m, z, s, p: (m, z, _set(s, max_num_logprobs=0), p), NotImplementedError,
     "sampling_metadata.max_num_logprobs"),
    ("min_tokens", lambda m, z, s, p: (m, z, _set(s, logitsprocs=_procs(min_toks={1: (4, [], set(), False)})), p),
     NotImplementedError, "MinTokensLogitsProcessor with requests below their min_tokens"),
    ("thinking budget", lambda m, z, s, p: (
        m, z, _set(s, thinking_budget_state_holder=SimpleNamespace(has_tracked_requests=lambda: True)), p),
     NotImplementedError, "sampling_metadata.thinking_budget_state_holder tracks requests"),
    ("no bonus rows without a sampler", lambda m, z, s, p: (
        _set(m, bonus_logits_indices=torch.zeros(0, dtype=torch.int32)), z, s, p),
     ValueError, "metadata.bonus_logits_indices must have shape (batch_size) = (2) with sampler=None"),
]


@pytest.mark.parametrize("what,change,err,text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_and_nothing_is_written(what, change, err, text):
    meta, logits, sm, probs = change(*_good())
    before = [t.clone() for t in (logits, probs, meta.draft_token_ids, meta.cu_num_draft_tokens)]
    state = torch.get_rng_state()
    with pytest.raises(err) as e:
        RejectionSampler()(meta, probs, logits, sm)
    assert text in str(e.value), str(e.value)
    for b, a in zip(before, (logits, probs, meta.draft_token_ids, meta.cu_num_draft_tokens)):
        assert_equal(a, b, "input after a refused call")
    assert torch.equal(torch.get_rng_state(), state), "a refused call drew random numbers"


def test_constructed_as_vllms_model_runner_constructs_it():
    # GPUModelRunner builds RejectionSampler(self.sampler, self.speculative_config, self.device); standard and
    # block (standard in vLLM's v1 sampler) run as standard, a config without the field (older vLLM) too
    drafts, rows, expected = GREEDY_CASES[5]
    for config in (SimpleNamespace(rejection_sample_method="standard"),
                   SimpleNamespace(rejection_sample_method="block"), SimpleNamespace(), None):
        meta, logits = case(drafts, rows)
        sampler = FixedSampler(torch.tensor([[r[-1]] for r in rows]))
        sm = sampling_metadata()
        sm.logitsprocs = _procs(min_toks={})  # min_tokens processor present, no request below its minimum
        out = out_of(RejectionSampler(sampler, config, torch.device("cpu")), meta, logits, sm)
        assert_equal(out, torch.tensor(expected, dtype=torch.int32))


@pytest.mark.parametrize("method,what", [("fly", "FLy verification"), ("synthetic", "synthetic acceptance")])
def test_other_rejection_methods_are_refused_at_construction(method, what):
    config = SimpleNamespace(rejection_sample_method=method, fly_window_size=2, synthetic_acceptance_rates=[1.0])
    with pytest.raises(NotImplementedError, match=f"spec_config.rejection_sample_method = '{method}': {what}"):
        RejectionSampler(FixedSampler(torch.zeros(1, 1, dtype=torch.int64)), config, torch.device("cpu"))


def test_max_spec_len_bound_and_shuffled_rows_taken_as_vllm_order_are_refused():
    meta, _ = spec_metadata([MAX_SPEC_LEN + 1])
    with pytest.raises(ValueError, match="MAX_SPEC_LEN = 128"):
        RejectionSampler()(meta, None, torch.zeros(MAX_SPEC_LEN + 2, 8), sampling_metadata())
    meta, logits = case([[1, 2], [3, 4]], [[1, 2, 5], [3, 4, 7]])
    meta.bonus_logits_indices = torch.tensor([5, 2], dtype=torch.int32)
    with pytest.raises(Eagle3InputError, match=r"bonus_logits_indices\[0\] = 5, expected 2"):
        RejectionSampler()(meta, None, logits, sampling_metadata())


def test_top_k_does_not_write_the_callers_logits():
    meta, logits = case([[1, 2], [3]], [[1, 2, 5], [3, 4]])
    before = logits.clone()
    out_of(RejectionSampler(), meta, logits, sampling_metadata(torch.ones(2), top_k=torch.tensor([2, 3])))
    assert_equal(logits, before, "logits")


# ---- CUDA ---------------------------------------------------------------------------------------------


def _batch(counts, V, dtype=torch.bfloat16, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    meta, _ = spec_metadata(counts, device=device)
    T, B = sum(counts), len(counts)
    logits = (torch.randn(T + B, V, generator=g) * 4).to(dtype)
    best = logits.float().argmax(-1)[meta.target_logits_indices.cpu().long()]
    coin = torch.rand(T, generator=g) < 0.7  # most drafts are the target's argmax: long accepted runs
    drafts = torch.where(coin, best, torch.randint(0, V, (T,), generator=g))
    meta.draft_token_ids = drafts.to(torch.int32).to(device)
    probs = torch.softmax(torch.randn(T, V, generator=g), -1).to(device)
    return meta, logits.to(device), probs


def _cpu(meta):
    return SimpleNamespace(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()})


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[3] * 64, [4, 0, 2, 4, 1, 0, 3, 4], [0, 0, 0]], ids=["uniform", "ragged", "none"])
@pytest.mark.parametrize("V", [111, 32000, 163840])
def test_gpu_greedy_matches_cpu(counts, V):
    meta, logits, _ = _batch(counts, V)
    sm = sampling_metadata()
    got = out_of(RejectionSampler(), meta, logits, sm)
    want = out_of(RejectionSampler(), _cpu(meta), logits.cpu(), sm)
    assert_equal(got.cpu(), want)


@pytest.mark.gpu
def test_gpu_host_indices_as_vllms_test_passes_them():
    # vLLM's own test hands torch.arange / torch.empty indices on the host with CUDA logits
    meta, logits, _ = _batch([4, 0, 2, 4, 1, 0, 3, 4], 32000)
    want = out_of(RejectionSampler(), meta, logits, sampling_metadata())
    meta.target_logits_indices = meta.target_logits_indices.cpu()
    meta.bonus_logits_indices = meta.bonus_logits_indices.cpu()
    assert_equal(out_of(RejectionSampler(), meta, logits, sampling_metadata()), want)


def _native_sampling(meta, logits, probs, temperature, seed=None):
    """The same step done by hand on the native op: the padded chain, Philox keys from the same generator (or
    the given ones)."""
    B, K, dev = len(meta.num_draft_tokens), meta.max_spec_len, logits.device
    N = K + 1
    tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    rows = meta.bonus_logits_indices.long()[:, None].repeat(1, N)
    q = torch.zeros(B * N, logits.shape[1], dtype=probs.dtype, device=dev) if probs is not None else None
    i = 0
    for b, n in enumerate(meta.num_draft_tokens):
        tokens[b, 1:n + 1] = meta.draft_token_ids[i:i + n].long()
        rows[b, :n] = meta.target_logits_indices[i:i + n].long()
        if q is not None:
            q[b * N:b * N + n] = probs[i:i + n]
        i += n
    parents = (torch.arange(N, dtype=torch.int32, device=dev) - 1).repeat(B, 1)
    seed = torch.empty(B, dtype=torch.int64, device=dev).random_() if seed is None else seed
    offset = torch.zeros(B, dtype=torch.int64, device=dev)
    _, _, emitted = torch.ops.eagle3.verify_sampling(logits[rows.view(-1)], q, None, tokens, parents, temperature,
                                                     seed, offset)
    return emitted.to(torch.int32)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("counts", [[3] * 64, [4, 0, 2, 4, 1, 0, 3, 4]], ids=["uniform", "ragged"])
@pytest.mark.parametrize("with_probs", [False, True])
def test_sampling_matches_the_native_op(device, counts, with_probs):
    """Greedy and random requests mixed, Kimi's vocabulary on CUDA (a small one under the CPU reference):
    the compat entry equals the native op called by hand on the padded chain with the same Philox keys."""
    meta, logits, probs = _batch(counts, 163840 if device == "cuda" else 1000, device=device)
    probs = probs if with_probs else None
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3] * (len(counts) // 4), device=device)
    torch.manual_seed(3)  # seeds the CUDA default generators too
    got = out_of(RejectionSampler(), meta, logits, sampling_metadata(temp), probs)
    torch.manual_seed(3)
    want = _native_sampling(meta, logits, probs, temp)
    # CUDA with draft_probs: the native op's extra pass over the padded node may move a bonus draw (see
    # test_gpu_sampling_op_matches_the_native_op); the CPU path is the native op itself
    assert_agree(got.cpu(), want.cpu(), counts, loose_bonus=with_probs and device == "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("with_probs", [False, True])
def test_gpu_first_token_follows_the_target(with_probs):
    B, k = 20000, 2
    target = torch.tensor([1.2, 0.3, -0.5, 0.9, 0.0, -1.0])
    q = torch.tensor([0.05, 0.4, 0.1, 0.05, 0.3, 0.1])
    meta, _ = spec_metadata([k] * B, device="cuda")
    g = torch.Generator().manual_seed(9)
    drafts = torch.multinomial(q, B * k, replacement=True, generator=g) if with_probs else torch.ones(B * k)
    meta.draft_token_ids = drafts.to(torch.int32).cuda()
    probs = q.repeat(B * k, 1).cuda() if with_probs else None
    out = out_of(RejectionSampler(), meta, target.repeat(B * (k + 1), 1).cuda(), sampling_metadata(
        torch.ones(B, device="cuda")), probs)
    counts = torch.bincount(out[:, 0].long().cpu(), minlength=V_SMALL)
    assert chi2(counts, torch.softmax(target, -1)) < CHI2_DF5_P1E3, counts.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "random"])
def test_gpu_graph_replay_matches_eager(greedy):
    """The zero-copy path (every request at max_spec_len) captured once, replayed after new values are
    written in place: the replay equals an eager call on those values. Random requests get one-hot targets,
    so their outcome does not depend on the Philox keys the replay draws."""
    def batch(seed):
        meta, logits, _ = _batch([3] * 16, 32000, seed=seed)
        if not greedy:
            logits = torch.full_like(logits, -60.0).scatter_(1, logits.float().argmax(-1, keepdim=True), 0.0)
        return meta, logits

    (meta, logits), (new_meta, new_logits) = batch(1), batch(2)
    sm = sampling_metadata() if greedy else sampling_metadata(torch.ones(16, device="cuda"))
    rs = RejectionSampler()
    old = out_of(rs, meta, logits, sm)
    graph, out = capture_graph(lambda: out_of(rs, meta, logits, sm))
    meta.draft_token_ids.copy_(new_meta.draft_token_ids)
    logits.copy_(new_logits)
    graph.replay()
    want = out_of(rs, meta, logits, sm)
    assert not torch.equal(want, old), "the new values change nothing: the test would not see a stale replay"
    assert_equal(out, want)


def test_one_sampler_across_batch_shapes():
    # the chain's parents and offsets are kept per (batch, max_spec_len + 1): a reused instance must not mix them
    rs = RejectionSampler()
    for drafts, rows, expected in GREEDY_CASES + GREEDY_CASES[::-1]:
        meta, logits = case(drafts, rows)
        assert_equal(out_of(rs, meta, logits, sampling_metadata(torch.zeros(len(drafts)))),
                     torch.tensor(expected, dtype=torch.int32))


# ---- the internal ops (torch.ops.eagle3._vllm_rejection_*): CPU = the tensor-op path, fakes, tracing -----------

_GREEDY_OP = getattr(torch.ops.eagle3, "_vllm_rejection_greedy", None)
_SAMPLING_OP = getattr(torch.ops.eagle3, "_vllm_rejection_sampling", None)
needs_ops = pytest.mark.skipif(_GREEDY_OP is None, reason="this _C predates the _vllm_rejection_* schemas")

COUNTS = {
    "uniform": [3] * 8,
    "ragged": [4, 0, 2, 4, 1, 0, 3, 4],
    "none": [0, 0, 0],
    "B1": [5],
    "B1-empty": [0],
    "bigB": [(7 * i) % 5 for i in range(300)],  # 0..4 drafts, every count present
}


def _op_args(meta, logits, bonus=None):
    T = int(meta.draft_token_ids.shape[0])
    B = len(meta.num_draft_tokens)
    return (logits, meta.draft_token_ids, meta.cu_num_draft_tokens, meta.target_logits_indices,
            meta.bonus_logits_indices, bonus, B, T, meta.max_spec_len)


def _sampling_args(meta, logits, probs, temp, seed, bonus=None):
    g = _op_args(meta, logits, bonus)
    return (g[0], probs, *g[1:6], temp, seed, *g[6:])


@needs_ops
@pytest.mark.parametrize("shape", list(COUNTS))
@pytest.mark.parametrize("bonus_from", ["op", "sampler", "sampler-no-rows"])
def test_greedy_op_is_the_sampler_on_cpu(shape, bonus_from):
    """The op with vLLM's arguments (ragged, zero drafts, B 1, B 300) = RejectionSampler's output; the sampler's
    bonus replaces ours only after full acceptance; without bonus rows ([0] indices) it is all the op needs."""
    counts = COUNTS[shape]
    meta, logits, _ = _batch(counts, 57, dtype=torch.float32, seed=len(counts), device="cpu")
    B = len(counts)
    bonus = None if bonus_from == "op" else torch.arange(1000, 1000 + B, dtype=torch.int64).view(B, 1)
    want = out_of(RejectionSampler(None if bonus is None else FixedSampler(bonus)), meta, logits, sampling_metadata())
    if bonus_from == "sampler-no-rows":
        meta.bonus_logits_indices = torch.zeros(0, dtype=torch.int32)
    got = _GREEDY_OP(*_op_args(meta, logits, bonus))
    assert got.dtype == torch.int32 and got.shape == (B, meta.max_spec_len + 1)
    assert_equal(got, want)
    if bonus is not None:  # the bonus slot of every fully accepted request, and no other slot, is the sampler's
        n = torch.tensor(counts)
        assert_equal((got >= 1000).sum(1), (got[torch.arange(B), n] >= 1000).long())


@needs_ops
def test_greedy_op_at_kimi_vocabulary_on_cpu():
    meta, logits, _ = _batch([3, 0, 1], 163840, dtype=torch.float32, seed=4, device="cpu")
    assert_equal(_GREEDY_OP(*_op_args(meta, logits)), out_of(RejectionSampler(), meta, logits, sampling_metadata()))


@needs_ops
@pytest.mark.parametrize("shape", ["uniform", "ragged", "B1", "none"])
@pytest.mark.parametrize("with_probs", [False, True])
def test_sampling_op_is_the_native_op_on_cpu(shape, with_probs):
    """The sampling op's CPU implementation with explicit Philox keys = the native op on the padded chain."""
    counts = COUNTS[shape]
    meta, logits, probs = _batch(counts, 61, dtype=torch.float32, seed=9, device="cpu")
    probs = probs if with_probs else None
    B = len(counts)
    temp = torch.tensor([0.0, 1.0, 0.7, -1.0, 1.3][:B] * (B // 5 + 1))[:B].contiguous()
    seed = torch.arange(17, 17 + B, dtype=torch.int64)
    got = _SAMPLING_OP(*_sampling_args(meta, logits, probs, temp, seed))
    torch.manual_seed(0)
    want = _native_sampling(meta, logits, probs, torch.where(temp == -1, 0.0, temp), seed=seed)
    assert_equal(got, want)


def _sample_op_inputs():
    meta, logits, probs = _batch([2, 0, 3], 40, dtype=torch.float32, seed=1, device="cpu")
    temp = torch.tensor([1.0, 0.0, 0.5])
    seed = torch.tensor([1, 2, 3])
    return meta, logits, probs, temp, seed


@needs_ops
def test_ops_opcheck_and_fake_tensors():
    """opcheck (schema, fake = real shapes, no aliasing) on CPU, and FakeTensor tracing without data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta, logits, probs, temp, seed = _sample_op_inputs()
    torch.library.opcheck(_GREEDY_OP.default, _op_args(meta, logits))
    torch.library.opcheck(_SAMPLING_OP.default, _sampling_args(meta, logits, probs, temp, seed))
    with FakeTensorMode() as mode:
        f = lambda t: mode.from_tensor(t)  # noqa: E731
        fmeta = SimpleNamespace(**{k: f(v) if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()})
        out = _GREEDY_OP(*_op_args(fmeta, f(logits)))
        assert out.shape == (3, 4) and out.dtype == torch.int32
        out = _SAMPLING_OP(*_sampling_args(fmeta, f(logits), f(probs), f(temp), f(seed)))
        assert out.shape == (3, 4) and out.dtype == torch.int32
        with pytest.raises(ValueError, match=r"metadata.draft_token_ids must have shape \(num_tokens\) = \(4\)"):
            _GREEDY_OP(*_op_args(fmeta, f(logits))[:-2], 4, 3)


@needs_ops
def test_ops_trace_under_torch_compile():
    meta, logits, probs, temp, seed = _sample_op_inputs()

    def step(lg, d, cu, t, b, p, tp, sd):
        return _GREEDY_OP(lg, d, cu, t, b, None, 3, 5, 3), _SAMPLING_OP(lg, p, d, cu, t, b, None, tp, sd, 3, 5, 3)

    args = (logits, meta.draft_token_ids, meta.cu_num_draft_tokens, meta.target_logits_indices,
            meta.bonus_logits_indices, probs, temp, seed)
    got = torch.compile(step, backend="eager", fullgraph=True)(*args)
    for a, b in zip(got, step(*args)):
        assert_equal(a, b)


# ---- the internal ops on CUDA: against their CPU implementation, bad input, the error word, launches, graphs -----


@pytest.mark.gpu
@needs_ops
@pytest.mark.parametrize("shape", list(COUNTS))
@pytest.mark.parametrize("V", [111, 32000, 163840])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bonus_from", ["op", "sampler", "sampler-no-rows"])
def test_gpu_greedy_op_matches_cpu(shape, V, dtype, bonus_from):
    """The CUDA kernels read vLLM's flat logits in place: equal to the CPU implementation (the padded
    gather on the reference op), with the output poisoned first by a previous call's garbage."""
    if shape == "bigB" and V == 163840:
        pytest.skip("B 300 at V 163840 holds 1200 rows: covered at V 32000")
    meta, logits, _ = _batch(COUNTS[shape], V, dtype=dtype, seed=V % 97)
    B = len(COUNTS[shape])
    bonus = None if bonus_from == "op" else torch.randint(0, V, (B, 1), device="cuda")
    if bonus_from == "sampler-no-rows":
        meta.bonus_logits_indices = torch.zeros(0, dtype=torch.int32, device="cuda")
    got = _GREEDY_OP(*_op_args(meta, logits, bonus))
    want = _GREEDY_OP(*_op_args(_cpu(meta), logits.cpu(), None if bonus is None else bonus.cpu()))
    assert_equal(got.cpu(), want)


@pytest.mark.gpu
@needs_ops
@pytest.mark.parametrize("shape", ["uniform", "ragged", "B1", "none", "bigB"])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("bonus_from", ["op", "sampler-no-rows"])
def test_gpu_sampling_op_matches_the_native_op(shape, with_probs, bonus_from):
    """Kimi's vocabulary, greedy / random / vLLM's -1 requests mixed: the chain mode draws the native op's
    Philox numbers on the padded chain, so the outputs agree; with draft_probs the native op's extra residual
    pass over the padded node after a fully accepted chain (a renormalisation by ~1) may move a bonus draw,
    so those slots are compared only in distribution (the chi-square tests)."""
    counts = COUNTS[shape]
    V = 163840 if shape != "bigB" else 32000
    meta, logits, probs = _batch(counts, V, seed=5)
    probs = probs if with_probs else None
    B = len(counts)
    temp = torch.tensor(([0.0, 1.0, 0.7, -1.0, 1.3] * (B // 5 + 1))[:B], device="cuda")
    seed = torch.randint(0, 2**62, (B,), device="cuda")
    bonus = None
    rows = meta.bonus_logits_indices.clone()
    if bonus_from == "sampler-no-rows":
        bonus = torch.randint(0, V, (B,), device="cuda")
        meta.bonus_logits_indices = torch.zeros(0, dtype=torch.int32, device="cuda")
    got = _SAMPLING_OP(*_sampling_args(meta, logits, probs, temp, seed, bonus)).cpu()
    meta.bonus_logits_indices = rows
    want = _native_sampling(meta, logits, probs, torch.where(temp == -1, 0.0, temp), seed=seed).cpu()
    assert_agree(got, want, counts, loose_bonus=with_probs or bonus is not None)
    if bonus is not None:  # the sampler's token in the bonus slot of every fully accepted request
        full = (want != P).sum(1) - 1 == torch.tensor(counts)
        slot = got[torch.arange(B), torch.tensor(counts)]
        assert_equal(slot[full], bonus.cpu().to(torch.int32)[full])


def assert_agree(got, want, counts, loose_bonus):
    """got == want, except (loose_bonus) in the bonus slot of the requests that accepted every draft."""
    n = torch.tensor(counts)
    full = (want != P).sum(1) - 1 == n  # want: accepted drafts, one more token, then -1
    loose = (torch.arange(want.shape[1])[None, :] == n[:, None]) & full[:, None] & loose_bonus
    assert_equal(torch.where(loose, P, got), torch.where(loose, P, want))


def _cuda(meta):
    return SimpleNamespace(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()})


# The rows of BAD that the CUDA path refuses on the host, as the CPU path words them; the values only the data
# shows go to the device error word (test_gpu_values_go_to_the_error_word).
_HOST_BAD = [b for b in BAD if b[2] is not Eagle3InputError]


@pytest.mark.gpu
@needs_ops
@pytest.mark.parametrize("what,change,err,text", _HOST_BAD, ids=[b[0] for b in _HOST_BAD])
def test_gpu_bad_input_is_refused_as_on_cpu(what, change, err, text):
    meta, logits, sm, probs = _good()
    meta, logits, sm, probs = change(_cuda(meta), logits.cuda(), _cuda(sm), probs.cuda())
    if what == "indices on another device":
        text = "metadata.bonus_logits_indices must be on logits' device (cuda:0) or the CPU, got meta"
    before = [t.clone() for t in (logits, probs, meta.draft_token_ids)]
    with pytest.raises(err) as e:
        RejectionSampler()(meta, probs, logits, sm)
    assert text in str(e.value), str(e.value)
    for b, a in zip(before, (logits, probs, meta.draft_token_ids)):
        assert_equal(a, b, "input after a refused call")


@pytest.mark.gpu
@needs_ops
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "random"])
@pytest.mark.parametrize("fault", ["cu", "cu-last", "target", "bonus", "temperature"])
def test_gpu_values_go_to_the_error_word(greedy, fault):
    """No host sync in the call: a bad value is recorded (op, argument, index, value, valid range), the call
    still writes every output slot in bounds, and check_errors / strict mode raise it."""
    if fault == "temperature" and greedy:
        pytest.skip("greedy batches read no temperature")
    meta, logits, _ = _batch([2, 1, 2], 1000, seed=3)
    op_name = "_vllm_rejection_greedy" if greedy else "_vllm_rejection_sampling"
    temp = torch.tensor([1.0, -1.0, 0.5], device="cuda")  # -1: vLLM's old greedy placeholder, valid
    if fault == "cu":
        meta.cu_num_draft_tokens = torch.tensor([3, 3, 5], dtype=torch.int32, device="cuda")  # 3 > max_spec_len 2
        want = f"{op_name}: cu_num_draft_tokens[0] = 3 is out of range (valid: 0..2)"
    elif fault == "cu-last":
        meta.cu_num_draft_tokens = torch.tensor([2, 3, 4], dtype=torch.int32, device="cuda")  # ends before 5
        want = f"{op_name}: cu_num_draft_tokens[2] = 4 is out of range (valid: 5..5)"
    elif fault == "target":
        meta.target_logits_indices[1] = 99
        want = f"{op_name}: target_logits_indices[1] = 99 is out of range (valid: 0..7)"
    elif fault == "bonus":
        meta.bonus_logits_indices[2] = -4
        want = f"{op_name}: bonus_logits_indices[2] = -4 is out of range (valid: 0..7)"
    else:
        temp[1] = -0.5
        want = f"{op_name}: temperature[1] = -0.5 must be >= 0"
    sm = sampling_metadata() if greedy else sampling_metadata(temp)
    was_strict = eagle3_ops.errors.strict()
    eagle3_ops.set_strict(False)
    try:
        try:  # start from a clear word (a test before may have left a record)
            eagle3_ops.check_errors()
        except Eagle3InputError:
            pass
        out = out_of(RejectionSampler(), meta, logits, sm)
        with pytest.raises(Eagle3InputError, match=re.escape(want)):
            eagle3_ops.check_errors()
        assert out.shape == (3, 3) and bool(((out >= -1) & (out < 1000)).all()), out  # every slot a token or -1
        eagle3_ops.set_strict(True)
        with pytest.raises(Eagle3InputError, match=re.escape(want)):
            out_of(RejectionSampler(), meta, logits, sm)
    finally:
        eagle3_ops.set_strict(was_strict)


@pytest.mark.gpu
@needs_ops
@pytest.mark.parametrize("mode", ["greedy", "random", "random+probs"])
def test_gpu_launches_per_call(mode):
    """Kernels per call on the CUDA path (the profiler's count): greedy 2 (argmax slices, walk), random 5 (the
    Philox keys' draw, row stats, walk, race, finish); the ragged layout adds none."""
    from torch.profiler import ProfilerActivity, profile

    if os.environ.get("EAGLE3_SANITIZER"):  # (bench/sanitize.sh sets it)
        pytest.skip("the profiler records no kernels under compute-sanitizer (seen on the H200 at 1246426)")
    meta, logits, probs = _batch([4, 0, 2, 4, 1, 0, 3, 4], 32000)
    sm = sampling_metadata() if mode == "greedy" else sampling_metadata(torch.ones(8, device="cuda"))
    probs = probs if mode == "random+probs" else None
    rs = RejectionSampler()
    out_of(rs, meta, logits, sm, probs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out_of(rs, meta, logits, sm, probs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name
               and "emset" not in e.name]
    assert len(kernels) == (2 if mode == "greedy" else 5), [e.name for e in kernels]


@pytest.mark.gpu
@needs_ops
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "random"])
def test_gpu_ragged_graph_replay_matches_eager(greedy):
    """The ragged fast path in one CUDA graph: new drafts, logits and cu_num_draft_tokens (the same counts
    regrouped) written in place, replayed; equal to an eager call on those values."""
    def batch(seed, counts):
        meta, logits, _ = _batch(counts, 32000, seed=seed)
        if not greedy:
            logits = torch.full_like(logits, -60.0).scatter_(1, logits.float().argmax(-1, keepdim=True), 0.0)
        return meta, logits

    counts = [4, 0, 2, 4, 1, 0, 3, 4]
    (meta, logits), (new_meta, new_logits) = batch(1, counts), batch(2, counts[::-1])
    sm = sampling_metadata() if greedy else sampling_metadata(torch.ones(8, device="cuda"))
    rs = RejectionSampler()
    graph, out = capture_graph(lambda: out_of(rs, meta, logits, sm))
    for name in ("draft_token_ids", "cu_num_draft_tokens", "target_logits_indices", "bonus_logits_indices"):
        getattr(meta, name).copy_(getattr(new_meta, name))
    logits.copy_(new_logits)
    graph.replay()
    new_meta.num_draft_tokens = counts[::-1]
    assert_equal(out, out_of(rs, new_meta, new_logits, sm))


@pytest.fixture(autouse=True)
def _cpp_ops(monkeypatch):
    """Every RejectionSampler built without kernels= takes the C++ ops here (the default) whatever the caller's
    environment says; the tests hold them to the tensor-op path."""
    monkeypatch.delenv("EAGLE3_VLLM_KERNELS", raising=False)


def test_kernels_argument(monkeypatch):
    with pytest.raises(ValueError, match="kernels must be 'auto' or 'tensor'"):
        RejectionSampler(kernels="triton")
    from eagle3_ops.compat import vllm as module

    assert RejectionSampler()._ops == module._OPS  # the default: the C++ ops where this build has their kernels
    monkeypatch.setenv("EAGLE3_VLLM_KERNELS", "tensor")
    assert RejectionSampler()._ops == ()
    monkeypatch.setenv("EAGLE3_VLLM_KERNELS", "bogus")
    with pytest.raises(ValueError, match="kernels must be 'auto' or 'tensor'"):
        RejectionSampler()
    drafts, rows, expected = GREEDY_CASES[5]
    meta, logits = case(drafts, rows)
    assert_equal(out_of(RejectionSampler(kernels="tensor"), meta, logits, sampling_metadata()),
                 torch.tensor(expected, dtype=torch.int32))


@needs_ops
@pytest.mark.parametrize("counts", [[3] * 64, [3, 0, 2, 3, 1, 3, 3, 0] * 8], ids=["uniform", "ragged"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "random"])
def test_op_path_dispatches_only_its_op(counts, greedy):
    """The C++-op path (forward's branch for CUDA tensors, here on CPU tensors through the ops' CPU kernels)
    dispatches no tensor op of its own beside the vLLM op (random: the Philox keys' empty + random_ before it):
    no cast, copy, fill or index op, each of which would be one more launch per call on CUDA. The profiler's
    top-level ops of one call; test_gpu_launches_per_call counts the kernels on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    from eagle3_ops.compat import vllm as module

    meta, logits, _ = _batch(counts, 64, device="cpu")
    sm = sampling_metadata() if greedy else sampling_metadata(torch.ones(len(counts)))
    rs = RejectionSampler()
    rs._ops = (_GREEDY_OP.default, _SAMPLING_OP.default)  # what _register() returns on a CUDA build
    want = out_of(RejectionSampler(kernels="tensor"), meta, logits, sm) if greedy else None
    got = rs._forward_op(meta, None, logits, sm).sampled_token_ids
    if greedy:
        assert_equal(got, want)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rs._forward_op(meta, None, logits, sm)
    ops = [e.name for e in prof.events() if e.cpu_parent is None]
    assert ops == (["eagle3::_vllm_rejection_greedy"] if greedy else
                   ["aten::empty", "aten::random_", "eagle3::_vllm_rejection_sampling"]), ops
    assert module._fast(sm)  # the branch forward takes for these on CUDA


class _Count(int):
    """An int subclass (an accepted count, as isinstance accepts it)."""


@pytest.mark.parametrize("counts", [[3] * 64, [0], [], (3, 1), [True, 2], [_Count(2), 1], [3, -1], [3, 2.0],
                                    [np.int64(3)], [3, "2"]], ids=str)
def test_count_check_is_the_generator(counts):
    """_non_negative_ints (the host check of num_draft_tokens on every call) answers as
    all(isinstance(n, int) and n >= 0 for n in counts) does, on the plain-int lists it shortcuts and on the rest."""
    from eagle3_ops.compat.vllm import _non_negative_ints

    assert _non_negative_ints(counts) == all(isinstance(n, int) and n >= 0 for n in counts)


@pytest.mark.gpu
@needs_ops
@pytest.mark.parametrize("counts", [[3] * 64, [4, 0, 2, 4, 1, 0, 3, 4] * 8], ids=["uniform", "ragged"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "random"])
def test_gpu_op_path_equals_the_tensor_path(counts, greedy):
    """The C++ ops (kernels="auto") and the tensor-op path before them (kernels="tensor") give the same output,
    random requests included (the same Philox keys from the same generator, no draft_probs)."""
    meta, logits, _ = _batch(counts, 163840, seed=8)
    sm = sampling_metadata() if greedy else sampling_metadata(
        torch.tensor([1.0, 0.0, 0.7, -1.0] * (len(counts) // 4), device="cuda"))
    torch.manual_seed(1)
    got = out_of(RejectionSampler(), meta, logits, sm)
    torch.manual_seed(1)
    assert_equal(got, out_of(RejectionSampler(kernels="tensor"), meta, logits, sm))
