"""vLLM's rejection sampler entry at Kimi vocabulary (V = 163840, bf16 logits), in one run:

    compat   eagle3_ops.compat.vllm.RejectionSampler()(metadata, draft_probs, logits, sampling_metadata):
             vLLM's inputs (flat draft ids, cu_num_draft_tokens, logits rows request-major), on CUDA one C++
             op on them (torch.ops.eagle3._vllm_rejection_greedy / _sampling: the rows read in place through
             the indices, ragged batches included; 2 kernels greedy, 5 random); the bonus token from our op
             (sampler=None)
    compat-tensor  the same call with kernels="tensor": the tensor-op path (the layout adapted by torch ops,
             ragged rows gathered, then the native op), the path before those C++ ops
    eagle3   the native op alone on inputs already in our [B, N] layout (ragged shapes: the padded logits
             prepared outside the timing, B * N rows where vLLM's layout has num_tokens + B): what the compat
             layer costs is compat - eagle3
    torch    what vLLM's rejection sampler does, restated as plain vectorised PyTorch (its own kernels are
             Triton and vLLM does not load here): the target rows gathered and cast to fp32, temperature,
             an fp32 softmax of every target row, greedy argmax or the accept test p / q >= u with one
             uniform per draft, the recovered token of every position by an exponential race over the
             residual (one exponential vector per request), the first rejection found with a cumprod, the
             bonus tokens given (vLLM samples them in its Sampler, not timed here)

Shapes: B 64 x 3 drafts (EAGLE's chain at --num-speculative-tokens 3; every request at max_spec_len, so the
compat path passes vLLM's logits to the op uncopied), and the same batch ragged (drafts 3, 0, 2, 3, 1, 3, 3,
0 repeated: prefills and short ngram matches among decodes, the gathered path). Modes: all greedy; all random
at temperature 1 without draft_probs (EAGLE proposing by argmax, ngram); random with fp32 draft_probs.

Device time of CUDA-graph replays of back-to-back calls over input sets rotated past L2 (graph_time_us), and
the wall time of eager calls (bench "compat_vllm/eager"); the last case prints compat / eagle3 and
compat / torch for both (written to $EAGLE3_BENCH_OUT/compat_vllm_ratios.txt too).
Bytes: the logits read once (+ draft_probs when given). Targets (issue 22): compat within 1.2x of eagle3, and
faster than torch, at the same shape.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench_compat import print_ratios
from common import eager_time_us, graph_time_us, rotation

import eagle3_ops  # noqa: F401
from eagle3_ops.compat.vllm import PLACEHOLDER_TOKEN_ID, RejectionSampler

V = 163840
B = 64
SHAPES = {"uniform": [3] * B, "ragged": [3, 0, 2, 3, 1, 3, 3, 0] * (B // 8)}
MODES = ["greedy", "random", "random+probs"]


def vllm_inputs(counts, mode, g):
    """One input set as vLLM's model runner hands it over (_calc_spec_decode_metadata's layout), on CUDA."""
    n = torch.tensor(counts)
    T, K = int(n.sum()), int(n.max())
    first = torch.cumsum(n + 1, 0) - (n + 1)
    target = torch.cat([f + torch.arange(k) for f, k in zip(first.tolist(), counts)])
    logits = (torch.randn(T + B, V, device="cuda", generator=g) * 4).to(torch.bfloat16)
    best = logits[target.to(logits.device)].float().argmax(-1)
    keep = torch.rand(T, device="cuda", generator=g) < 0.7  # most drafts agree with the target: long runs
    drafts = torch.where(keep, best, torch.randint(0, V, (T,), device="cuda", generator=g)).to(torch.int32)
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = SimpleNamespace(draft_token_ids=drafts, num_draft_tokens=list(counts), max_spec_len=K,
                           cu_num_draft_tokens=torch.cumsum(n, 0).to(**i32), target_logits_indices=target.to(**i32),
                           bonus_logits_indices=(torch.cumsum(n + 1, 0) - 1).to(**i32))
    temperature = None if mode == "greedy" else torch.ones(B, device="cuda")
    sm = SimpleNamespace(temperature=temperature, all_greedy=mode == "greedy", all_random=mode != "greedy",
                         top_k=None, top_p=None, generators={}, allowed_token_ids_mask=None, no_penalties=True,
                         bad_words_token_ids={}, max_num_logprobs=None)
    probs = torch.softmax(torch.randn(T, V, device="cuda", generator=g), -1) if mode == "random+probs" else None
    bonus = logits[meta.bonus_logits_indices.long()].argmax(-1, keepdim=True).to(torch.int32)
    return meta, logits, probs, sm, bonus


def native_inputs(meta, logits, probs, sm):
    """The same step in our [B, N] layout, built once outside the timing (the padded chain of the compat path)."""
    K = meta.max_spec_len
    N = K + 1
    rows = meta.bonus_logits_indices.long()[:, None].repeat(1, N)
    tokens = torch.full((B, N), -1, dtype=torch.int64, device="cuda")
    q = None if probs is None else torch.zeros(B * N, V, device="cuda")
    i = 0
    for b, n in enumerate(meta.num_draft_tokens):
        rows[b, :n] = meta.target_logits_indices[i:i + n].long()
        tokens[b, 1:n + 1] = meta.draft_token_ids[i:i + n].long()
        if q is not None:
            q[b * N:b * N + n] = probs[i:i + n]
        i += n
    z = logits if all(n == K for n in meta.num_draft_tokens) else logits[rows.view(-1)]
    parents = (torch.arange(N, dtype=torch.int32, device="cuda") - 1).repeat(B, 1)
    seed = torch.arange(B, device="cuda")
    return z, q, tokens, parents, sm.temperature, seed, torch.zeros(B, dtype=torch.int64, device="cuda")


def torch_rejection(meta, logits, probs, sm, bonus):
    """vLLM's rejection sampling as plain PyTorch (module docstring); returns [B, max_spec_len + 1] int32."""
    K, dev = meta.max_spec_len, logits.device
    T = meta.draft_token_ids.shape[0]
    n = torch.diff(meta.cu_num_draft_tokens.long(), prepend=torch.zeros(1, dtype=torch.long, device=dev))
    req = torch.repeat_interleave(torch.arange(B, device=dev), n, output_size=T)  # request of each draft
    pos = torch.arange(T, device=dev) - (meta.cu_num_draft_tokens.long() - n)[req]
    z = logits[meta.target_logits_indices.long()].float()
    draft = meta.draft_token_ids.long()
    if sm.all_greedy:
        tok = z.softmax(-1).argmax(-1)
        hit = tok == draft
    else:
        p = (z / sm.temperature[req][:, None]).softmax(-1)
        px = p.gather(1, draft[:, None]).squeeze(1)
        qx = 1.0 if probs is None else probs.gather(1, draft[:, None]).squeeze(1)
        hit = px / qx >= torch.rand(T, dtype=torch.float64, device=dev)
        residual = p.scatter(1, draft[:, None], 0.0) if probs is None else (p - probs).clamp_min(0)
        tok = (residual / torch.empty(B, V, device=dev).exponential_()[req]).argmax(-1)
    grid = torch.zeros(B, K, dtype=torch.bool, device=dev)
    grid[req, pos] = hit
    accepted = torch.cumprod(grid.int(), 1).sum(1)  # drafts accepted before the first rejection
    col = torch.arange(K + 1, device=dev)[None, :]
    drafts_pad = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=dev)
    tok_pad = drafts_pad.clone()
    drafts_pad[req, pos] = draft
    tok_pad[req, pos] = tok
    last = torch.where(accepted == n, bonus.view(-1).long(), tok_pad.gather(1, accepted[:, None]).squeeze(1))
    out = torch.where(col < accepted[:, None], drafts_pad, PLACEHOLDER_TOKEN_ID)
    return torch.where(col == accepted[:, None], last[:, None], out).to(torch.int32)


