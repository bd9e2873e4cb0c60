"""vLLM-compatible entry point: vLLM v1's ``RejectionSampler`` (vllm/v1/sample/rejection_sampler.py) with the
same call, the same inputs and the same output, on our verify kernels, so a vLLM model runner can build it
instead (``from eagle3_ops.compat.vllm import RejectionSampler``).

``RejectionSampler(sampler).forward(metadata, draft_probs, logits, sampling_metadata)`` takes what vLLM's
GPU model runner passes:

* ``metadata``, a ``SpecDecodeMetadata`` (or any object with its fields): ``draft_token_ids [num_tokens]``
  int32 (the drafts of all requests back to back), ``num_draft_tokens`` (a host list, one count per
  request, 0 allowed), ``cu_num_draft_tokens [batch_size]`` (inclusive cumulative sum, on the device),
  ``max_spec_len``, ``target_logits_indices [num_tokens]`` and ``bonus_logits_indices [batch_size]``.
* ``draft_probs [num_tokens, vocab_size]`` (the distribution each draft was sampled from) or None (ngram,
  or EAGLE proposing by argmax): a draft is then treated as proposed with probability 1.
* ``logits [num_tokens + batch_size, vocab_size]``: the target's logits at every sampled position, in the
  order ``_calc_spec_decode_metadata`` lays them out (per request its draft rows, then its bonus row).
* ``sampling_metadata``, a ``SamplingMetadata``: ``all_greedy``, ``all_random``, ``temperature [batch_size]``
  fp32 (0 = greedy, vLLM's GREEDY_TEMPERATURE; -1, its value in older releases, too), ``top_k`` / ``top_p`` (None or ``[batch_size]``),
  ``allowed_token_ids_mask`` (None or ``[batch_size, vocab_size]`` bool, True = not allowed) and
  ``generators`` (request index -> torch.Generator for seeded requests).

It returns a ``SamplerOutput`` whose ``sampled_token_ids [batch_size, max_spec_len + 1]`` int32 holds, per
request, the accepted drafts, then one more token (the recovered token sampled from the residual at the first
rejection, or the bonus token when every draft was accepted), then PLACEHOLDER_TOKEN_ID (-1).

How it maps onto our ops. A vLLM draft is a chain: node 0 is the last verified token, node i + 1 the i-th
draft (parent i), and the logits row of node c predicts node c + 1, so the rows of one request (its draft rows
then its bonus row) are our nodes 0..n in order.

On CUDA tensors (without ``allowed_token_ids_mask``, ``top_k`` and ``top_p``) a call is ONE C++ op on vLLM's own
tensors: ``torch.ops.eagle3._vllm_rejection_greedy`` (all greedy: our verify_greedy's two kernels) or
``_vllm_rejection_sampling`` (our verify_sampling's four), which read the drafts through ``cu_num_draft_tokens``
and the logits rows through ``target_logits_indices`` / ``bonus_logits_indices`` in place (ragged batches
included: no row is copied), take the sampler's bonus tokens when a sampler is given (its bonus rows are then
not read), check every shape, dtype and device in C++ (the messages below, naming vLLM's fields) and write
vLLM's ``[batch_size, max_spec_len + 1]`` int32 output directly. Launches per call: 2 (greedy), 5 (random: the
Philox keys' draw, then 4), plus one per seeded generator and the sampler's own. The values only the data shows
(``cu_num_draft_tokens`` non-decreasing by at most max_spec_len and ending at num_tokens - not against the host's
``num_draft_tokens``, which would take a sync -, the logits indices in [0, logits rows), negative temperatures
other than vLLM's -1) are checked on the device into eagle3_ops' error word (eagle3_ops.check_errors() / strict mode
raise them, naming the op and the argument); a request with a bad ``cu_num_draft_tokens`` entry is taken as
having no drafts, a bad row index reads row 0 (greedy: that row's argmax is token 0). The sampler (when given)
and the Philox keys' draw run before the op's checks, so a call refused there may have advanced the
generators; the CPU path checks everything first. No host sync; fixed shapes for fixed ``num_draft_tokens``; the
greedy and the unseeded random path can be captured in a CUDA graph.

Elsewhere (CPU tensors, or the mask / top-k / top-p on CUDA) the rows go to the native ops in their ``[B * N, V]``
layout, N = max_spec_len + 1: with every request at max_spec_len drafts (EAGLE's case) vLLM's ``logits`` *is*
that layout and goes to the op uncopied; with ragged drafts (ngram, chunked prefill, a request at 0 drafts) the
rows are gathered once into the padded layout (one row copy per padded node); a padded node carries token -1
below the request's last draft, so it is never accepted and leaves the residual as it is. The two ops' CPU
implementations are this path (the reference the CUDA kernels are tested against).

All-greedy batches run ``verify_greedy``; any random request runs ``verify_sampling`` for the whole batch
(temperature 0 rows are greedy there). The bonus token: with a vLLM ``Sampler`` given to the constructor it is
the sampler's token for the bonus rows, called as vLLM calls it (so its logits processors apply to it); with
``sampler=None`` it is our op's own draw from the bonus row (temperature, top-k, top-p and the allowed-token
mask applied), one pass fewer.

Randomness: what is equal and what is bit-identical.

* Greedy requests: bit-identical to vLLM (accepted while the draft equals the argmax; at the first mismatch
  the argmax, else the bonus). vLLM takes the argmax of fp32 probabilities and we take it of the logits, which
  can differ only for two fp32 logits within a rounding of exp of each other.
* Random requests: equal in distribution, not bit-identical. vLLM draws one uniform per draft from torch's
  generator and one exponential vector per request for the recovered token; we use our counter-based Philox
  draws (eagle3_ops._philox) keyed by a 63-bit seed drawn per call from the request's generator (seeded
  requests, so they are reproducible and advance their generator as vLLM's draws do) or from the device's
  default generator, offset 0. The accept rule is the same (vLLM accepts when p / q >= u, we when u * q < p;
  they differ only on a null set), the recovered token is a draw from normalize(max(p - q, 0)) (without
  draft_probs, from p with the draft's probability removed) on both sides, and the bonus from p.
* The CUDA op and the tensor-op path draw the same Philox numbers (the padded chain's rows), so they give the
  same tokens, except that with draft_probs a request that accepted every draft takes its bonus draw without
  the tensor path's residual pass over the padded node (a renormalisation by a mass within rounding of 1),
  which can move that one draw where two scores are within rounding of each other.
* One documented difference: a draft whose own draft probability is 0 (impossible when it was drawn from
  draft_probs) is always rejected by vLLM and accepted with probability min(1, p / q) = 1 here.
* Draft ids outside [0, vocab_size) are never accepted (vLLM would read past the row).

Not supported (refused with NotImplementedError naming the field, before anything runs): penalties
(``no_penalties`` False), ``bad_words_token_ids``, logprobs (``max_num_logprobs`` not None), min_tokens (a
``MinTokensLogitsProcessor`` in ``logitsprocs`` with requests below their minimum: the one non-argmax-invariant
processor vLLM's forward applies to draft rows), a thinking-token budget (``thinking_budget_state_holder``
tracking requests), and ``spec_config.rejection_sample_method`` "fly" or "synthetic" (at construction); use
vLLM's own sampler for those requests. vLLM's module-level helpers (``sample_recovered_tokens``,
``generate_uniform_probs``: its torch-generator draws) are not offered. Shapes, dtypes and devices are checked
first (ValueError / TypeError naming vLLM's field); on CPU tensors the values that only the data shows
(cu_num_draft_tokens against num_draft_tokens, the logits indices, negative temperatures) are checked too,
raising eagle3_ops.Eagle3InputError; on CUDA the fast path's kernels check them into the error word (above),
the tensor-op path trusts them (reading them is a host sync). Nothing the caller passed is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from .. import _validate
from ..errors import Eagle3InputError, check_float, check_range, input_error

__all__ = ["PLACEHOLDER_TOKEN_ID", "GREEDY_TEMPERATURE", "MAX_SPEC_LEN", "RejectionSampler", "SamplerOutput"]

PLACEHOLDER_TOKEN_ID = -1  # vLLM's id for the slots after a request's last emitted token
GREEDY_TEMPERATURE = 0  # vLLM's temperature of a greedy request inside a mixed batch
_OLD_GREEDY_TEMPERATURE = -1.0  # the same placeholder in vLLM releases before it became 0: read as 0 too
MAX_SPEC_LEN = 128  # vLLM's bound on drafts per request per step
_OP = "RejectionSampler"
_INDEX = (torch.int32, torch.int64)
_PLAIN_INT = {int}
_REFUSED_METHODS = {"fly": "FLy verification", "synthetic": "synthetic acceptance"}  # their accept rules are not ours


@dataclass
class SamplerOutput:
    """vLLM's SamplerOutput fields: sampled_token_ids [batch_size, max_spec_len + 1] int32, -1 padded."""

    sampled_token_ids: Tensor
    logprobs_tensors: Optional[Any] = None


