"""The decode loop: greedy speculative output is token-identical to plain greedy output (chain and
tree, batch 1 and more), on synthesised tiny models and on the shipped trained pair's held-out
prompts; sampled speculative decoding keeps the target's distribution."""

from __future__ import annotations

import os

import pytest
import torch

from eagle3_ops.engine import SpecConfig, generate_plain, generate_speculative
from eagle3_ops.models.config import DrafterConfig, TargetConfig

ASSETS = os.path.join(os.path.dirname(__file__), os.pardir, "eagle3_ops", "assets", "byte-small")
HAVE_PAIR = os.path.exists(os.path.join(ASSETS, "drafter", "model.safetensors"))

# chain as Kimi deployments run it; a tree with topk 2; a wide shallow tree; one draft step
SETTINGS = [SpecConfig(3, 1, 4), SpecConfig(3, 2, 6), SpecConfig(2, 4, 8), SpecConfig(1, 1, 2)]
IDS = ["chain-3", "tree-3x2-6", "tree-2x4-8", "chain-1"]


@pytest.fixture(scope="module")
def tiny_pair():
    from eagle3_ops.models.drafter import Drafter
    from eagle3_ops.models.target import Target

    cfg = TargetConfig.from_preset("tiny")
    # float64: plain and speculative decoding compute the same logits with different shapes; in
    # float64 no rounding difference can flip an argmax, so any mismatch is a real bug
    target = Target.synthesize(cfg, 0, torch.float64).eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(cfg), target.model.embed_tokens, 1, torch.float64).eval()
    return target, drafter


def _oracle_tokens(target, prompts, n):
    out, _ = generate_plain(target, prompts, n)
    return out


@pytest.mark.parametrize("spec", SETTINGS, ids=IDS)
@pytest.mark.parametrize("B", [1, 3])
def test_speculative_equals_plain_tiny(tiny_pair, spec, B):
    target, drafter = tiny_pair
    g = torch.Generator().manual_seed(B)
    prompts = torch.randint(0, target.cfg.vocab_size, (B, 11), generator=g)
    plain, _ = generate_plain(target, prompts, 24)
    fast, stats = generate_speculative(target, drafter, prompts, 24, spec)
    assert torch.equal(plain, fast), f"first mismatch at {(plain != fast).nonzero()[0].tolist()}"
    assert sum(stats.accept_hist) > 0 and stats.accept_hist[0] == 0  # every verify step emits >= 1 token
    assert 1.0 <= stats.acceptance_length <= spec.num_tokens


def test_page_size_one_and_odd_lengths(tiny_pair):
    """SGLang's token-level layout (page size 1) and a prompt of one token."""
    target, drafter = tiny_pair
    prompts = torch.tensor([[5]])
    plain, _ = generate_plain(target, prompts, 9, page_size=1)
    fast, _ = generate_speculative(target, drafter, prompts, 9, SpecConfig(3, 2, 5), page_size=1)
    assert torch.equal(plain, fast)


