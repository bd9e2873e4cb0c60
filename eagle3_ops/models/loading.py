"""Hugging Face style folders: config.json + safetensors weights, gpt-fast style loading.

``save_pretrained`` works for any module with a ``cfg`` that has ``to_hf()`` (the Target, the Drafter).
``load_weights`` loads a folder's tensors into a module built on the meta device (``assign=True``: no
second copy, no random init; routed experts are copied into their stacks as they are read), naming every
missing, unexpected or mis-shaped key. ``load_target`` builds
the Target that way; a drafter loader can do the same with ``load_weights``.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
from torch import nn

from .config import TargetConfig
from .target import Experts, Target

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"  # Hugging Face's sharded layout: {"weight_map": {key: file}}


def _list(keys, limit: int = 12) -> str:
    keys = sorted(keys)
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def save_pretrained(model: nn.Module, folder, extra_config: Optional[dict] = None,
                    config: Optional[dict] = None) -> None:
    """Write ``folder/config.json`` and ``folder/model.safetensors`` (every state_dict entry, as stored).

    Parameters
    ----------
    model : nn.Module
        Holds ``cfg`` with ``to_hf()`` (TargetConfig, DrafterConfig) unless ``config`` is given.
    folder : str | os.PathLike
        Created if missing; existing files of these names are replaced.
    extra_config : dict, optional
        Merged over the config fields (top level), e.g. training metadata.
    config : dict, optional
        The config fields to write instead of ``model.cfg.to_hf()`` (e.g. a drafter's
        ``cfg.to_hf(convention, num_layers)``).
    """
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    fields = dict(config if config is not None else model.cfg.to_hf())
    fields.update(extra_config or {})
    seen, state = set(), {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if t.data_ptr() in seen:  # safetensors refuses shared storage (tied weights): store a copy
            t = t.clone()
        seen.add(t.data_ptr())
        state[name] = t
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(state, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})


def read_config(folder) -> dict:
    """The folder's config.json as a dict."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a model folder holds config.json and safetensors weights")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _weight_files(folder) -> list[str]:
    index = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder} (expected {WEIGHTS_NAME} or {INDEX_NAME})")
    return [os.path.join(folder, n) for n in files]


def load_weights(model: nn.Module, folder, dtype: Optional[torch.dtype] = None, device="cpu",
                 keeps_fp32: Optional[Callable[[str], bool]] = None) -> nn.Module:
    """Load a folder's safetensors into ``model`` (typically built on the meta device) with assign=True.

    Parameters
    ----------
    model : nn.Module
        Its state_dict keys and shapes must match the files exactly.
    folder : str | os.PathLike
        Holds model.safetensors, or a sharded model.safetensors.index.json, or *.safetensors.
    dtype : torch.dtype, optional
        Cast floating tensors to it (None: keep the stored dtypes). Entries for which keeps_fp32(name) is
        true are loaded as fp32 whatever dtype is.
    device : str | torch.device
        Where the tensors are materialised (read straight there).
    keeps_fp32 : callable, optional
        Default: ``model.keeps_fp32`` if the module has one, else nothing.

    Returns
    -------
    model : the same module, loaded. ValueError names missing, unexpected and mis-shaped keys.
    """
    from safetensors import safe_open

    keeps_fp32 = keeps_fp32 or getattr(model, "keeps_fp32", None) or (lambda name: False)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # Routed experts stream straight into their stacks ([E, 2I, H], [E, H, I]) as they are read, so the
    # per-expert tensors are never all held beside the stacks (an MoE checkpoint is mostly experts).
    streams = {}  # per-expert key -> (stack name, index into the stack)
    for prefix, mod in model.named_modules():
        if isinstance(mod, Experts):
            p, I = (prefix + "." if prefix else ""), mod.intermediate
            for e in range(mod.num):
                streams[f"{p}{e}.gate_proj.weight"] = (p + "gate_up", (e, slice(0, I)))
                streams[f"{p}{e}.up_proj.weight"] = (p + "gate_up", (e, slice(I, 2 * I)))
                streams[f"{p}{e}.down_proj.weight"] = (p + "down", (e,))
    stacks = {}  # stack name -> tensor, allocated at its first expert
    stack_shapes = {n: tuple(v.shape) for n, v in model.named_parameters() if n in {v[0] for v in streams.values()}}
    state, seen = {}, {}  # seen: key -> its shape in the file
    for path in _weight_files(folder):
        with safe_open(path, framework="pt", device=str(device)) as f:
            for k in f.keys():
                t = f.get_tensor(k)
                seen[k] = tuple(t.shape)
                if k in streams and seen[k] == expected.get(k):
                    name, where = streams[k]
                    if name not in stacks:
                        stacks[name] = torch.empty(stack_shapes[name], device=device,
                                                   dtype=dtype if dtype is not None and t.is_floating_point()
                                                   else t.dtype)
                    stacks[name][where] = t
                else:
                    state[k] = t
    missing, unexpected = set(expected) - set(seen), set(seen) - set(expected)
    shapes = [f"{k}: file {seen[k]}, model {expected[k]}" for k in sorted(set(expected) & set(seen))
              if seen[k] != expected[k]]
    if missing or unexpected or shapes:
        parts = [f"missing keys ({len(missing)}): {_list(missing)}" if missing else "",
                 f"unexpected keys ({len(unexpected)}): {_list(unexpected)}" if unexpected else "",
                 f"shape mismatches ({len(shapes)}): {'; '.join(shapes[:12])}" if shapes else ""]
        raise ValueError(f"weights in {folder} do not fit {type(model).__name__}: "
                         + "; ".join(p for p in parts if p))
    for k, t in state.items():
        if t.is_floating_point():
            if keeps_fp32(k):
                state[k] = t.float()
            elif dtype is not None:
                state[k] = t.to(dtype)
    state.update(stacks)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def load_target(folder, dtype: Optional[torch.dtype] = None, device="cpu") -> Target:
    """Build a Target from a Hugging Face style folder (config.json in DeepSeek-V3 naming + safetensors).

    Constructed on the meta device, then loaded with assign=True (gpt-fast): the weights are read once,
    straight onto ``device``. dtype None keeps the stored dtype; the routing bias and rope stay fp32.
    """
    cfg = TargetConfig.from_hf(read_config(folder))
    with torch.device("meta"):
        model = Target(cfg)
    load_weights(model, folder, dtype=dtype, device=device)
    return model.reset_rope().eval()


__all__ = ["save_pretrained", "load_weights", "load_target", "read_config"]