@dataclass
class _Batch:
    B: int
    K: int  # max_spec_len
    T: int  # num_tokens (drafts in all)
    V: int
    uniform: bool  # every request at K drafts
    canonical: bool  # logits has the T + B rows of _calc_spec_decode_metadata, taken as they are


def _unsupported(sm) -> None:
    """What vLLM's forward applies to the target logits and we do not (NotImplementedError naming the field)."""
    if getattr(sm, "no_penalties", True) is False:
        raise NotImplementedError("sampling_metadata.no_penalties is False: penalties are not supported by "
                                  "eagle3_ops.compat.vllm (use vLLM's RejectionSampler for such batches)")
    if getattr(sm, "bad_words_token_ids", None):
        raise NotImplementedError("sampling_metadata.bad_words_token_ids is not empty: bad words are not supported "
                                  "by eagle3_ops.compat.vllm")
    if getattr(sm, "max_num_logprobs", None) is not None:
        raise NotImplementedError("sampling_metadata.max_num_logprobs is set: logprobs are not supported by "
                                  "eagle3_ops.compat.vllm (pass max_num_logprobs=None)")
    procs = getattr(getattr(sm, "logitsprocs", None), "non_argmax_invariant", ())
    # vLLM applies only MinTokensLogitsProcessor of these to the draft rows, and it acts only with min_toks entries
    if any(type(p).__name__ == "MinTokensLogitsProcessor" and getattr(p, "min_toks", None) for p in procs):
        raise NotImplementedError("sampling_metadata.logitsprocs has a MinTokensLogitsProcessor with requests below "
                                  "their min_tokens: min_tokens is not supported by eagle3_ops.compat.vllm")
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        raise NotImplementedError("sampling_metadata.thinking_budget_state_holder tracks requests: the thinking-token "
                                  "budget is not supported by eagle3_ops.compat.vllm")