def test_miswired_aux_ids_still_lossless(tiny_pair):
    """A wrong capture only lowers acceptance: the output stays the target's."""
    target, drafter = tiny_pair
    prompts = torch.randint(0, target.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    plain, _ = generate_plain(target, prompts, 16)
    fast, _ = generate_speculative(target, drafter, prompts, 16, SpecConfig(3, 1, 4), aux_ids=[-1, 0, 1])
    assert torch.equal(plain, fast)


def test_spec_config_rejects_impossible_settings():
    with pytest.raises(ValueError, match="num_tokens"):
        SpecConfig(steps=3, topk=1, num_tokens=5)  # a chain of 3 drafts verifies at most 4 tokens
    with pytest.raises(ValueError, match="topk"):
        SpecConfig(steps=3, topk=0)


@pytest.mark.skipif(not HAVE_PAIR, reason="the shipped pair is not built yet")
@pytest.mark.parametrize("spec", [SpecConfig(3, 1, 4), SpecConfig(3, 2, 6)], ids=["chain", "tree"])
@pytest.mark.parametrize("B", [1, 4])
def test_shipped_pair_lossless_on_heldout(spec, B):
    """20 held-out prompts: greedy speculative == plain greedy, token for token."""
    from eagle3_ops import data
    from eagle3_ops.cli import _load_pair

    target, drafter, _ = _load_pair("byte-small", "cpu", torch.float64)
    prompts = [data.encode(p) for p in data.load_heldout_prompts()[:20]]
    n = min(len(p) for p in prompts)
    prompts = torch.stack([p[-n:] for p in prompts])
    for i in range(0, 20, B):
        batch = prompts[i:i + B]
        plain, _ = generate_plain(target, batch, 32)
        fast, stats = generate_speculative(target, drafter, batch, 32, spec)
        assert torch.equal(plain, fast), f"prompts {i}..{i + B - 1}: mismatch at {(plain != fast).nonzero()[0].tolist()}"


@pytest.fixture(scope="module")
def byte_pair():
    if not HAVE_PAIR:
        pytest.skip("the shipped pair is not built yet")
    from eagle3_ops.cli import _load_pair

    target, drafter, _ = _load_pair("byte-small", "cpu", torch.float64)
    return target, drafter


@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_sampled_speculative_keeps_the_target_distribution(request, which):
    """Temperature 1: the second generated token (the first one that verification decides: an accepted
    draft or a resampled bonus) follows the target's exact marginal, sum_t1 p(t1) p(t2 | t1), over
    many independently seeded requests; chi-square with merged sparse bins, about p > 0.001. On the
    synthesised pair drafts are mostly rejected (residual resampling); the shipped pair's are mostly
    accepted (the accept test)."""
    target, drafter = request.getfixturevalue("tiny_pair" if which == "tiny" else "byte_pair")
    V, n, T0 = target.cfg.vocab_size, 600, 6
    if which == "tiny":
        prompt = torch.randint(0, V, (1, T0), generator=torch.Generator().manual_seed(3))
    else:  # a prompt whose next two bytes are uncertain (a new function's name): 19 well-filled bins
        from eagle3_ops import data

        prompt = data.encode(b"\n\ndef ")[None]
    with torch.no_grad():
        p1 = torch.softmax(target.forward_train(prompt)[0, -1], -1)
        seqs = torch.cat([prompt.expand(V, T0), torch.arange(V)[:, None]], 1)
        p2 = (p1[:, None] * torch.softmax(target.forward_train(seqs)[:, -1], -1)).sum(0)
    # a tree, so that sibling rejection and residual resampling are exercised
    out, stats = generate_speculative(target, drafter, prompt.expand(n, T0).contiguous(), 2,
                                      SpecConfig(2, 2, 4, temperature=1.0, seed=11))
    counts = torch.bincount(out[:, 1], minlength=V).double()
    expected = n * p2.double()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    df = int(big.sum())
    assert chi2 < df + 3.1 * (2 * df) ** 0.5, f"chi2 {chi2:.1f} with {df} degrees of freedom"
    assert sum(stats.accept_hist) > 0


@pytest.mark.parametrize("K", [1, 2, 4])
def test_top_logprobs_match_log_softmax_topk(K):
    # the drafting's beam scores: top-k of the logits less their logsumexp, as log_softmax then topk gives
    from eagle3_ops.engine.fused import top_logprobs as _top_logprobs

    x = torch.randn(3, 5, 1000, generator=torch.Generator().manual_seed(K)) * 4
    lp, ids = _top_logprobs(x.to(torch.bfloat16), K)
    ref_lp, ref_ids = torch.log_softmax(x.to(torch.bfloat16).float(), -1).topk(K, dim=-1)
    assert lp.dtype == torch.float32 and lp.shape == (3, 5, K) and torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6)
