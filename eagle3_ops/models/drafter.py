"""The EAGLE-3 drafter: one Llama decoder layer over cat(input_layernorm(embed(tok)), hidden_norm(h)).

Parameters carry the Hugging Face / SpecForge ``LlamaForCausalLMEagle3`` names, so a checkpoint's
``model.safetensors`` loads as is::

    fc.weight                                   [H, n_aux * Ht]
    input_norm.weight                           [n_aux * Ht]   norm_before_fc only (one RMSNorm over the row)
    fc_norm.{0..n_aux-1}.weight                 [Ht]           fc_norm only (EAGLE-3.1: an RMSNorm per chunk)
    midlayer.hidden_norm.weight                 [H]
    midlayer.input_layernorm.weight             [H]
    midlayer.self_attn.{q,k,v}_proj.weight      [NH * hd | NKV * hd, 2H]
    midlayer.self_attn.o_proj.weight            [H, NH * hd]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [Vd, H]
    d2t                                         [Vd] int64  target id = draft id + d2t[draft id]
    t2d                                         [V] bool    target id is in the draft vocabulary
    embed_tokens.weight                         [V, H]      only when no target embedding was shared

``norm_output`` has no parameter: it only makes the post-norm hidden feed the next step.

The math of one step, with e = embed(token) and h the incoming hidden (fc(aux) on a round's first
pass, else the drafter's own previous hidden)::

    x = cat(input_layernorm(e), hidden_norm(h))          2H wide, embedding FIRST
    h = h + o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x))
    h = h + down(silu(gate(n)) * up(n)),  n = post_attention_layernorm(h)
    logits = lm_head(norm(h))  (fp32, draft vocab);   hidden out = h  (norm(h) with norm_output)

Three entry points share the layer: ``forward`` (inference, through torch.ops.eagle3.tree_attention
over a paged cache), ``forward_train`` / ``forward_train_from_aux`` (plain differentiable PyTorch with
SDPA), and ``project`` (the fc through torch.ops.eagle3.fc_proj).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import PagedKV
from .config import DrafterConfig

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class RMSNorm(nn.Module):
    """Llama RMSNorm: weight * (x / rms(x)), the normalisation in fp32, rounded to x's dtype before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * H, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, H, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The decoder layer's parameters (named as in the checkpoints); Drafter runs the math."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fc-side RMSNorm as torch.ops.eagle3.fc_proj computes it: fp32, unrounded, times the fp32 weight."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class Drafter(nn.Module):
    """EAGLE-3 head (module docstring).

    Parameters
    ----------
    cfg : DrafterConfig
        Shapes and variant flags (norm_before_fc, fc_norm, norm_output; at most one of the first two).
    embed : nn.Embedding [V, H], optional
        The target's embedding, shared and frozen. It is kept in a plain tuple (``self._shared``), so it
        is neither a submodule nor in this module's state_dict, ``.to()`` leaves it where the target
        put it, and no gradient flows into it. Without one the drafter owns ``embed_tokens``
        (in its state_dict as ``embed_tokens.weight``, requires_grad False).
    """

    def __init__(self, cfg: DrafterConfig, embed: Optional[nn.Embedding] = None):
        super().__init__()
        if cfg.norm_before_fc and cfg.fc_norm:
            raise ValueError("DrafterConfig has both norm_before_fc and fc_norm set; a drafter uses at most one")
        if cfg.hidden_size % 2 or cfg.head_dim % 2 or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"need even hidden_size and head_dim and num_heads % num_kv_heads == 0, got {cfg}")
        if not 1 <= cfg.draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size = {cfg.vocab_size}], "
                             f"got {cfg.draft_vocab_size}")
        self.cfg = cfg
        H, Ht, n_aux = cfg.hidden_size, cfg.target_hidden_size, cfg.n_aux
        if embed is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.embed_tokens.weight.requires_grad_(False)
            self._shared: tuple = ()
        else:
            if tuple(embed.weight.shape) != (cfg.vocab_size, H):
                raise ValueError(f"embed must be [V, H] = [{cfg.vocab_size}, {H}] (the target's embedding), "
                                 f"got {list(embed.weight.shape)}")
            self._shared = (embed,)
        self.fc = nn.Linear(n_aux * Ht, H, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(n_aux * Ht, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(n_aux))
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # default: draft id i is target id i (the first Vd target ids)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        self._inv_freq: dict = {}  # device -> [hd / 2] fp32, built on first use (survives meta construction)

    # ---- small accessors -----------------------------------------------------------------------------
    @property
    def embed(self) -> nn.Embedding:
        return self._shared[0] if self._shared else self.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def norm_mode(self) -> str:
        """fc_proj's norm_mode: "none", "norm_before_fc" or "fc_norm"."""
        return "norm_before_fc" if self.cfg.norm_before_fc else "fc_norm" if self.cfg.fc_norm else "none"

    def fc_norm_weight(self) -> Optional[Tensor]:
        """fc_proj's norm_weight: input_norm [n_aux * Ht], the stacked fc_norm weights [n_aux, Ht], or None."""
        if self.cfg.norm_before_fc:
            return self.input_norm.weight
        if self.cfg.fc_norm:
            return torch.stack([n.weight for n in self.fc_norm])
        return None

    def set_vocab_map(self, draft_to_target: Tensor) -> None:
        """Fill d2t and t2d from the target id of every draft id, draft_to_target [Vd] int64 (distinct)."""
        Vd, V = self.cfg.draft_vocab_size, self.cfg.vocab_size
        ids = draft_to_target.to(device=self.d2t.device, dtype=torch.int64)
        if ids.shape != (Vd,) or int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
            raise ValueError(f"draft_to_target must be [Vd] = [{Vd}] distinct target ids in [0, {V})")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(Vd, device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Target ids of draft ids (any shape, int64): draft + d2t[draft]."""
        return draft_ids + self.d2t[draft_ids]

    def new_kv(self, batch: int, max_len: int, page_size: int = 16, dtype: Optional[torch.dtype] = None,
               device=None) -> PagedKV:
        """The drafter's own paged cache: caches [K, V], each [num_pages, page_size, NKV, hd]."""
        row = (self.cfg.num_kv_heads, self.cfg.head_dim)
        return PagedKV([row, row], batch, max_len, page_size, dtype=dtype or self.dtype,
                       device=device if device is not None else self.device)

    # ---- the fc --------------------------------------------------------------------------------------
    def project(self, aux: Tensor, rows: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
        """fc(aux[rows]) through torch.ops.eagle3.fc_proj with the config's norm mode (not differentiable:
        train with project_train / forward_train_from_aux).

        Parameters
        ----------
        aux : Tensor [T, n_aux * Ht] model dtype
            Captured target features (may be a strided view of the capture buffer).
        rows : Tensor [R] int32 | int64, optional
            Rows to project (e.g. the accepted tokens); None: all T.
        out : Tensor [R, H] model dtype, optional, mutated
            Preallocated output (CUDA graphs); allocated when None.

        Returns
        -------
        out : Tensor [R, H]
        """
        if out is None:
            R = aux.shape[0] if rows is None else rows.shape[0]
            out = aux.new_empty((R, self.cfg.hidden_size))
        with torch.no_grad():
            torch.ops.eagle3.fc_proj(aux, self.fc.weight, None, self.fc_norm_weight(), self.cfg.rms_norm_eps,
                                     self.norm_mode, rows, out)
        return out

    def project_train(self, aux: Tensor) -> Tensor:
        """The same fc as ``project`` in plain differentiable PyTorch: aux [..., n_aux * Ht] -> [..., H]."""
        if self.cfg.norm_before_fc:
            aux = _rms(aux, self.input_norm.weight, self.cfg.rms_norm_eps).to(aux.dtype)
        elif self.cfg.fc_norm:
            chunks = aux.unflatten(-1, (self.cfg.n_aux, self.cfg.target_hidden_size))
            aux = _rms(chunks, self.fc_norm_weight(), self.cfg.rms_norm_eps).flatten(-2).to(aux.dtype)
        return self.fc(aux)

    # ---- the layer -----------------------------------------------------------------------------------
    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """Llama rotate-half RoPE. x [..., heads, hd], positions [...] int64."""
        inv = self._inv_freq.get(x.device)
        if inv is None:
            hd = self.cfg.head_dim
            exps = torch.arange(0, hd, 2, dtype=torch.float64) / hd
            inv = self._inv_freq[x.device] = (1.0 / self.cfg.rope_theta ** exps).float().to(x.device)
        freqs = positions.float()[..., None] * inv  # [..., hd / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # [..., 1, hd]
        xf = x.float()
        return (xf * emb.cos() + _rotate_half(xf) * emb.sin()).to(x.dtype)

    def _qkv(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [...] int64, hidden [..., H], positions [...] -> q [..., NH, hd], k and v [..., NKV, hd];
        q and k rotated."""
        layer, cfg = self.midlayer, self.cfg
        e = F.embedding(tokens, self.embed.weight.detach()).to(hidden.dtype)
        x = torch.cat((layer.input_layernorm(e), layer.hidden_norm(hidden)), dim=-1)  # embedding first
        attn = layer.self_attn
        q = attn.q_proj(x).unflatten(-1, (cfg.num_heads, cfg.head_dim))
        k = attn.k_proj(x).unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        v = attn.v_proj(x).unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish(self, hidden: Tensor, attn_out: Tensor) -> tuple[Tensor, Tensor]:
        """Residuals, MLP and head. hidden [..., H] (the residual), attn_out [..., NH * hd]."""
        layer = self.midlayer
        h = hidden + layer.self_attn.o_proj(attn_out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = self.norm(h)
        return self.lm_head(normed).float(), (normed if self.cfg.norm_output else h)

    def forward_train(self, tokens: Tensor, hidden: Tensor, positions: Optional[Tensor] = None,
                      attn_mask: Optional[Tensor] = None, past_kv: Optional[tuple[Tensor, Tensor]] = None,
                      return_kv: bool = False):
        """One drafter pass over whole sequences, plain differentiable PyTorch (SDPA).

        Parameters
        ----------
        tokens : Tensor [B, T] int64
            Target-vocabulary tokens (position i carries x_{i+1} in EAGLE-3 training alignment).
        hidden : Tensor [B, T, H] model dtype
            Incoming hidden: fc(aux) (project_train) or the drafter's previous hidden.
        positions : Tensor [B, T] int64, optional
            RoPE positions; default S0 + arange(T) (S0 = past length, 0 without past_kv).
        attn_mask : Tensor [B | 1, T, S0 + T] bool, optional
            True where query t may attend key s; keys are past_kv's S0 rows, then this call's T rows.
            Default: every past key visible plus causal over this call's block (causal alone without
            past_kv). A row with nothing visible gives NaN (SDPA).
        past_kv : (k [B, S0, NKV, hd], v [B, S0, NKV, hd]), optional
            Keys (already rotated, as return_kv gives them) and values placed before this call's, e.g.
            an earlier training-time-test step's, or a prefix.
        return_kv : bool
            Also return (k, v) [B, S0 + T, NKV, hd]: past_kv followed by this call's rotated keys and
            values, ready to pass as the next call's past_kv.

        Returns
        -------
        logits : Tensor [B, T, Vd] fp32
        hidden_out : Tensor [B, T, H]
            The pre-norm h (norm(h) with norm_output): the next step's hidden.
        kv : (Tensor, Tensor), only with return_kv
        """
        cfg = self.cfg
        B, T = tokens.shape
        S0 = 0 if past_kv is None else past_kv[0].shape[1]
        if positions is None:
            positions = torch.arange(S0, S0 + T, device=tokens.device).expand(B, T)
        q, k, v = self._qkv(tokens, hidden, positions)
        if past_kv is not None:
            k, v = torch.cat((past_kv[0], k), dim=1), torch.cat((past_kv[1], v), dim=1)
        if attn_mask is None and S0 > 0:
            causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
            attn_mask = torch.cat((causal.new_ones(T, S0), causal), dim=1)[None]
        group = cfg.num_heads // cfg.num_kv_heads  # query head h reads KV head h // group
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, dim=1),
            v.transpose(1, 2).repeat_interleave(group, dim=1),
            attn_mask=None if attn_mask is None else attn_mask[:, None], is_causal=attn_mask is None,
            scale=cfg.head_dim ** -0.5)
        logits, hidden_out = self._finish(hidden, o.transpose(1, 2).flatten(-2))
        return (logits, hidden_out, (k, v)) if return_kv else (logits, hidden_out)

    def forward_train_from_aux(self, tokens: Tensor, aux: Tensor, positions: Optional[Tensor] = None,
                               attn_mask: Optional[Tensor] = None,
                               past_kv: Optional[tuple[Tensor, Tensor]] = None, return_kv: bool = False):
        """forward_train(tokens, project_train(aux), ...): aux [B, T, n_aux * Ht], differentiable."""
        return self.forward_train(tokens, self.project_train(aux), positions, attn_mask, past_kv, return_kv)

    @torch.no_grad()
    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, kv: PagedKV,
                tree_mask: Tensor) -> tuple[Tensor, Tensor]:
        """One inference step over B requests of N nodes each (a prefill chunk is a chain of N nodes).

        Writes this step's K (rotated) and V rows into kv.caches[0] / kv.caches[1] at positions
        prefix_lens + node, then attends through torch.ops.eagle3.tree_attention: every node sees the
        whole prefix and its ancestors-or-self in the block. Does not advance prefix_lens. No host sync.

        Parameters
        ----------
        tokens : Tensor [B, N] int64
            Target-vocabulary tokens per node.
        hidden : Tensor [B * N, H] model dtype
            fc(aux) rows (project) or the drafter's previous hidden_out rows, node-major per request.
        positions : Tensor [B, N] int64
            RoPE positions, prefix_lens + depth.
        kv : PagedKV
            From new_kv; caches [K, V] in the model dtype.
        tree_mask : Tensor [B, N, ceil(N / 32)] int32
            Ancestor-or-self bits over the block (eagle3_ops.tree.tree_mask).

        Returns
        -------
        logits : Tensor [B * N, Vd] fp32
        hidden_out : Tensor [B * N, H]
            Pre-norm h (norm(h) with norm_output).
        """
        cfg = self.cfg
        B, N = tokens.shape
        q, k, v = self._qkv(tokens.reshape(-1), hidden, positions.reshape(-1))
        kv.write(0, k.view(B, N, cfg.num_kv_heads, cfg.head_dim))
        kv.write(1, v.view(B, N, cfg.num_kv_heads, cfg.head_dim))
        out = torch.empty_like(q)
        torch.ops.eagle3.tree_attention(q.contiguous(), kv.caches[0], kv.caches[1], kv.page_table, kv.prefix_lens,
                                        tree_mask, cfg.head_dim ** -0.5, out, None)
        return self._finish(hidden, out.flatten(-2))

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def synthesize(cls, cfg: DrafterConfig, embed: Optional[nn.Embedding] = None, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device="cpu") -> "Drafter":
        """Seeded random weights (drawn on the CPU, so a seed gives the same weights everywhere): linear
        weights N(0, 1 / fan_in), norm weights 1 + N(0, 0.1^2) (distinct, so a swapped norm shows), an
        owned embedding N(0, 1), and a vocabulary map onto a random sorted set of Vd target ids."""
        g = torch.Generator().manual_seed(seed)
        with torch.device("meta"):
            model = cls(cfg, embed)
        sd = {}
        for name, p in model.state_dict().items():
            if name in ("d2t", "t2d"):
                continue
            if p.dim() == 1:
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name == "embed_tokens.weight":
                w = torch.randn(p.shape, generator=g)
            else:
                w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            sd[name] = w.to(dtype=dtype, device=device)
        selected = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
        sd["d2t"] = (selected - torch.arange(cfg.draft_vocab_size)).to(device)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[selected] = True
        sd["t2d"] = t2d.to(device)
        model.load_state_dict(sd, assign=True)
        return model


def _normalise_keys(sd: dict, shared_embed: bool) -> dict:
    """Checkpoint names -> ours: drop a leading "model.", read "layers.0." as "midlayer." (speculators
    layout), drop embed_tokens.weight when the target's embedding is shared."""
    out = {}
    for name, t in sd.items():
        name = name[len("model."):] if name.startswith("model.") else name
        name = "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
        if shared_embed and name == "embed_tokens.weight":
            continue
        out[name] = t
    return out


def load_drafter(folder, embed: Optional[nn.Embedding], num_layers: int, convention: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None, device="cpu") -> Drafter:
    """Load a Hugging Face style drafter folder: config.json + model.safetensors.

    Parameters
    ----------
    folder : str | os.PathLike
        Holds config.json (LlamaForCausalLMEagle3 fields) and model.safetensors.
    embed : nn.Embedding [V, H] | None
        The target's embedding (shared); None: the file must hold embed_tokens.weight.
    num_layers : int
        The target's decoder layer count (checks and converts the aux ids).
    convention : str, optional
        How config.json writes its aux ids (eagle3_ops.wiring.CONVENTIONS); None: the config's own
        eagle_aux_hidden_state_layer_convention. Ids with neither, or an unknown convention, are
        refused with an error that names the choices.
    dtype : torch.dtype, optional
        Floating dtype of every parameter; default fc.weight's dtype in the file.
    device : str | torch.device
        Where the weights go.

    Returns
    -------
    drafter : Drafter
        Built on the meta device, then filled with load_state_dict(assign=True). Missing d2t/t2d are
        accepted only when draft_vocab_size == vocab_size (identity map).
    """
    from safetensors.torch import load_file

    with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as f:
        hf = json.load(f)
    cfg = DrafterConfig.from_hf(hf, num_layers, convention=convention)
    path = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found (a single model.safetensors is expected)")
    sd = _normalise_keys(load_file(path, device=str(device)), embed is not None)
    if "fc.weight" not in sd:
        raise KeyError(f"{path} has no fc.weight; keys: {sorted(sd)[:8]}...")
    dtype = dtype or sd["fc.weight"].dtype
    sd = {k: t.to(dtype) if t.is_floating_point() else t for k, t in sd.items()}
    Vd, V = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in sd:
        if Vd != V:
            raise KeyError(f"{path} has no d2t, needed when draft_vocab_size ({Vd}) < vocab_size ({V})")
        sd["d2t"] = torch.zeros(Vd, dtype=torch.int64, device=device)
    sd["d2t"] = sd["d2t"].long()
    if "t2d" not in sd:  # derive it from d2t
        t2d = torch.zeros(V, dtype=torch.bool, device=device)
        t2d[torch.arange(Vd, device=device) + sd["d2t"]] = True
        sd["t2d"] = t2d
    sd["t2d"] = sd["t2d"].bool()
    with torch.device("meta"):
        model = Drafter(cfg, embed)
    model.load_state_dict(sd, strict=True, assign=True)
    return model


def save_drafter(drafter: Drafter, folder, convention: str = "output", num_layers: Optional[int] = None) -> None:
    """Write config.json (cfg.to_hf(convention, num_layers)) and model.safetensors (the state_dict: the
    shared target embedding is not saved) through loading.save_pretrained. num_layers is the target's
    decoder layer count (required: the aux ids are written in ``convention``)."""
    from .loading import save_pretrained

    if num_layers is None:
        raise TypeError("save_drafter() needs num_layers, the target's decoder layer count (to write the aux ids)")
    hf = drafter.cfg.to_hf(convention, num_layers)
    hf.update(torch_dtype=str(drafter.dtype).replace("torch.", ""), tie_word_embeddings=False, hidden_act="silu")
    save_pretrained(drafter, folder, config=hf)


__all__ = ["Drafter", "RMSNorm", "load_drafter", "save_drafter"]
