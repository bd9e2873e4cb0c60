"""Readers (and writers) for every format an EAGLE-3 drafter config ships in, each read in the convention its
producer gives the ids. Plain Python, no torch: configs can be checked where torch is not installed.

Every format stores the aux ids under the key ``eagle_aux_hidden_state_layer_ids``; they differ in where
(nested in ``eagle_config`` or at the top level), in what marks the producer, and in what an id means. What
each producer's source says (read at the commits named; `eagle3_ops.wiring` names the conventions):

================ ========================================== ============= =========================================
format           marker / field                             convention    the source that fixes it
================ ========================================== ============= =========================================
"eagle3_ops"     eagle_config.eagle_aux_hidden_state_       as declared   ours (wiring.read_drafter_config)
                 layer_convention
"sglang"         eagle_config.eagle_aux_hidden_state_       the SGLang    sgl-project/sglang python/sglang/srt/
(SpecForge)      layer_ids, no other producer's marker      reading:      models/llama.py: set_eagle3_layers_to_
                                                            "sglang-      capture adds 1 to each id and LlamaModel
                                                            legacy" and   captures hidden + residual at the input of
                                                            "sglang-2605" that layer (= output of layer k). SpecForge
                                                            must agree    trains through that capture
                                                                          (sgl-project/SpecForge specforge/offline_
                                                                          capture/sglang_backend/capture.py) and
                                                                          defaults to [1, L//2 - 1, L - 4] (specforge/
                                                                          algorithms/model_providers.py)
"modelopt"       eagle_config holds ModelOpt's export       "output"      NVIDIA/Model-Optimizer modelopt/torch/
                 template keys (next_layer_regular,                       export/plugins/hf_spec_configs.py (the
                 parallel_draft_step, parallel_draft_                     template); modelopt/torch/speculative/
                 heads_num_layers)                                        plugins/hf_eagle.py hooks the *output* of
                                                                          decoder layer idx (megatron_eagle.py:
                                                                          layer_number - 1, the same)
"torchspec"      _torchspec_version (tools/convert_to_hf.py "output";     torchspec-project/TorchSpec torchspec/
                 writes it), ids nested or top level        kimi_k2       inference/engine/vllm_engine.py ("post-
                                                            exported for  layer semantics", +1 for vLLM's capture);
                                                            vLLM: "input" tools/convert_to_hf.py _fixup_export_config
                                                                          adds 1 to every id of a kimi_k2 config
                                                                          exported for vLLM (its weights then say
                                                                          layers.0.*, not midlayer.*)
"vllm-           speculators_model_type / speculators_      "input"       vllm-project/vllm vllm/transformers_utils/
speculators"     config; top-level ids                                    configs/speculators/algos.py copies the
                                                                          top-level ids; vllm/v1/worker/gpu/spec_
                                                                          decode/eagle/eagle3_utils.py reads them;
                                                                          vllm/model_executor/models/llama.py
                                                                          captures hidden + residual *before* layer
                                                                          idx (= output of idx - 1)
"vllm"           top-level ids, no speculators marker       "input"       the same reader (hf_config.eagle_aux_
                                                                          hidden_state_layer_ids)
================ ========================================== ============= =========================================

A config that several readings explain differently is refused, with every reading listed: SGLang ids
whose two readings differ (``[2, 30, 58]``: outputs of 2, 30, 58 before May 2026, of 1, 29, 57 since), a
TorchSpec kimi_k2 export whose weights cannot be read, nested and top-level ids that disagree, two
producers' markers that disagree. No ids anywhere: every producer's default, ``[1, L//2 - 1, L - 4]``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from . import wiring

FORMATS: tuple[str, ...] = ("eagle3_ops", "sglang", "modelopt", "torchspec", "vllm-speculators", "vllm")
MODELOPT_KEYS = ("next_layer_regular", "parallel_draft_step", "parallel_draft_heads_num_layers")
SPECULATORS_KEYS = ("speculators_model_type", "speculators_config")
TORCHSPEC_KEY = "_torchspec_version"
NESTED = f"eagle_config.{wiring.IDS_KEY}"
TOP = wiring.IDS_KEY
SAFETENSORS = "model.safetensors"
# the fields each producer writes (ours and TorchSpec's either; wiring.read_drafter_config reads both)
WRITES = {"eagle3_ops": (NESTED, TOP), "torchspec": (NESTED, TOP), "modelopt": (NESTED,), "vllm-speculators": (TOP,)}


@dataclass(frozen=True)
class Reading:
    """One way to read a config's ids: the format (or engine) that reads them so, the field, the convention."""

    format: str
    field: str
    convention: str
    config_ids: tuple[int, ...]
    ids: tuple[int, ...] | None  # ours; None when this reading is out of range for the target
    why: str  # the reason this format reads the ids so, for messages

    def __str__(self) -> str:
        got = "out of range" if self.ids is None else f"aux ids {list(self.ids)}"
        return (f"{self.format}: {self.field} = {list(self.config_ids)} read as {self.convention!r} -> {got} "
                f"({self.why})")