def _check(metadata, draft_probs, logits, sm) -> _Batch:
    """Shapes, dtypes, devices of every argument (never values, except on CPU tensors); returns the sizes."""
    _validate.tensor(logits, "logits", dtypes=_validate.FLOATS, dim=2, last_contiguous=True)
    like = dict(like=logits, like_name="logits")
    counts = metadata.num_draft_tokens
    if isinstance(counts, Tensor) or not _non_negative_ints(counts) or len(counts) == 0:
        raise TypeError("metadata.num_draft_tokens must be a non-empty host list of non-negative ints (one per request)")
    B, K, T, V = len(counts), max(counts), sum(counts), logits.shape[1]
    if getattr(metadata, "max_spec_len", K) != K:
        raise ValueError(f"metadata.max_spec_len must be max(num_draft_tokens) = {K}, got {metadata.max_spec_len}")
    if K > MAX_SPEC_LEN:
        raise ValueError(f"metadata.max_spec_len must be <= MAX_SPEC_LEN = {MAX_SPEC_LEN}, got {K}")
    if V == 0:
        raise ValueError("logits must have vocab_size >= 1")
    _validate.tensor(metadata.draft_token_ids, "metadata.draft_token_ids", dtypes=_INDEX,
                     shape=(("num_tokens", T),), contiguous=True, **like)
    _validate.tensor(metadata.cu_num_draft_tokens, "metadata.cu_num_draft_tokens", dtypes=_INDEX,
                     shape=(("batch_size", B),), contiguous=True, **like)
    _validate.tensor(metadata.target_logits_indices, "metadata.target_logits_indices", dtypes=_INDEX,
                     shape=(("num_tokens", T),))
    bonus_idx = metadata.bonus_logits_indices
    _validate.tensor(bonus_idx, "metadata.bonus_logits_indices", dtypes=_INDEX, dim=1)
    for name in ("target_logits_indices", "bonus_logits_indices"):  # host indices are allowed, as logits[idx] is
        dev = getattr(metadata, name).device
        if dev not in (logits.device, torch.device("cpu")):
            raise ValueError(f"metadata.{name} must be on logits' device ({logits.device}) or the CPU, got {dev}")
    if bonus_idx.shape[0] not in (0, B):
        raise ValueError(f"metadata.bonus_logits_indices must have shape (batch_size) = ({B}) (or (0) when the "
                         f"sampler's bonus tokens do not come from logits), got {tuple(bonus_idx.shape)}")
    if draft_probs is not None:
        _validate.tensor(draft_probs, "draft_probs", dtypes=_validate.FLOATS,
                         shape=(("num_tokens", T), ("vocab_size", V)), last_contiguous=True, **like)
    if not sm.all_greedy:
        _validate.tensor(sm.temperature, "sampling_metadata.temperature", dtypes=(torch.float32,),
                         shape=(("batch_size", B),), contiguous=True, **like)
    if sm.top_k is not None:
        _validate.tensor(sm.top_k, "sampling_metadata.top_k", dtypes=_INDEX, shape=(("batch_size", B),), **like)
    if sm.top_p is not None:
        _validate.tensor(sm.top_p, "sampling_metadata.top_p", dtypes=_validate.FLOATS[:3], shape=(("batch_size", B),),
                         **like)
    mask = getattr(sm, "allowed_token_ids_mask", None)
    if mask is not None:
        _validate.tensor(mask, "sampling_metadata.allowed_token_ids_mask", dtypes=(torch.bool,),
                         shape=(("batch_size", B), ("vocab_size", V)), **like)
    for i in sm.generators:
        if not 0 <= i < B:
            raise ValueError(f"sampling_metadata.generators has request index {i}, valid: 0..{B - 1}")
    _unsupported(sm)
    uniform = all(n == K for n in counts)
    canonical = uniform and logits.shape[0] == T + B and bonus_idx.shape[0] == B
    if logits.device.type == "cpu":
        _check_values(metadata, logits, sm, B, K, T, canonical)
    return _Batch(B, K, T, V, uniform, canonical)


