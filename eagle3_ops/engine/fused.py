"""The decode loop's small steps between the forwards, each as one function: the PyTorch code here is the
specification (and what runs on the CPU); on CUDA tensors each runs as one or two Triton kernels
(triton_kernels/decode_round.py), which the tests hold to these references. `impl` picks: "auto" (Triton on
CUDA), "torch", or "triton" (the Triton kernels on any tensors: the tests run them on the CPU under
TRITON_INTERPRET=1)."""

from __future__ import annotations

from torch import Tensor
import torch


def _triton(x: Tensor, impl: str) -> bool:
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    return impl == "triton" or (impl == "auto" and x.is_cuda)


def top_logprobs(logits: Tensor, K: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """The K largest log-probabilities of logits [..., V] and their ids, [..., K] each (fp32, int64), computed
    in fp32: the top-k of the logits less their logsumexp (no [..., V] log-softmax is written). The Triton
    kernels (1 <= K <= 16) put the lower id first on ties; torch's topk leaves their order unspecified."""
    if _triton(logits, impl) and 1 <= K <= min(16, logits.shape[-1]):
        from eagle3_ops.triton_kernels import decode_round

        lp, ids, _ = decode_round.topk_lse(logits.reshape(-1, logits.shape[-1]), K)
        return lp.view(*logits.shape[:-1], K), ids.view(*logits.shape[:-1], K)
    x = logits.float()
    top, ids = x.max(dim=-1, keepdim=True) if K == 1 else x.topk(K, dim=-1)
    return top - torch.logsumexp(x, dim=-1, keepdim=True), ids


def accept_update(accept_nodes: Tensor, accept_len: Tensor, emitted: Tensor, count: Tensor, out: Tensor,
                  hist: Tensor, root: Tensor, tkv_prefix: Tensor, dkv_prefix: Tensor, max_new: int,
                  rows: Tensor, tokens: Tensor, positions: Tensor, step: Tensor, impl: str = "auto") -> None:
    """A round's bookkeeping after verify and kv_accept, in place. A request is active while count < max_new;
    a finished one is frozen (nothing of it changes but its catch-up inputs).

    verify's accept_nodes [B, N] int32 (-1 padded), accept_len [B] int32, emitted [B, N] int64 are read;
    count [B] int64 += accept_len + 1 (active); out [B, L] int64 gets the emitted tokens 0..accept_len at
    count.. (active); hist [N + 1] int64 counts accept_len + 1 (active); root [B] int64 <- emitted[accept_len]
    (active); tkv_prefix [B] int32 -= accept_len + 1 (frozen: kv_accept's advance undone). Written: the
    catch-up's inputs rows [B * N] int64 (b * N + accept_nodes, -1 as 0), tokens [B, N] int64 (emitted, -1 as
    0), positions [B, N] int64 (dkv_prefix + j), and step [B] int32 (accept_len + 1, or 0 frozen)."""
    if _triton(emitted, impl):
        from eagle3_ops.triton_kernels import decode_round

        return decode_round.accept_update(accept_nodes, accept_len, emitted, count, out, hist, root, tkv_prefix,
                                          dkv_prefix, max_new, rows, tokens, positions, step)
    B, N = emitted.shape
    arange = torch.arange(N, device=emitted.device)
    active = count < max_new
    al = accept_len.long()
    n = (al + 1) * active
    idx = (count[:, None] + arange).clamp(max=out.shape[1] - 1)  # frozen requests write nothing
    keep = (arange[None] <= al[:, None]) & active[:, None]
    out.scatter_(1, idx, torch.where(keep, emitted, out.gather(1, idx)))
    hist.scatter_add_(0, al + 1, active.long())  # (one_hot would read the values on the host)
    count.add_(n)
    root.copy_(torch.where(active, emitted.gather(1, al[:, None]).squeeze(1), root))
    tkv_prefix.sub_(torch.where(active, 0, accept_len + 1).to(tkv_prefix.dtype))
    rows.copy_((torch.arange(B, device=emitted.device)[:, None] * N + accept_nodes.clamp(min=0)).view(-1))
    tokens.copy_(emitted.clamp(min=0))
    positions.copy_(dkv_prefix[:, None].long() + arange)
    step.copy_(n)


def accept_finish(logits: Tensor, hidden: Tensor, last_logits: Tensor, g: Tensor, step: Tensor,
                  dkv_prefix: Tensor, impl: str = "auto") -> None:
    """After the catch-up forward (logits [B * N, V], hidden [B * N, H]): an active request (step > 0) keeps row
    b * N + step - 1 (its last accepted token's) in last_logits [B, V] and g [B, H]; dkv_prefix += step."""
    if _triton(logits, impl):
        from eagle3_ops.triton_kernels import decode_round

        return decode_round.accept_finish(logits, hidden, last_logits, g, step, dkv_prefix)
    B = step.shape[0]
    N = logits.shape[0] // B
    active = step > 0
    row = (torch.arange(B, device=step.device) * N + (step.long() - 1).clamp(min=0))
    last_logits.copy_(torch.where(active[:, None], logits[row], last_logits))
    g.copy_(torch.where(active[:, None], hidden[row], g))
    dkv_prefix.add_(step.to(dkv_prefix.dtype))