@dataclass(frozen=True)
class FormatWiring(wiring.AuxWiring):
    """A drafter's aux ids as ``read_drafter_format`` found them: ``wiring.AuxWiring`` plus where from.

    Attributes
    ----------
    format : str
        One of ``FORMATS``, or "default" (no ids anywhere).
    field : str
        The config field the ids came from ("" for the default).
    readings : tuple[Reading, ...]
        Every reading that applied (all agree on ``ids``).
    """

    format: str = "default"
    field: str = ""
    readings: tuple = ()


def _source(config) -> tuple[dict, str, str | None]:
    """(config dict, its name for messages, the folder holding its weights or None)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(file, encoding="utf-8") as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise TypeError(f"{file}: a drafter config must be a JSON object, got {type(cfg).__name__}")
        return cfg, file, os.path.dirname(os.path.abspath(file))
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, a config.json path or a folder holding one, "
                        f"not {type(config).__name__}")
    return config, "config", None


def safetensors_keys(path: str) -> list[str] | None:
    """The tensor names in a .safetensors file's header (8-byte little-endian length, then JSON), without
    reading the tensors; None when the file is absent or is not safetensors (a Git LFS pointer, say)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else None


def _ids_fields(cfg: dict) -> dict[str, list[int]]:
    """field -> raw ids, for the fields present (type-checked)."""
    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise TypeError(f'config["eagle_config"] must be a dict, not {type(eagle).__name__}')
    found = {}
    for field, value in ((NESTED, eagle.get(TOP)), (TOP, cfg.get(TOP))):
        if value is not None:
            found[field] = wiring._as_ints(value, field)
    return found


def _reading(fmt, field, convention, raw, num_layers, allow_embedding, why) -> Reading:
    try:
        ours = tuple(wiring.to_output_ids(raw, convention, num_layers, allow_embedding=allow_embedding))
    except ValueError:
        ours = None
    return Reading(fmt, field, convention, tuple(raw), ours, why)


def _producer(cfg: dict, folder: str | None) -> list[tuple[str, str | tuple[str, ...], str]]:
    """The producers whose markers the config carries: (format, convention or conventions, why)."""
    eagle = cfg.get("eagle_config") or {}
    found = []
    declared = eagle.get(wiring.CONVENTION_KEY)
    if declared is not None:
        wiring._check_convention(declared, f"eagle_config.{wiring.CONVENTION_KEY}")
        found.append(("eagle3_ops", declared, f"eagle_config.{wiring.CONVENTION_KEY} says so"))
    if TORCHSPEC_KEY in cfg:
        if cfg.get("model_type") != "kimi_k2":
            found.append(("torchspec", "output", "TorchSpec ids are post-layer"))
        else:
            keys = safetensors_keys(os.path.join(folder, SAFETENSORS)) if folder else None
            native = keys is not None and any(k.startswith("midlayer.") for k in keys)
            for_vllm = keys is not None and any(k.startswith("layers.0.") for k in keys)
            if native != for_vllm:
                found.append(("torchspec", "input" if for_vllm else "output",
                              "a kimi_k2 export for vLLM (+1 to every id; weights layers.0.*)" if for_vllm else
                              "a native kimi_k2 export (weights midlayer.*)"))
            else:  # weights unreadable: convert_to_hf's two kimi_k2 exports share their config.json
                found.append(("torchspec", ("output", "input"),
                              f"a kimi_k2 export, native or for vLLM (+1): only {SAFETENSORS}'s key names "
                              "(midlayer.* or layers.0.*) tell, and they could not be read"))
    if any(k in eagle for k in MODELOPT_KEYS):
        found.append(("modelopt", "output", "ModelOpt hooks the output of layer k"))
    if any(k in cfg for k in SPECULATORS_KEYS):
        found.append(("vllm-speculators", "input", "vLLM captures the input of layer k"))
    return found


def readings(config, num_layers: int, allow_embedding: bool = False) -> tuple[list[Reading], str]:
    """Every reading of a drafter config's ids that its format allows, and the config's name for messages.

    Parameters
    ----------
    config : dict | str | os.PathLike
        The config, its config.json, or a folder holding config.json (and, for a TorchSpec kimi_k2 export,
        model.safetensors, whose key names tell its two exports apart).
    num_layers : int
        Decoder layers of the target.
    allow_embedding : bool
        Accept readings that name the embedding (id -1).

    Returns
    -------
    readings : list[Reading]
        One per (field, convention) that applies; empty when the config has no ids.
    name : str
        The config's file (or "config" for a dict).
    """
    num_layers = wiring._check_num_layers(num_layers)
    cfg, name, folder = _source(config)
    fields = _ids_fields(cfg)
    producers = _producer(cfg, folder)
    out = []
    for field, raw in fields.items():
        covered = [(fmt, conv, why) for fmt, conv, why in producers  # each producer reads what it writes
                   if field in WRITES[fmt]]
        if not covered:  # no producer's marker: the engine that reads this field decides
            if field == NESTED:
                covered = [("sglang", ("sglang-legacy", "sglang-2605"),
                            "SGLang's capture adds 1 to each id and captures that layer's input; since May 2026 "
                            "only when the first id is 1")]
            else:
                covered = [("vllm", "input", "vLLM reads the top-level ids and captures the input of layer k")]
        for fmt, convs, why in covered:
            for conv in (convs,) if isinstance(convs, str) else convs:
                out.append(_reading(fmt, field, conv, raw, num_layers, allow_embedding, why))
    return out, name


