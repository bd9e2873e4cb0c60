"""vLLM-internal names that vLLM's test_rejection_sampler.py (in vLLM's repository, under tests/v1/sample/)
imports and that are not the rejection sampler's API: what those tests construct, rebuilt from vLLM's source
(vllm/v1/spec_decode/metadata.py, vllm/v1/sample/metadata.py, and utils.py beside that test). The rejection
sampler itself is eagle3_ops.compat.vllm's."""

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

_DEV = os.environ.get("PEER_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
current_platform = SimpleNamespace(device_type=_DEV)  # vllm.platforms.current_platform


class LogitsProcessors:
    """vllm.v1.sample.logits_processor.LogitsProcessors with no processor."""

    def __init__(self, logitsprocs=None):
        self.argmax_invariant = []
        self.non_argmax_invariant = []
        for p in logitsprocs or ():
            (self.argmax_invariant if p.is_argmax_invariant() else self.non_argmax_invariant).append(p)

    @property
    def all(self):
        return self.argmax_invariant + self.non_argmax_invariant


@dataclass
class SamplingMetadata:
    """vllm.v1.sample.metadata.SamplingMetadata's fields."""

    temperature: Optional[torch.Tensor]
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor]
    generators: dict
    max_num_logprobs: Optional[int]
    no_penalties: bool
    prompt_token_ids: Optional[torch.Tensor]
    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    output_token_ids: list
    allowed_token_ids_mask: Optional[torch.Tensor]
    bad_words_token_ids: dict
    logitsprocs: Any
    spec_token_ids: Any = field(default_factory=list)
    thinking_budget_state_holder: Any = None


class Sampler:
    """vllm.v1.sample.sampler.Sampler, as a spec for the tests' Mock (never called)."""

    logprobs_mode = "raw_logprobs"

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        raise NotImplementedError("the tests mock the sampler")


@dataclass
class SpecDecodeMetadata:
    """vllm.v1.spec_decode.metadata.SpecDecodeMetadata with make_dummy."""

    draft_token_ids: torch.Tensor
    num_draft_tokens: list
    cu_num_draft_tokens: torch.Tensor
    cu_num_sampled_tokens: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    logits_indices: torch.Tensor

    def __post_init__(self):
        self.max_spec_len = max(self.num_draft_tokens)

    @classmethod
    def make_dummy(cls, draft_token_ids, device):
        batch_size = len(draft_token_ids)
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        num_sampled_tokens = [len(ids) + 1 for ids in draft_token_ids]
        flat = sum(draft_token_ids, [])
        num_tokens = len(flat)
        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
            num_draft_tokens=num_draft_tokens,
            cu_num_draft_tokens=torch.from_numpy(np.cumsum(num_draft_tokens, dtype=np.int32)).to(device),
            cu_num_sampled_tokens=torch.from_numpy(np.cumsum(num_sampled_tokens, dtype=np.int32)).to(device),
            target_logits_indices=torch.zeros(num_tokens, dtype=torch.int32, device=device),
            bonus_logits_indices=torch.zeros(batch_size, dtype=torch.int32, device=device),
            logits_indices=torch.zeros(num_tokens + batch_size, dtype=torch.int32, device=device),
        )


def create_allowed_token_ids(batch_size, vocab_size, num_allowed_token_ids, device):
    """vLLM's test utils.py's: for even requests i, tokens [i, i + n) (capped at vocab_size - 1) masked."""
    mask = None
    for i in range(batch_size):
        if i % 2 == 1:
            continue
        if mask is None:
            mask = torch.zeros((batch_size, vocab_size), dtype=torch.bool, device=device)
        start = min(i, vocab_size - 1)
        end = min(i + num_allowed_token_ids, vocab_size - 1)
        mask[i, start:end] = True
    return mask


def sample_recovered_tokens(*args, **kwargs):
    """vLLM's module-level helper (its RNG implementation): not offered by eagle3_ops.compat.vllm."""
    raise NotImplementedError("sample_recovered_tokens is not offered by eagle3_ops.compat.vllm")