def _check_values(metadata, logits, sm, B, K, T, canonical) -> None:
    """CPU only (free there): what only the data shows."""
    want = torch.tensor(metadata.num_draft_tokens).cumsum(0)
    got = metadata.cu_num_draft_tokens.long()
    if not torch.equal(got, want):
        b = int((got != want).nonzero()[0, 0])
        raise input_error(_OP, "metadata.cu_num_draft_tokens", (b,), int(got[b]), int(want[b]), int(want[b]))
    rows = logits.shape[0] - 1
    check_range(metadata.target_logits_indices, 0, rows, _OP, "metadata.target_logits_indices")
    check_range(metadata.bonus_logits_indices, 0, rows, _OP, "metadata.bonus_logits_indices")
    if canonical:  # taken as _calc_spec_decode_metadata's layout without reading them on CUDA: say so here
        node = torch.arange(B * (K + 1)).view(B, K + 1)
        lay = dict(target=node[:, :K].reshape(-1), bonus=node[:, K])
        for name, want_idx in lay.items():
            idx = getattr(metadata, f"{name}_logits_indices").long()
            if not torch.equal(idx, want_idx):
                j = int((idx != want_idx).nonzero()[0, 0])
                raise Eagle3InputError(
                    f"{_OP}: metadata.{name}_logits_indices[{j}] = {int(idx[j])}, expected {int(want_idx[j])}: with "
                    "every request at max_spec_len drafts and num_tokens + batch_size logits rows, the rows must be "
                    "in _calc_spec_decode_metadata's order (per request its drafts, then its bonus row)")
    if not sm.all_greedy:
        temp = torch.where(sm.temperature == _OLD_GREEDY_TEMPERATURE, 0.0, sm.temperature)
        check_float(temp, _OP, "sampling_metadata.temperature", nonnegative=True)


def _layout(metadata, logits, draft_probs, s: _Batch, root: Tensor):
    """vLLM's ragged rows -> our padded [B, N] chain (root: the [B, 1] int64 column of -1 that heads it).
    Returns (tokens, op_logits, op_draft_probs, n)."""
    B, K, T = s.B, s.K, s.T
    N = K + 1
    dev = logits.device
    if s.uniform:  # the eager path's launches counted: one (the tokens), plus the draft rows' when given
        n = None  # every request at K drafts
        drafts = metadata.draft_token_ids.view(B, K)
        # the drafts' rows, read only by a gather (draft rows given, or logits not in the canonical layout)
        src = torch.arange(B * K, device=dev).view(B, K) if draft_probs is not None or not s.canonical else None
        valid = None
    else:
        col = torch.arange(K, device=dev)
        cu = metadata.cu_num_draft_tokens.long()
        n = torch.diff(cu, prepend=cu.new_zeros(1))  # drafts per request
        start = cu - n
        valid = col[None, :] < n[:, None]  # [B, K]
        src = (start[:, None] + col[None, :]).clamp(max=max(T - 1, 0))
        drafts = metadata.draft_token_ids[src].masked_fill(~valid, -1)  # K >= 1 here, so T >= 1
    tokens = torch.cat([root, drafts], dim=1)  # int64 (the drafts int32 or int64), one launch
    if s.canonical:
        op_logits = logits
    else:
        op_logits = logits.index_select(0, _rows(metadata, s, n, src, valid).view(-1))
    op_q = None
    if draft_probs is not None:  # row (b, c) = the distribution node c's child was drawn from; 0 past the drafts
        keep = torch.ones(B, K, dtype=torch.bool, device=dev) if valid is None else valid
        q_src = torch.cat([src, src[:, -1:] if K else src.new_zeros(B, 1)], dim=1).clamp(min=0)
        op_q = draft_probs.index_select(0, q_src.view(-1)) if T else draft_probs.new_zeros(B * N, s.V)
        op_q.masked_fill_(~torch.cat([keep, keep.new_zeros(B, 1)], dim=1).view(-1, 1), 0)
    return tokens, op_logits, op_q, n


def _rows(metadata, s: _Batch, n, src, valid) -> Tensor:
    """The logits row of every padded node [B, N]: draft rows, then the bonus row (also under the padding)."""
    dev = src.device
    tgt = metadata.target_logits_indices.to(dev, torch.int64, non_blocking=True)
    bonus = metadata.bonus_logits_indices.to(dev, torch.int64, non_blocking=True)
    if bonus.shape[0] == 0:  # no bonus rows in logits (the sampler brings its own): a draft row stands in
        last = src[:, 0] + (s.K - 1 if n is None else (n - 1).clamp(min=0))  # s.K >= 1 here, so s.T >= 1
        bonus = tgt[last.clamp(max=s.T - 1)]
    drafts = tgt[src]
    if valid is not None:
        drafts = torch.where(valid, drafts, bonus[:, None])
    return torch.cat([drafts, bonus[:, None]], dim=1)