def read_drafter_format(config, num_layers: int, allow_embedding: bool = False) -> FormatWiring:
    """Read a drafter's aux ids from a config in any format of ``FORMATS``, in the convention its format implies.

    Parameters
    ----------
    config : dict | str | os.PathLike
        The config, its config.json, or a folder holding config.json.
    num_layers : int
        Decoder layers of the target.
    allow_embedding : bool
        Accept ids that name the embedding.

    Returns
    -------
    wiring : FormatWiring
        Ours (id k = output of layer k), with the format, field and every reading that applied. Raises
        ValueError, naming the file, each field and each reading, when the readings disagree or none is in
        range; a config without ids gets ``wiring.default_aux_ids(num_layers)`` (every producer's default).
    """
    found, name = readings(config, num_layers, allow_embedding)
    num_layers = int(num_layers)
    if not found:
        return FormatWiring(tuple(wiring.default_aux_ids(num_layers)), "output", None, num_layers)
    distinct = {r.ids for r in found}
    if len(distinct) > 1 or None in distinct:
        listed = "; ".join(str(r) for r in found)
        why = "these readings disagree" if len(distinct - {None}) > 1 else "no reading is in range"
        raise ValueError(f"{name}: {why} for a {num_layers}-layer target: {listed}. Say which one the drafter was "
                         f"trained on: set eagle_config.{wiring.CONVENTION_KEY} (or pass convention= to "
                         "wiring.read_drafter_config)")
    first = found[0]
    return FormatWiring(first.ids, first.convention, first.config_ids, num_layers, first.format, first.field,
                        tuple(found))


def export_drafter_config(config: dict, fmt: str, num_layers: int) -> dict:
    """A drafter config.json (ours, ``DrafterConfig.to_hf``) rewritten in format ``fmt``, as its producer writes it.

    Parameters
    ----------
    config : dict
        A config whose ids ``read_drafter_format`` reads unambiguously (ours declares its convention).
    fmt : str
        One of ``FORMATS``.
    num_layers : int
        Decoder layers of the target.

    Returns
    -------
    config : dict
        A new dict: the model fields kept, the ids moved and converted to the format's field and convention,
        the format's marker added (ModelOpt's template keys, TorchSpec's version, the speculators fields). Reads
        back through ``read_drafter_format`` to the same ids.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} is not a drafter format; choose one of {', '.join(FORMATS)}")
    ours = list(read_drafter_format(config, num_layers).ids)
    out = json.loads(json.dumps(config))
    eagle = {k: v for k, v in (out.pop("eagle_config", None) or {}).items()
             if k not in (TOP, wiring.CONVENTION_KEY) + MODELOPT_KEYS}
    out.pop(TOP, None)
    if fmt == "eagle3_ops":
        eagle.update(wiring.drafter_config_fields(ours, "output", num_layers))
        out["eagle_config"] = eagle
    elif fmt in ("sglang", "modelopt", "torchspec"):
        eagle.update({TOP: ours, "use_aux_hidden_state": True})
        if fmt == "modelopt":  # the keys of ModelOpt's export template (hf_spec_configs.py), at its defaults
            eagle.update(use_input_layernorm_in_first_layer=True, use_last_layernorm=False, use_mtp_layernorm=False,
                         next_layer_regular=True, parallel_draft_step=1, parallel_draft_heads_num_layers=1)
        if fmt == "torchspec":
            out[TORCHSPEC_KEY] = "0.1.0"
        out["eagle_config"] = eagle
    else:  # vLLM: top-level ids, its own convention
        out[TOP] = wiring.from_output_ids(ours, "input", num_layers)
        if fmt == "vllm-speculators":  # the speculators library's layout as vLLM's algos.py reads it
            out["architectures"] = ["Eagle3Speculator"]
            out["speculators_model_type"] = "eagle3"
            out["speculators_config"] = {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy"}],
                                         "default_proposal_method": "greedy"}
    back = read_drafter_format(out, num_layers)
    if list(back.ids) != ours:  # e.g. SGLang ids whose first id is not 1 read two ways
        raise ValueError(f"aux ids {ours} cannot be written unambiguously in format {fmt!r}: they read back as "
                         f"{list(back.ids)}")
    return out