@pytest.mark.parametrize("provider", ["compat", "compat-tensor", "eagle3", "torch"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compat_vllm(benchmark, recorder, provider, mode, shape):
    if mode == "random+probs" and shape == "ragged":
        pytest.skip("one draft_probs shape is enough: the layout costs are measured without it")
    counts = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    nbytes = (sum(counts) + B) * V * 2 + (sum(counts) * V * 4 if mode == "random+probs" else 0)
    sets = [vllm_inputs(counts, mode, g) for _ in range(rotation(nbytes))]
    rs = RejectionSampler(kernels="tensor" if provider == "compat-tensor" else "auto")
    if provider.startswith("compat"):
        calls = [lambda s=s: rs(s[0], s[2], s[1], s[3]) for s in sets]
    elif provider == "eagle3":
        prepared = [native_inputs(*s[:4]) for s in sets]
        op = torch.ops.eagle3.verify_greedy if mode == "greedy" else torch.ops.eagle3.verify_sampling
        calls = [(lambda a=a: op(a[0], a[2], a[3])) if mode == "greedy" else (lambda a=a: op(a[0], a[1], None, *a[2:]))
                 for a in prepared]
    else:
        calls = [lambda s=s: torch_rejection(*s) for s in sets]
    if mode == "greedy":  # greedy is deterministic: the three providers agree exactly on the first set
        meta, logits, probs, sm, bonus = sets[0]
        want = torch_rejection(*sets[0])
        got = rs(meta, probs, logits, sm).sampled_token_ids
        assert torch.equal(got, want), "compat and the torch path disagree on a greedy batch"
    us = graph_time_us(calls)
    benchmark.pedantic(calls[0], rounds=20, warmup_rounds=3)
    host_us = benchmark.stats.stats.median * 1e6
    recorder.add("compat_vllm", f"B={B} {shape} {mode} V={V}", provider, us, nbytes, host_us=host_us)
    recorder.add("compat_vllm/eager", f"B={B} {shape} {mode} V={V}", provider, eager_time_us(calls, 40), nbytes)


@pytest.mark.parametrize("mode", MODES)
def test_kernel_breakdown(capsys, mode):
    """Where a compat call's device time goes, per kernel (torch.profiler, 10 calls on one uniform input set):
    what to work on next (the native sampling kernels with draft_probs are slower than the PyTorch path).
    kernels="auto" named, as the compat rows name it: at 95d786a this took the default, then the tensor-op
    path, and its greedy table (native verify_greedy's kernels, 3 copies) was read as the compat row's."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(0)
    meta, logits, probs, sm, _ = vllm_inputs(SHAPES["uniform"], mode, g)
    rs = RejectionSampler(kernels="auto")
    for _ in range(3):
        rs(meta, probs, logits, sm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            rs(meta, probs, logits, sm)
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total / e.count) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]  # kernels, not ops
    with capsys.disabled():
        print(f"\ncompat_vllm {mode} B={B} uniform V={V}: kernels per call, device us per launch")
        for key, count, us in sorted(rows, key=lambda r: -r[1] * r[2]):
            print(f"  {us:9.2f} us  x{count // 10:<3} {key[:110]}")


def test_zz_ratios(recorder, capsys):
    """The done-when table: compat against the native op and against vLLM's path restated in PyTorch."""
    print_ratios(recorder, capsys, {"compat_vllm": "eagle3"}, "compat_vllm_ratios", torch_of=lambda p: "torch")