def _mask_logits(z: Tensor, sm, s: _Batch) -> Tensor:
    """vLLM's target-logit constraints on the padded rows: the allowed-token mask, then top-k and top-p of
    the temperature-scaled logits (temperature 1 for greedy rows, as vLLM). Returns a new tensor."""
    N = s.K + 1
    mask = getattr(sm, "allowed_token_ids_mask", None)
    if mask is not None:
        z = z.masked_fill(mask.repeat_interleave(N, dim=0), float("-inf"))
    if sm.top_k is None and sm.top_p is None:
        return z
    temp = torch.ones(s.B, device=z.device) if sm.all_greedy else torch.where(sm.temperature > 0, sm.temperature, 1.0)
    scaled = z.float() / temp.repeat_interleave(N)[:, None]
    ascending, order = scaled.sort(dim=-1)
    drop = torch.zeros_like(ascending, dtype=torch.bool)
    if sm.top_k is not None:  # keep the k largest (and their ties)
        k = sm.top_k.long().clamp(1, s.V).repeat_interleave(N)
        drop |= ascending < ascending.gather(1, (s.V - k)[:, None])
    if sm.top_p is not None:  # drop the smallest tokens while their mass stays <= 1 - p; the largest always stays
        mass = ascending.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
        p = sm.top_p.float().repeat_interleave(N)[:, None]
        low = mass <= 1 - p
        low[:, -1] = False
        drop |= low
    return z.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def _seeds(sm, counts: Sequence[int], B: int, dev, bonus_here: bool) -> Tensor:
    """One 63-bit Philox key per request: from its own generator when seeded (advancing it; skipped for a
    request with no drafts unless we sample its bonus, as vLLM skips it), else from the default generator."""
    seed = torch.empty(B, dtype=torch.int64, device=dev).random_()
    for i, g in sm.generators.items():
        if counts[i] > 0 or bonus_here:
            seed[i:i + 1].random_(generator=g)
    return seed


def _tensor_path(metadata, draft_probs, logits, sm, s: _Batch, bonus: Optional[Tensor], constants,
                 seed: Optional[Tensor] = None) -> Tensor:
    """The padded [B * N, V] layout on the native ops (module docstring); returns sampled_token_ids [B, K + 1]
    int32. bonus: the sampler's tokens or None; seed: the Philox keys (None: drawn as _seeds draws them)."""
    B, K = s.B, s.K
    if bonus is not None and K == 0:  # no drafts at all: the bonus is the whole output
        return bonus.reshape(B, 1).to(torch.int32)
    parents, offset, root = constants(B, K + 1, logits.device)
    tokens, z, q, n = _layout(metadata, logits, draft_probs, s, root)
    z = _mask_logits(z, sm, s)
    if sm.all_greedy:
        _, accept_len, emitted = torch.ops.eagle3.verify_greedy(z, tokens, parents)
    else:
        if seed is None:
            seed = _seeds(sm, metadata.num_draft_tokens, B, logits.device, bonus is None)
        temp = torch.where(sm.temperature == _OLD_GREEDY_TEMPERATURE, 0.0, sm.temperature)
        _, accept_len, emitted = torch.ops.eagle3.verify_sampling(z, q, None, tokens, parents, temp, seed, offset)
    out = emitted.to(torch.int32)  # accepted drafts, then the recovered / bonus token, then -1
    if bonus is not None:  # every draft accepted: the slot after them takes the sampler's bonus
        n_b = torch.full_like(accept_len, K) if n is None else n.to(accept_len.dtype)
        slot = (torch.arange(K + 1, device=logits.device)[None, :] == n_b[:, None]) & (accept_len == n_b)[:, None]
        out = torch.where(slot, bonus.reshape(B, 1).to(torch.int32), out)
    return out


def _fast(sm) -> bool:
    """The C++ ops take the batch: none of the target-logit constraints the tensor-op path applies."""
    return (getattr(sm, "allowed_token_ids_mask", None) is None and sm.top_k is None and sm.top_p is None)


def _non_negative_ints(counts) -> bool:
    """all(isinstance(n, int) and n >= 0 for n in counts), in C for the list of plain ints vLLM passes (a type
    scan and a min: 1.5 us against the generator's 1.85 at batch 64 on a CPU core, every call)."""
    if type(counts) is list and {*map(type, counts)} == _PLAIN_INT:
        return min(counts) >= 0
    return all(isinstance(n, int) and n >= 0 for n in counts)


def _host_sizes(metadata) -> tuple[int, int, int]:
    """(batch_size, num_tokens, max_spec_len) from the host list num_draft_tokens, checked as _check checks it."""
    counts = metadata.num_draft_tokens
    if isinstance(counts, Tensor) or not counts or not _non_negative_ints(counts):
        raise TypeError("metadata.num_draft_tokens must be a non-empty host list of non-negative ints (one per request)")
    K = max(counts)
    if getattr(metadata, "max_spec_len", K) != K:
        raise ValueError(f"metadata.max_spec_len must be max(num_draft_tokens) = {K}, got {metadata.max_spec_len}")
    if K > MAX_SPEC_LEN:
        raise ValueError(f"metadata.max_spec_len must be <= MAX_SPEC_LEN = {MAX_SPEC_LEN}, got {K}")
    return len(counts), sum(counts), K


