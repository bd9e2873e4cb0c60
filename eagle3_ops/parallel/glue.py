"""The speculative step under tensor parallelism (docs/tp.md): the drafter's fc sharded by output columns, the
vocab-parallel greedy verify, and the glue object generate_speculative runs with.

Every rank runs the same loop on the same tokens: the drafter is replicated (but for the fc's weight),
build_tree and kv_accept run on each rank's own caches (every rank keeps the whole latent cache, so each
rank's kv_accept is the TP-1 call, one launch over all layers), and every rank ends a verify with the same
accepted path.

- ``TPDrafter.project`` (fc="sharded"): each rank's fc_proj over its Hd / TP output columns (1/TP of the
  weight read), then one all-gather of [T, Hd]. fc="replicated": the whole weight on every rank, no collective.
- ``TPGlue.verify_greedy`` (verify="vocab"): the verify forward's logits stay sharded [B * N, Vr]; each rank's
  argmax of its columns, one all-reduce MAX of packed (value, index) int64 (TP.argmax: the lowest index on
  ties, as torch.argmax and verify_greedy), then the tree walk on per-node flags through verify_greedy.
  verify="gathered": the [B * N, V] logits all-gathered, then verify_greedy.
- ``TPGlue.verify_sampling``: the logits gathered, then verify_sampling on every rank with the same seed and
  offset (the same draws everywhere: the same accepted path), lossless as at TP 1.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from ..models.drafter import Drafter
from .comm import TP
from .target import TPTarget

FC_MODES = ("sharded", "replicated")
VERIFY_MODES = ("vocab", "gathered")


class TPDrafter(Drafter):
    """A Drafter whose fc weight is this rank's output rows [Hd / TP, n_aux * Ht] (fc="sharded") or the whole
    weight (fc="replicated"); everything else replicated. Build it with ``tp_drafter``."""

    tp: TP
    fc_mode: str = "replicated"

    def project(self, aux: Tensor, rows: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
        """Drafter.project's value [R, Hd]: sharded, this rank's columns then one all-gather."""
        if self.fc_mode == "replicated" or self.tp.world == 1:
            return super().project(aux, rows, out)
        R = aux.shape[0] if rows is None else rows.shape[0]
        part = aux.new_empty((R, self.fc.weight.shape[0]))
        with torch.no_grad():
            torch.ops.eagle3.fc_proj(aux, self.fc.weight, None, self.fc_norm_weight(), self.cfg.rms_norm_eps,
                                     self.norm_mode, rows, part)
        full = self.tp.all_gather_cols(part)
        if out is None:
            return full
        out.copy_(full)
        return out


def tp_drafter(drafter: Drafter, tp: TP, fc: str = "sharded") -> TPDrafter:
    """drafter's weights (the target's embedding still shared) with the fc kept whole or cut to this rank's
    Hd / TP output rows."""
    if fc not in FC_MODES:
        raise ValueError(f"fc must be one of {FC_MODES}, got {fc!r}")
    cfg = drafter.cfg
    if cfg.hidden_size % tp.world:
        raise ValueError(f"the drafter's hidden_size = {cfg.hidden_size} must be a multiple of the tensor-parallel "
                         f"size {tp.world} (fc='sharded')")
    sd = dict(drafter.state_dict())
    with torch.device("meta"):
        model = TPDrafter(cfg, drafter._shared[0] if drafter._shared else None)
        if fc == "sharded":
            c = cfg.hidden_size // tp.world
            model.fc = nn.Linear(cfg.n_aux * cfg.target_hidden_size, c, bias=False)
            sd["fc.weight"] = sd["fc.weight"][tp.rank * c:(tp.rank + 1) * c].clone()
    model.load_state_dict(sd, assign=True)
    model.tp, model.fc_mode = tp, fc
    return model


class TPGlue:
    """generate_speculative's glue under TP (module docstring); build_tree and kv_accept are the TP-1 ops."""

    build_tree, kv_accept = staticmethod(ops.build_tree), staticmethod(ops.kv_accept)

    def __init__(self, tp: TP, target: TPTarget, verify: str = "vocab"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.tp, self.target, self.mode = tp, target, verify

    @staticmethod
    def project(drafter, aux, rows=None):
        return drafter.project(aux, rows)

    def _full(self, logits: Tensor) -> Tensor:
        return self.target.gather_logits(logits) if self.target.shard_logits else logits

    def verify_greedy(self, logits: Tensor, tokens: Tensor, parents: Tensor):
        """verify_greedy's outputs from the verify forward's logits (sharded inside target.sharded_logits())."""
        if not self.target.shard_logits:
            return ops.verify_greedy(logits, tokens, parents)
        if self.mode == "gathered":
            return ops.verify_greedy(self._full(logits), tokens, parents)
        pred = self.tp.argmax(logits, self.target.vocab_lo).view(tokens.shape)  # [B, N] target argmax per node
        return walk_greedy(pred, tokens, parents)

    def verify_sampling(self, logits, draft_probs, d2t, tokens, parents, temperature, seed, offset):
        return ops.verify_sampling(self._full(logits), draft_probs, d2t, tokens, parents, temperature, seed, offset)


def walk_greedy(pred: Tensor, tokens: Tensor, parents: Tensor):
    """verify_greedy's outputs from the target's argmax at each node, pred [B, N] int64: node j carries its
    parent's argmax when tokens[j] == pred[parent[j]]; verify_greedy walks [B * N, 1] zero logits over
    tokens 0 (carries) / 1 (does not), which takes, at each node, its lowest-index carrying child (the same
    path as over the real logits); the bonus is pred at the path's last node."""
    B, N = tokens.shape
    carries = (parents >= 0) & (tokens == pred.gather(1, parents.long().clamp(min=0)))
    flags = torch.where(carries, 0, 1)
    zeros = torch.zeros(B * N, 1, dtype=torch.float32, device=tokens.device)
    accept_nodes, accept_len, _ = ops.verify_greedy(zeros, flags, parents)
    nxt = torch.cat([accept_nodes[:, 1:], accept_nodes.new_full((B, 1), -1)], 1).long()  # [B, N]
    emitted = torch.where(nxt >= 0, tokens.gather(1, nxt.clamp(min=0)), -1)
    last = accept_nodes.long().gather(1, accept_len.long()[:, None])  # [B, 1]
    emitted.scatter_(1, accept_len.long()[:, None], pred.gather(1, last))
    return accept_nodes, accept_len, emitted




def generate_speculative_tp(target: TPTarget, drafter, prompts: Tensor, max_new: int, spec=None, *,
                            verify: str = "vocab", glue: Optional[TPGlue] = None, **kwargs):
    """engine.generate_speculative under TP: the verify forward's logits sharded (verify="vocab") or gathered
    ("gathered") and TPGlue's calls (glue: one to reuse, e.g. with a PrefillCache, which checks it is the same;
    its mode then wins); every other argument as there (drafter: a TPDrafter, or an OracleDrafter over one).
    Every rank returns the same tokens."""
    from ..engine.decode import SpecConfig, generate_speculative

    glue = glue or TPGlue(target.tp, target, verify)
    with target.sharded_logits(glue.mode == "vocab"):
        return generate_speculative(target, drafter, prompts, max_new, spec or SpecConfig(), glue=glue, **kwargs)


__all__ = ["TPDrafter", "tp_drafter", "TPGlue", "walk_greedy", "generate_speculative_tp", "FC_MODES", "VERIFY_MODES"]
