"""Aux-id wiring: which target hidden states an EAGLE-3 drafter consumes, in one unambiguous convention.

Inside ``eagle3_ops`` aux id ``k`` is the residual stream *after* decoder layer ``k`` (0-based, after the
residual add, before the final norm): the output of layer ``k``. The embedding is id -1, captured only
when asked for (``allow_embedding=True``). Slot order is the order of the ids (it fixes the concat order
of the drafter's fc input): ids are never sorted. Default for L layers: ``[1, L//2 - 1, L - 4]``.

A drafter fed the wrong layers still runs and silently loses acceptance (accept length 1.04 instead of
2.77, vLLM #50170; docs/wiring.md), so external ids are converted only through an explicit convention:

=============== ============================================= ==========================
convention      config id k names                             61 layers: outputs 1,29,57
=============== ============================================= ==========================
"output"        output of layer k (SpecForge, TorchSpec,      [1, 29, 57]
                TensorRT-LLM; ours)
"input"         HF output_hidden_states[k] = input of layer   [2, 30, 58]
                k = output of k-1; 0: embedding (EAGLE, vLLM)
"sglang-legacy" SGLang < 2026-05: k + 1, captured at that     [1, 29, 57]
                layer's input = output of layer k
"sglang-2605"   SGLang >= 2026-05: "output" if the first id   [1, 29, 57] or [2, 30, 58]
                is 1, else "input"
=============== ============================================= ==========================

So ``[1, 29, 57]`` read as "output" and ``[2, 30, 58]`` read as "input" are the same tensors, while
``[2, 30, 58]`` read as "sglang-legacy" is one layer late everywhere. Caveat: Hugging Face's last
``output_hidden_states`` entry (index L) is taken *after* the final norm; "input" id L here means the
pre-norm output of layer L-1, as SGLang's GPT-OSS fix (#32334) reads it.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass

CONVENTIONS: tuple[str, ...] = ("output", "input", "sglang-legacy", "sglang-2605")
CONVENTION_DESCRIPTIONS: dict[str, str] = {
    "output": "id k = output of layer k (SpecForge, TorchSpec, TensorRT-LLM; ours)",
    "input": "id k = HF output_hidden_states[k] = input of layer k = output of layer k-1, 0 = embedding "
    "(original EAGLE, vLLM)",
    "sglang-legacy": "SGLang before May 2026: +1 to every id, captured at that layer's input "
    "(id k = output of layer k)",
    "sglang-2605": "SGLang since May 2026: +1 only when the first id is 1 "
    "(first id 1: like 'output', else like 'input')",
}
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
CONVENTION_KEY = "eagle_aux_hidden_state_layer_convention"  # ours, inside eagle_config


def _choices() -> str:
    return "; ".join(f"{name!r}: {CONVENTION_DESCRIPTIONS[name]}" for name in CONVENTIONS)


def _check_convention(convention, what: str = "convention") -> str:
    if convention not in CONVENTIONS:
        raise ValueError(f"{what}={convention!r} is not a known aux-id convention; choose one of {_choices()}")
    return convention


def _check_num_layers(num_layers) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int (the target's decoder layer count), got {num_layers!r}")
    return int(num_layers)


def _as_ints(ids, what: str) -> list[int]:
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{what} must be a list of ints, got {type(ids).__name__} {ids!r}")
    out = list(ids)
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{what}[{i}] = {v!r} is a {type(v).__name__}, not an int; pass layer ids as plain ints")
    if not out:
        raise ValueError(f"{what} is empty; pass at least one aux id (default for L layers: [1, L//2 - 1, L - 4])")
    return [int(v) for v in out]


def _check(ours, num_layers, allow_embedding, what, raw=None, convention=None) -> list[int]:
    seen: dict[int, int] = {}
    for i, k in enumerate(ours):
        src = f"{what}[{i}]: aux id {k}"
        if convention:
            src = f"{what}[{i}] = {raw[i]} read as {convention!r} is aux id {k}"
        if k == -1 and not allow_embedding:
            raise ValueError(f"{src}, the embedding; pass allow_embedding=True if the drafter was trained on it")
        if not -1 <= k < num_layers:
            emb = ", or -1 for the embedding" if allow_embedding else ""
            raise ValueError(f"{src}, out of range for a {num_layers}-layer target "
                             f"(valid: 0..{num_layers - 1}, the output of that layer{emb})")
        if k in seen:
            raise ValueError(f"{src}, a duplicate of {what}[{seen[k]}]; each slot must capture a different layer")
        seen[k] = i
    return list(ours)


def _convert(raw: list[int], convention: str) -> list[int]:
    if convention == "input" or (convention == "sglang-2605" and raw[0] != 1):
        return [k - 1 for k in raw]
    return list(raw)  # "output", "sglang-legacy", and "sglang-2605" whose first id is 1


def default_aux_ids(num_layers: int) -> list[int]:
    """Default aux ids ``[1, L//2 - 1, L - 4]`` (ours): outputs of an early, a middle and a late layer.

    Parameters
    ----------
    num_layers : int
        Decoder layers of the target; 61 (Kimi-K2, DeepSeek-V3) gives ``[1, 29, 57]``.

    Returns
    -------
    ids : list[int]
        The layers every engine's default names. Needs ``num_layers >= 7``; below that the default has
        duplicates or ids out of range and this raises ValueError.
    """
    num_layers = _check_num_layers(num_layers)
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers < 7:  # 6 -> [1, 2, 2], 5 -> [1, 1, 1], 4 -> [1, 1, 0], <= 3 -> out of range
        raise ValueError(f"the default aux ids {ids} are invalid for a {num_layers}-layer target (duplicates or "
                         "out of range; the default needs at least 7 layers); pass aux ids explicitly")
    return ids


def validate_aux_ids(ids, num_layers: int, allow_embedding: bool = False) -> list[int]:
    """Check our aux ids: non-empty ints (no bools), distinct, each in ``0..num_layers-1``.

    Parameters
    ----------
    ids : sequence of int
        Ours (id k = output of layer k), slot order.
    num_layers : int
        Decoder layers of the target.
    allow_embedding : bool
        Also accept -1, the embedding (only for a drafter trained on it).

    Returns
    -------
    ids : list[int]
        The same ids as plain ints, order kept.
    """
    return _check(_as_ints(ids, "ids"), _check_num_layers(num_layers), allow_embedding, "ids")


def to_output_ids(ids, convention: str, num_layers: int, allow_embedding: bool = False) -> list[int]:
    """Convert ids written in a drafter config under ``convention`` into ours, order kept, validated.

    Parameters
    ----------
    ids : sequence of int
        As written in the config, slot order.
    convention : str
        One of ``CONVENTIONS`` (module docstring).
    num_layers : int
        Decoder layers of the target.
    allow_embedding : bool
        Accept a result of -1 (e.g. "input" id 0), the embedding.

    Returns
    -------
    ids : list[int]
        Ours (id k = output of layer k).
    """
    _check_convention(convention)
    raw = _as_ints(ids, "ids")
    return _check(_convert(raw, convention), _check_num_layers(num_layers), allow_embedding, "ids", raw, convention)


def from_output_ids(ids, convention: str, num_layers: int) -> list[int]:
    """The ids to write in a config so that a reader using ``convention`` gets our ``ids`` (inverse).

    Parameters
    ----------
    ids : sequence of int
        Ours, slot order (-1, the embedding, is accepted).
    convention : str
        One of ``CONVENTIONS``.
    num_layers : int
        Decoder layers of the target.

    Returns
    -------
    config_ids : list[int]
        Raises ValueError when inexpressible: "sglang-2605" cannot express ours starting with 0
        (written 0 it reads as -1, written 1 it reads as 1).
    """
    _check_convention(convention)
    ours = _check(_as_ints(ids, "ids"), _check_num_layers(num_layers), True, "ids")
    shift = convention == "input" or (convention == "sglang-2605" and ours[0] != 1)
    written = [k + 1 for k in ours] if shift else list(ours)
    if _convert(written, convention) != ours:
        raise ValueError(f"aux ids {ours} cannot be written in convention {convention!r} "
                         f"({CONVENTION_DESCRIPTIONS[convention]}): {written} would read back as "
                         f"{_convert(written, convention)}; write the config in another convention, e.g. 'output'")
    return written


def capture_sites(ids, num_layers: int) -> list[tuple[int, int]]:
    """Where the target captures each slot, in the order the forward pass reaches them.

    Parameters
    ----------
    ids : sequence of int
        Ours, slot order (-1, the embedding, is accepted: the caller already decided).
    num_layers : int
        Decoder layers of the target.

    Returns
    -------
    sites : list[tuple[int, int]]
        ``(site, slot)`` sorted by site. Site ``k + 1`` (id k) is the add + RMSNorm at the input of layer
        k+1, whose residual after the add is the output of layer k; site ``num_layers`` is the final norm
        (id L-1); site 0 is the embedding (id -1).
    """
    ours = _check(_as_ints(ids, "ids"), _check_num_layers(num_layers), True, "ids")
    return sorted((k + 1, slot) for slot, k in enumerate(ours))


@dataclass(frozen=True)
class AuxWiring:
    """One drafter's aux ids: ours, and how its config wrote them.

    Attributes
    ----------
    ids : tuple[int, ...]
        Ours (id k = output of layer k), slot order.
    convention : str
        The convention the config was read with ("output" for the default).
    config_ids : tuple[int, ...] | None
        As written in the config; None when it had none (``ids`` is then the default).
    num_layers : int
        Decoder layers of the target.
    """

    ids: tuple[int, ...]
    convention: str
    config_ids: tuple[int, ...] | None
    num_layers: int

    def __str__(self) -> str:
        layers = ", ".join("embedding" if k == -1 else str(k) for k in self.ids)
        src = "default" if self.config_ids is None else f"config {list(self.config_ids)} read as {self.convention!r}"
        return f"aux ids {list(self.ids)}: outputs of layers {layers} of {self.num_layers} ({src})"


def _load(config) -> dict:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, a config.json path or a folder holding one, "
                        f"not {type(config).__name__}")
    return config


def read_drafter_config(config, num_layers: int, convention: str | None = None,
                        allow_embedding: bool = False) -> AuxWiring:
    """Read a drafter's aux ids from its Hugging Face style config and convert them to ours.

    Parameters
    ----------
    config : dict | str | os.PathLike
        The config, its config.json, or a folder holding config.json. Ids come from
        ``config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]`` or a top-level key of that name
        (both present and different: refused).
    num_layers : int
        Decoder layers of the target.
    convention : str | None
        How the ids were written; else ``config["eagle_config"]["eagle_aux_hidden_state_layer_convention"]``.
        Ids with neither, or with two that disagree, are refused rather than guessed.
    allow_embedding : bool
        Accept ids that name the embedding.

    Returns
    -------
    wiring : AuxWiring
        Validated. A config without ids gets ``default_aux_ids(num_layers)`` with convention "output".
    """
    cfg = _load(config)
    num_layers = _check_num_layers(num_layers)
    if convention is not None:
        _check_convention(convention)
    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise TypeError(f'config["eagle_config"] must be a dict, not {type(eagle).__name__}')
    nested, top = eagle.get(IDS_KEY), cfg.get(IDS_KEY)
    if nested is not None and top is not None and nested != top:
        raise ValueError(f'config["eagle_config"]["{IDS_KEY}"] = {nested} and config["{IDS_KEY}"] = {top} '
                         "disagree; fix the config so that one remains (or both are equal)")
    if nested is None and top is None:
        return AuxWiring(tuple(default_aux_ids(num_layers)), "output", None, num_layers)
    what = f'config["eagle_config"]["{IDS_KEY}"]' if nested is not None else f'config["{IDS_KEY}"]'
    raw = _as_ints(nested if nested is not None else top, what)
    declared = eagle.get(CONVENTION_KEY)
    if declared is not None:
        _check_convention(declared, f'config["eagle_config"]["{CONVENTION_KEY}"]')
        if convention is not None and convention != declared:
            raise ValueError(f"convention={convention!r} disagrees with the config's {CONVENTION_KEY} = "
                             f"{declared!r}; drop one of them or make them equal")
    conv = convention if convention is not None else declared
    if conv is None:
        raise ValueError(f"{what} = {raw} does not say which layers it names: e.g. [2, 30, 58] means the outputs "
                         "of layers 2, 30, 58 under 'output' but of 1, 29, 57 under 'input'. Conventions: "
                         f"{_choices()}. Pass convention= (or set eagle_config.{CONVENTION_KEY}) to say how "
                         "the drafter was trained")
    ours = _check(_convert(raw, conv), num_layers, allow_embedding, what, raw, conv)
    return AuxWiring(tuple(ours), conv, tuple(raw), num_layers)


def drafter_config_fields(ids, convention: str = "output", num_layers: int | None = None) -> dict:
    """The ``eagle_config`` fields to write into a drafter config.json for our ``ids``.

    Parameters
    ----------
    ids : sequence of int
        Ours, slot order.
    convention : str
        The convention to write the ids in, one of ``CONVENTIONS``.
    num_layers : int
        Decoder layers of the target (required).

    Returns
    -------
    fields : dict
        ``{IDS_KEY: ids in that convention, CONVENTION_KEY: convention}``; ``read_drafter_config`` on a
        config whose ``eagle_config`` holds them returns exactly ``ids``.
    """
    if num_layers is None:
        raise TypeError("drafter_config_fields() needs num_layers, the target's decoder layer count")
    return {IDS_KEY: from_output_ids(ids, convention, num_layers), CONVENTION_KEY: convention}


def candidate_wirings(configured, num_layers: int, config_ids=None,
                      convention: str | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The configured capture and the plausible wirings around it, as ``(label, ids)``, deduplicated by ids.

    The candidates: the config's ids read in every convention; the seed deployment's miswiring
    (docs/wiring.md): the ids read in a convention other than the config's own, with an embedding
    captured in front; and each reading (and the configured capture) one layer off either way, or with an
    embedding captured in front. Ids out of range for the target are left out. Torch-free; used by
    ``eagle3_ops.diagnose``.

    Parameters
    ----------
    configured : sequence of int
        What the engine captures, ours (id k = output of layer k), slot order.
    num_layers : int
        Decoder layers of the target.
    config_ids : sequence of int | None
        The ids as written in the drafter's config; default the configured ones in convention "output".
    convention : str | None
        The one the config declares: default "output" when ``config_ids`` is None, else the first
        reading that gives the configured capture (None when none does).

    Returns
    -------
    candidates : list[tuple[str, tuple[int, ...]]]
        The configured capture first, labelled "configured" or "configured = <what it also is>" (e.g. the
        seed miswiring); then the other wirings, the most direct explanation naming each.
    """
    configured = tuple(configured)
    raw = list(config_ids) if config_ids is not None else list(configured)
    if convention is None and config_ids is None:
        convention = "output"
    found: dict[tuple[int, ...], str] = {configured: "configured"}
    also: list[str] = []  # what the configured capture is besides (e.g. the seed miswiring)

    def add(label, ids):
        try:
            ids = tuple(validate_aux_ids(list(ids), num_layers, allow_embedding=True))
        except (ValueError, TypeError):
            return
        if ids == configured:
            also.append(label)
        found.setdefault(ids, label)  # the first (most direct) explanation names it

    readings: dict[tuple[int, ...], str] = {}  # ids -> the first convention that reads the config so
    for conv in CONVENTIONS:
        try:
            ids = tuple(to_output_ids(raw, conv, num_layers, allow_embedding=True))
        except (ValueError, TypeError):
            continue
        add(f"config ids read as '{conv}'", ids)
        readings.setdefault(ids, conv)
    if convention is None:
        convention = next((conv for ids, conv in readings.items() if ids == configured), None)
    if convention is not None:
        declared = tuple(to_output_ids(raw, convention, num_layers, allow_embedding=True))
        for ids, conv in readings.items():
            if ids != declared:
                add(f"seed miswiring: read as '{conv}' + embedding in front", [-1] + list(ids[:-1]))
    bases = [(configured, "configured")] + [(r, f"config read as '{c}'") for r, c in readings.items()]
    for base, name in bases:
        add(f"{name}, every layer +1", [k + 1 for k in base])
        add(f"{name}, every layer -1", [k - 1 for k in base])
        add(f"{name}, embedding captured in front", [-1] + list(base[:-1]))
    if also:
        found[configured] = f"configured = {also[0]}"
    return [(label, ids) for ids, label in found.items()]