class RejectionSampler(torch.nn.Module):
    """vLLM v1's RejectionSampler on eagle3_ops.verify_greedy / verify_sampling (module docstring: the contract).

    Constructed as vLLM's model runner constructs its own: ``RejectionSampler(sampler, speculative_config,
    device)``.

    Parameters
    ----------
    sampler : vLLM Sampler, optional
        Called on the bonus rows as vLLM's RejectionSampler calls it (``sampler(logits=..., sampling_metadata=...,
        predict_bonus_token=True)``); its ``sampled_token_ids`` fill the bonus slot. None: our op samples it.
    spec_config : vLLM SpeculativeConfig, optional
        Only ``rejection_sample_method`` is read: "standard" (vLLM's default) and any other value vLLM's v1
        RejectionSampler runs as standard ("block", which only vLLM's v2 model runner implements) are accepted;
        "fly" and "synthetic", which change the accept rule, raise NotImplementedError naming the field.
    device : torch.device, optional
        Accepted for vLLM's signature; every tensor follows ``logits``' device.
    kernels : str, keyword-only
        "auto": CUDA tensors go to the C++ ops on vLLM's layout where they apply (module docstring);
        "tensor": always the tensor-op path on the native ops (the layout adapted by torch ops around them).
        None (default): $EAGLE3_VLLM_KERNELS, else "auto" (the C++ ops passed their GPU tests on the H200 at
        95d786a and ran 1.03-1.06x the native op's time there in CUDA graphs, against 1.08-3.6x for "tensor").
    """

    def __init__(self, sampler: Optional[Any] = None, spec_config: Optional[Any] = None, device: Any = None, *,
                 kernels: Optional[str] = None):
        super().__init__()
        if kernels is None:
            kernels = os.environ.get("EAGLE3_VLLM_KERNELS", "") or "auto"
        if kernels not in ("auto", "tensor"):
            raise ValueError(f"kernels must be 'auto' or 'tensor' (the argument, else $EAGLE3_VLLM_KERNELS), "
                             f"got {kernels!r}")
        self._ops = _OPS if kernels == "auto" else ()
        method = getattr(spec_config, "rejection_sample_method", "standard")
        if method in _REFUSED_METHODS:
            raise NotImplementedError(f"spec_config.rejection_sample_method = {method!r}: "
                                      f"{_REFUSED_METHODS[method]} is not supported by eagle3_ops.compat.vllm "
                                      "(standard rejection sampling only)")
        self.sampler = sampler
        self._constant: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}

    def _constants(self, B: int, N: int, device) -> tuple[Tensor, Tensor, Tensor]:
        """The chain's parents [B, N] (-1, 0, 1, ...), a zero Philox offset [B] and the root column of tokens
        [B, 1] int64 (-1), made once per shape (not kept when made during a CUDA-graph capture: those would
        live in the graph's private pool)."""
        key = (B, N, str(device))
        if key in self._constant:
            return self._constant[key]
        parents = (torch.arange(N, dtype=torch.int32, device=device) - 1).expand(B, N).contiguous()
        made = (parents, torch.zeros(B, dtype=torch.int64, device=device),
                torch.full((B, 1), -1, dtype=torch.int64, device=device))
        if not (torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._constant[key] = made
        return made

    def forward(self, metadata, draft_probs: Optional[Tensor], logits: Tensor, sampling_metadata) -> SamplerOutput:
        """Verify every request's drafts; returns SamplerOutput(sampled_token_ids [batch_size, max_spec_len + 1]
        int32: accepted drafts, then the recovered or bonus token, then PLACEHOLDER_TOKEN_ID)."""
        sm = sampling_metadata
        if self._ops and isinstance(logits, Tensor) and logits.is_cuda and _fast(sm):
            return self._forward_op(metadata, draft_probs, logits, sm)
        s = _check(metadata, draft_probs, logits, sm)
        B = s.B
        if self.sampler is None and metadata.bonus_logits_indices.shape[0] != B:
            raise ValueError(f"metadata.bonus_logits_indices must have shape (batch_size) = ({B}) with sampler=None: "
                             "the bonus token is then sampled from the bonus rows of logits")
        bonus = None
        if self.sampler is not None:
            out = self.sampler(logits=logits[metadata.bonus_logits_indices], sampling_metadata=sm,
                               predict_bonus_token=True)
            bonus = out.sampled_token_ids
            _validate.tensor(bonus, "sampler(...).sampled_token_ids", dtypes=_INDEX, like=logits, like_name="logits")
            if bonus.numel() != B:
                raise ValueError(f"sampler(...).sampled_token_ids must have batch_size = {B} entries, got shape "
                                 f"{tuple(bonus.shape)}")
        return SamplerOutput(_tensor_path(metadata, draft_probs, logits, sm, s, bonus, self._constants))

    def _forward_op(self, metadata, draft_probs, logits, sm) -> SamplerOutput:
        """CUDA: one C++ op on vLLM's tensors (module docstring); only the host-side checks here (the op checks the
        tensors)."""
        B, T, K = _host_sizes(metadata)
        _unsupported(sm)
        for i in sm.generators:
            if not 0 <= i < B:
                raise ValueError(f"sampling_metadata.generators has request index {i}, valid: 0..{B - 1}")
        dev = logits.device
        target, bonus_idx = metadata.target_logits_indices, metadata.bonus_logits_indices
        if not isinstance(target, Tensor) or not isinstance(bonus_idx, Tensor):
            raise TypeError("metadata.target_logits_indices and metadata.bonus_logits_indices must be Tensors")
        t_dev, b_dev = target.device, bonus_idx.device
        for name, idx_dev in (("target_logits_indices", t_dev), ("bonus_logits_indices", b_dev)):
            if idx_dev != dev and idx_dev.type != "cpu":
                raise ValueError(f"metadata.{name} must be on logits' device ({dev}) or the CPU, got {idx_dev}")
        if t_dev != dev:  # host indices are allowed, as logits[idx] allows them (vLLM's tests): one copy each
            target = target.to(dev, non_blocking=True)
        if b_dev != dev:
            bonus_idx = bonus_idx.to(dev, non_blocking=True)
        bonus = None
        if self.sampler is not None:
            bonus = self.sampler(logits=logits[bonus_idx], sampling_metadata=sm,
                                 predict_bonus_token=True).sampled_token_ids
        elif bonus_idx.shape[0] != B:
            raise ValueError(f"metadata.bonus_logits_indices must have shape (batch_size) = ({B}) with sampler=None: "
                             "the bonus token is then sampled from the bonus rows of logits")
        if sm.all_greedy:
            out = self._ops[0](logits, metadata.draft_token_ids, metadata.cu_num_draft_tokens, target, bonus_idx,
                               bonus, B, T, K)
        else:
            temp = sm.temperature
            if not isinstance(temp, Tensor):
                raise TypeError(f"sampling_metadata.temperature must be a Tensor, got {type(temp).__name__}")
            if temp.device == dev:  # the op checks it; the keys' device follows it
                seed = _seeds(sm, metadata.num_draft_tokens, B, dev, bonus is None)
            else:
                seed = torch.zeros(B, dtype=torch.int64, device=dev)  # refused by the op's check of temperature
            out = self._ops[1](logits, draft_probs, metadata.draft_token_ids, metadata.cu_num_draft_tokens, target,
                               bonus_idx, bonus, temp, seed, B, T, K)
        return SamplerOutput(out)

    @staticmethod
    def parse_output(output_token_ids: Tensor, vocab_size: int, discard_req_indices: Sequence[int] = (),
                     logprobs_tensors: Optional[Any] = None, *,
                     return_cu_num_tokens: bool = False) -> tuple[list[list[int]], Optional[Any]]:
        """vLLM's parse_output (host side, one copy): per request the tokens that are not PLACEHOLDER_TOKEN_ID
        and are < vocab_size; rows in discard_req_indices empty.

        The second value is vLLM 0.33.0's: with ``logprobs_tensors`` (a vLLM LogprobsTensors, as GPUModelRunner
        passes it) its rows of the valid tokens, ``logprobs_tensors.filter(valid.flatten()).tolists(cu)`` with
        cu the cumulative valid counts [0, ...] before discarding; else None. Older vLLM releases asked for cu
        itself with ``return_cu_num_tokens=True`` (keyword-only here: their fourth argument is now
        logprobs_tensors)."""
        if isinstance(logprobs_tensors, bool):
            raise TypeError("logprobs_tensors must be a vLLM LogprobsTensors or None, got a bool (older vLLM's "
                            "return_cu_num_tokens is keyword-only here)")
        rows = output_token_ids.cpu()
        valid = (rows != PLACEHOLDER_TOKEN_ID) & (rows < vocab_size)
        second = None
        if logprobs_tensors is not None or return_cu_num_tokens:
            second = [0] + valid.sum(dim=1).cumsum(0).tolist()  # cu, counted before discarding (as vLLM)
        if logprobs_tensors is not None:
            second = logprobs_tensors.filter(valid.flatten()).tolists(second)
        valid[list(discard_req_indices)] = False
        return [row[keep].tolist() for row, keep in zip(rows, valid)], second


# ---- the two internal ops (torch.ops.eagle3._vllm_rejection_*, csrc/registration.cpp): their CPU implementation
# (the tensor-op path above, the reference of the CUDA kernels) and fake (shapes only), registered here -------------


def _op_batch(logits, draft_token_ids, cu_num_draft_tokens, bonus_logits_indices, batch_size, num_tokens,
              max_spec_len):
    """The metadata the tensor-op path reads, rebuilt from the op's arguments (CPU: the counts from cu)."""
    cu = cu_num_draft_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1)).tolist() if cu.numel() == batch_size else [0] * batch_size
    return SimpleNamespace(draft_token_ids=draft_token_ids, num_draft_tokens=counts, max_spec_len=max_spec_len,
                           cu_num_draft_tokens=cu_num_draft_tokens, bonus_logits_indices=bonus_logits_indices)


