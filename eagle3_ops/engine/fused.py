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


def _expect(name: str, t: Tensor, shape: tuple, dtype: torch.dtype, like: Tensor) -> None:
    """t must have this shape and dtype, be contiguous (the kernels index it flat) and sit on like's device."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {t.device}")


def top_logprobs(logits: Tensor, K: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """The K largest log-probabilities of logits [..., V] and their ids, [..., K] each (fp32, int64), computed
    in fp32: the top-k of the logits less their logsumexp (no [..., V] log-softmax is written). The Triton
    kernels (1 <= K <= 16) put the lower id first on ties; torch's topk leaves their order unspecified."""
    if logits.dim() < 1 or not 1 <= K <= logits.shape[-1]:
        raise ValueError(f"K must be in [1, V = logits.shape[-1]], got K = {K} for logits {list(logits.shape)}")
    if _triton(logits, impl) and K <= 16:
        from eagle3_ops.triton_kernels import decode_round

        # [B, K, V] rows are read in place at any strides (the tree's drafting passes a slice of its block's rows,
        # which reshape would copy: ~21 MB a step at B 8); other ranks as [rows, V]
        lp, ids, _ = decode_round.topk_lse(logits if logits.dim() == 3 else logits.reshape(-1, logits.shape[-1]), K)
        return lp.view(*logits.shape[:-1], K), ids.view(*logits.shape[:-1], K)
    x = logits.float()
    top, ids = x.max(dim=-1, keepdim=True) if K == 1 else x.topk(K, dim=-1)
    return top - torch.logsumexp(x, dim=-1, keepdim=True), ids


def accept_update(accept_nodes: Tensor, accept_len: Tensor, emitted: Tensor, count: Tensor, out: Tensor,
                  hist: Tensor, root: Tensor, tkv_prefix: Tensor, dkv_prefix: Tensor, max_new: int,
                  rows: Tensor, tokens: Tensor, positions: Tensor, step: Tensor, impl: str = "auto") -> None:
    """A round's bookkeeping after verify and kv_accept, in place. A request is active while count < max_new;
    a finished one is frozen (nothing of it changes but its catch-up inputs).

    verify's accept_nodes [B, N] int32 (-1 padded), accept_len [B] int32 in [0, N - 1] (as verify_greedy /
    verify_sampling give it: the kernel indexes hist and emitted by it unchecked, a check needing a host sync),
    emitted [B, N] int64 are read;
    count [B] int64 += accept_len + 1 (active); out [B, L] int64 gets the emitted tokens 0..accept_len at
    count.. (active); hist [N + 1] int64 counts accept_len + 1 (active); root [B] int64 <- emitted[accept_len]
    (active); tkv_prefix [B] int32 -= accept_len + 1 (frozen: kv_accept's advance undone). Written: the
    catch-up's inputs rows [B * N] int64 (b * N + accept_nodes, -1 as 0), tokens [B, N] int64 (emitted, -1 as
    0), positions [B, N] int64 (dkv_prefix + j), and step [B] int32 (accept_len + 1, or 0 frozen)."""
    if emitted.dim() != 2:
        raise ValueError(f"emitted must be [B, N], got {list(emitted.shape)}")
    B, N = emitted.shape
    i32, i64 = torch.int32, torch.int64
    for name, t, shape, dtype in (("accept_nodes", accept_nodes, (B, N), i32), ("accept_len", accept_len, (B,), i32),
                                  ("emitted", emitted, (B, N), i64), ("count", count, (B,), i64),
                                  ("hist", hist, (N + 1,), i64), ("root", root, (B,), i64),
                                  ("tkv_prefix", tkv_prefix, (B,), i32), ("dkv_prefix", dkv_prefix, (B,), i32),
                                  ("rows", rows, (B * N,), i64), ("tokens", tokens, (B, N), i64),
                                  ("positions", positions, (B, N), i64), ("step", step, (B,), i32)):
        _expect(name, t, shape, dtype, emitted)
    if out.dim() != 2 or out.shape[0] != B or out.shape[1] < max_new + N:
        raise ValueError(f"out must be [B = {B}, >= max_new + N = {max_new + N}], got {list(out.shape)}")
    _expect("out", out, tuple(out.shape), torch.int64, emitted)
    if _triton(emitted, impl):
        from eagle3_ops.triton_kernels import decode_round

        return decode_round.accept_update(accept_nodes, accept_len, emitted, count, out, hist, root, tkv_prefix,
                                          dkv_prefix, max_new, rows, tokens, positions, step)
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
    B = step.shape[0] if step.dim() == 1 else -1
    if B < 1 or logits.dim() != 2 or hidden.dim() != 2 or logits.shape[0] % B or hidden.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [B * N, V] and hidden [B * N, H] must share their rows, B = step's length; got "
                         f"{list(logits.shape)}, {list(hidden.shape)}, step {list(step.shape)}")
    for name, t, shape, dtype in (("last_logits", last_logits, (B, logits.shape[1]), logits.dtype),
                                  ("g", g, (B, hidden.shape[1]), hidden.dtype), ("step", step, (B,), torch.int32),
                                  ("dkv_prefix", dkv_prefix, (B,), torch.int32)):
        _expect(name, t, shape, dtype, logits)
    for name, t in (("logits", logits), ("hidden", hidden)):
        if t.stride(1) != 1 or t.device != step.device:
            raise ValueError(f"{name} must be contiguous in its last dimension and on {step.device}")
    if _triton(logits, impl):
        from eagle3_ops.triton_kernels import decode_round

        return decode_round.accept_finish(logits, hidden, last_logits, g, step, dkv_prefix)
    N = logits.shape[0] // B
    active = step > 0
    row = (torch.arange(B, device=step.device) * N + (step.long() - 1).clamp(min=0))
    last_logits.copy_(torch.where(active[:, None], logits[row], last_logits))
    g.copy_(torch.where(active[:, None], hidden[row], g))
    dkv_prefix.add_(step.to(dkv_prefix.dtype))