def _op_sizes(metadata, logits, batch_size, num_tokens, max_spec_len):
    if len(metadata.num_draft_tokens) != batch_size or sum(metadata.num_draft_tokens) != num_tokens:
        raise ValueError(f"metadata.cu_num_draft_tokens must have shape (batch_size) = ({batch_size}) and end at "
                         f"num_tokens = {num_tokens}")


def _greedy_cpu(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices, bonus_logits_indices,
                bonus_token_ids, batch_size, num_tokens, max_spec_len):
    meta = _op_batch(logits, draft_token_ids, cu_num_draft_tokens, bonus_logits_indices, batch_size, num_tokens,
                     max_spec_len)
    meta.target_logits_indices = target_logits_indices
    if bonus_token_ids is not None and bonus_logits_indices.shape[0] == 0:
        meta.bonus_logits_indices = bonus_logits_indices
    _op_sizes(meta, logits, batch_size, num_tokens, max_spec_len)
    sm = SimpleNamespace(all_greedy=True, all_random=False, temperature=None, top_k=None, top_p=None, generators={},
                         allowed_token_ids_mask=None)
    s = _check(meta, None, logits, sm)
    return _tensor_path(meta, None, logits, sm, s, bonus_token_ids, _constants_uncached)


def _sampling_cpu(logits, draft_probs, draft_token_ids, cu_num_draft_tokens, target_logits_indices,
                  bonus_logits_indices, bonus_token_ids, temperature, seed, batch_size, num_tokens, max_spec_len):
    meta = _op_batch(logits, draft_token_ids, cu_num_draft_tokens, bonus_logits_indices, batch_size, num_tokens,
                     max_spec_len)
    meta.target_logits_indices = target_logits_indices
    _op_sizes(meta, logits, batch_size, num_tokens, max_spec_len)
    sm = SimpleNamespace(all_greedy=False, all_random=False, temperature=temperature, top_k=None, top_p=None,
                         generators={}, allowed_token_ids_mask=None)
    s = _check(meta, draft_probs, logits, sm)
    _validate.tensor(seed, "seed", dtypes=(torch.int64,), shape=(("batch_size", batch_size),), like=logits,
                     like_name="logits")
    return _tensor_path(meta, draft_probs, logits, sm, s, bonus_token_ids, _constants_uncached, seed=seed)


def _constants_uncached(B: int, N: int, device):
    parents = (torch.arange(N, dtype=torch.int32, device=device) - 1).expand(B, N).contiguous()
    return (parents, torch.zeros(B, dtype=torch.int64, device=device),
            torch.full((B, 1), -1, dtype=torch.int64, device=device))


def _greedy_fake(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices, bonus_logits_indices,
                 bonus_token_ids, batch_size, num_tokens, max_spec_len):
    _fake_checks(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices, batch_size, num_tokens,
                 max_spec_len)
    return logits.new_empty((batch_size, max_spec_len + 1), dtype=torch.int32)


def _sampling_fake(logits, draft_probs, draft_token_ids, cu_num_draft_tokens, target_logits_indices,
                   bonus_logits_indices, bonus_token_ids, temperature, seed, batch_size, num_tokens, max_spec_len):
    _fake_checks(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices, batch_size, num_tokens,
                 max_spec_len)
    if draft_probs is not None:
        _validate.tensor(draft_probs, "draft_probs", dtypes=_validate.FLOATS,
                         shape=(("num_tokens", num_tokens), ("vocab_size", logits.shape[1])))
    _validate.tensor(temperature, "sampling_metadata.temperature", dtypes=(torch.float32,),
                     shape=(("batch_size", batch_size),))
    return logits.new_empty((batch_size, max_spec_len + 1), dtype=torch.int32)


def _fake_checks(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices, B, T, K):
    """Shapes and dtypes only (no values): the C++ op's checks that a fake tensor can answer."""
    _validate.tensor(logits, "logits", dtypes=_validate.FLOATS, dim=2)
    _validate.tensor(draft_token_ids, "metadata.draft_token_ids", dtypes=_INDEX, shape=(("num_tokens", T),))
    _validate.tensor(cu_num_draft_tokens, "metadata.cu_num_draft_tokens", dtypes=_INDEX, shape=(("batch_size", B),))
    _validate.tensor(target_logits_indices, "metadata.target_logits_indices", dtypes=_INDEX,
                     shape=(("num_tokens", T),))
    if not 0 <= K <= MAX_SPEC_LEN:
        raise ValueError(f"max_spec_len must be in [0, {MAX_SPEC_LEN}], got {K}")


def _register() -> tuple:
    """(greedy, sampling) overloads when this build's _C has their schemas (and their CUDA kernels: else the
    tensor-op path runs on CUDA too); their CPU and fake implementations registered once."""
    try:
        ops = (torch.ops.eagle3._vllm_rejection_greedy.default, torch.ops.eagle3._vllm_rejection_sampling.default)
    except (AttributeError, RuntimeError):  # a _C from before these schemas
        return ()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("eagle3::_vllm_rejection_greedy", "CPU"):  # once
        lib = torch.library.Library("eagle3", "IMPL")  # noqa: TOR901  (kept alive with the module)
        _LIBS.append(lib)
        for name, cpu, fake in (("_vllm_rejection_greedy", _greedy_cpu, _greedy_fake),
                                ("_vllm_rejection_sampling", _sampling_cpu, _sampling_fake)):
            lib.impl(name, cpu, "CPU")
            torch.library.register_fake(f"eagle3::{name}", fake, lib=lib)
    cuda = all(torch._C._dispatch_has_kernel_for_dispatch_key(f"eagle3::{n}", "CUDA")
               for n in ("_vllm_rejection_greedy", "_vllm_rejection_sampling"))
    return ops if cuda else ()


_LIBS: list = []
_OPS = _register()
