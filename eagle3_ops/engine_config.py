"""SGLang and vLLM launch configurations: what target capture they imply for an EAGLE-3 drafter, against the
wiring it was trained on (``eagle3 diagnose --engine-config PATH``). Plain Python, no torch.

A launch configuration is a file holding the command line (a shell script, ``\\`` continuations and ``#``
comments allowed) or the flags as a JSON or YAML mapping (``sglang.launch_server --config``, ``vllm serve
--config``; keys with dashes or underscores). What each engine does with it, from its source:

- SGLang (sgl-project/sglang python/sglang/srt/server_args.py, model_executor/model_runner.py,
  models/llama.py): ``--speculative-algorithm EAGLE3`` captures aux states, with the ids of the draft
  folder's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (1 added, captured at that layer's input;
  ``wiring``'s "sglang-legacy" / "sglang-2605" readings), or ``[2, L//2, L - 3]`` inputs without them, unless
  ``eagle_config.use_aux_hidden_state`` is false. ``EAGLE`` (EAGLE-2), ``NEXTN``, ``STANDALONE``, ``NGRAM``
  capture nothing: an EAGLE-3 drafter then reads the last hidden state only (the trap of sglang #25673). SGLang
  parses with argparse, so an unambiguous prefix (``--speculative-algo``) is the flag.
- vLLM (vllm-project/vllm vllm/config/speculative.py, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py):
  ``--speculative-config '{"method": "eagle3", "model": DRAFT, ...}'``; ``method`` "eagle3" captures the draft
  config's *top-level* ``eagle_aux_hidden_state_layer_ids`` as inputs of layer k, then ``eagle_config.layer_ids``,
  else ``(2, L//2, L - 3)``: the nested SGLang field is not read. "eagle" captures nothing. No method: vLLM
  names it from the draft path ("eagle-" -> eagle, "eagle3" -> eagle3, else a plain draft model).

Paths are read as written, relative ones from the launch file's folder first, then the current directory.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field

from . import drafter_formats, wiring

SGLANG_FLAGS = ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path",
                "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
SGLANG_ALIASES = {"--model": "--model-path", "--speculative-draft-model": "--speculative-draft-model-path"}
SGLANG_CAPTURE = ("EAGLE3",)
SGLANG_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
VLLM_FLAGS = ("--model", "--speculative-config")


class EngineConfigError(ValueError):
    """A launch configuration that cannot be read; the message names the file and what is wrong."""


@dataclass
class EngineCapture:
    """What a launch configuration makes its engine capture for the drafter, and what it was trained on."""

    engine: str  # "sglang" | "vllm"
    algorithm: str  # as the engine names it: SGLang's --speculative-algorithm, vLLM's method
    target: str
    drafter: str
    num_layers: int
    captures: list = field(default_factory=list)  # (how, ours ids or None = no aux capture); one per reading
    trained: tuple = ()  # ours
    trained_how: str = ""
    findings: list = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return bool(self.captures) and all(ids is not None and tuple(ids) == self.trained for _, ids in self.captures)

    def report(self) -> str:
        lines = [f"engine: {self.engine}, speculative algorithm {self.algorithm}; target {self.target} "
                 f"({self.num_layers} layers); drafter {self.drafter}",
                 f"drafter trained on aux ids {list(self.trained)} (output of layer k; {self.trained_how})"]
        for how, ids in self.captures:
            lines.append(f"engine captures: {'no aux states' if ids is None else f'aux ids {list(ids)}'} ({how})")
        lines += [f"finding: {f}" for f in self.findings]
        if self.matches:
            lines.append(f"OK: the capture this launch implies is the drafter's training wiring {list(self.trained)}.")
        else:
            lines.append(f"MISWIRED: this launch does not capture the drafter's training wiring {list(self.trained)}; "
                         f"`eagle3 diagnose` measures what each wiring costs.")
        return "\n".join(lines)


def _parse_scalar(text: str):
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    try:
        return json.loads(text)
    except ValueError:
        return {"true": True, "false": False, "yes": True, "no": False, "null": None, "~": None}.get(text.lower(), text)


def _parse_yaml(text: str, name: str) -> dict:
    """The YAML subset launch configs use: ``key: value`` lines, one nested level by indentation, flow values
    (``{...}``, ``[...]``) as JSON, quoted or plain scalars, ``#`` comments."""
    top: dict = {}
    nested_key, nested = None, None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        key, colon, value = line.strip().partition(":")
        if not colon or not key:
            raise EngineConfigError(f"{name}:{n}: not a 'key: value' line: {raw.strip()!r}")
        key = key.strip().strip("'\"")
        if indent and nested is not None:
            nested[key] = _parse_scalar(value)
            continue
        if indent:
            raise EngineConfigError(f"{name}:{n}: indented line outside a mapping: {raw.strip()!r}")
        if value.strip():
            top[key], nested_key, nested = _parse_scalar(value), None, None
        else:
            nested_key, nested = key, {}
            top[key] = nested
    return top


def _flags_from_mapping(mapping: dict) -> dict:
    """Mapping keys to '--flag' spelling (dashes)."""
    return {"--" + str(k).lstrip("-").replace("_", "-"): v for k, v in mapping.items()}


def _flags_from_args(tokens: list[str]) -> tuple[dict, list[str]]:
    """'--flag value' / '--flag=value' pairs and the positional arguments of a command line."""
    flags, positional, i = {}, [], 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            key, eq, value = tok.partition("=")
            key = key.replace("_", "-")
            if not eq:
                if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                    value, i = tokens[i + 1], i + 1
                else:
                    value = True
            flags[key] = value
        else:
            positional.append(tok)
        i += 1
    return flags, positional


def _sglang_flag(flag: str, name: str) -> str | None:
    """SGLang's argparse reading of a flag: exact, an alias, or an unambiguous prefix of a known flag."""
    flag = SGLANG_ALIASES.get(flag, flag)
    if flag in SGLANG_FLAGS:
        return flag
    hits = [f for f in SGLANG_FLAGS if f.startswith(flag)]
    if len(hits) > 1 and flag.startswith("--speculative"):
        raise EngineConfigError(f"{name}: {flag} is ambiguous for SGLang's argparse ({', '.join(hits)})")
    return hits[0] if len(hits) == 1 and flag.startswith("--speculative") else None


def read_launch(path: str) -> tuple[str, dict]:
    """(engine, flags) of a launch file: "sglang" or "vllm", and its flags in SGLang's / vLLM's spelling."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise EngineConfigError(f"{path}: cannot read it ({e.strerror})") from None
    lines = [line for line in text.replace("\\\n", " ").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    if text.lstrip().startswith("{"):
        try:
            flags = _flags_from_mapping(json.loads(text))
        except ValueError as e:
            raise EngineConfigError(f"{path}: not valid JSON ({e})") from None
    elif lines and all(" --" not in f" {line}" for line in lines):  # flags as a YAML mapping
        flags = _flags_from_mapping(_parse_yaml(text, path))
    else:  # a command line
        try:
            tokens = shlex.split(" ".join(lines), comments=True)
        except ValueError as e:
            raise EngineConfigError(f"{path}: cannot split the command line ({e})") from None
        flags, positional = _flags_from_args(tokens)
        if "serve" in positional and positional.index("serve") + 1 < len(positional):  # vllm serve MODEL
            flags.setdefault("--model", positional[positional.index("serve") + 1])
    if "--speculative-config" in flags:
        return "vllm", _vllm_flags(flags, path)
    sgl = {}
    for k, v in flags.items():
        known = _sglang_flag(k, path)
        if known:
            sgl[known] = v
    if "--speculative-algorithm" not in sgl:
        raise EngineConfigError(f"{path}: no speculative decoding flags: expected SGLang's --speculative-algorithm "
                                "(with --speculative-draft-model-path) or vLLM's --speculative-config")
    return "sglang", sgl


def _vllm_flags(flags: dict, name: str) -> dict:
    spec = flags.get("--speculative-config")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise EngineConfigError(f"{name}: --speculative-config is not a JSON object ({e})") from None
    if not isinstance(spec, dict):
        raise EngineConfigError(f"{name}: --speculative-config must be a JSON object with method and model, got "
                                f"{spec!r}")
    return {"--model": flags.get("--model"), "--speculative-config": spec}


def _local(path, base: str, what: str, name: str) -> str:
    if not isinstance(path, str) or not path:
        raise EngineConfigError(f"{name}: {what} is missing")
    for p in ([path] if os.path.isabs(path) else [os.path.join(base, path), path]):
        if os.path.isfile(os.path.join(p, "config.json")):
            return os.path.normpath(p)
    raise EngineConfigError(f"{name}: {what} {path!r} is not a local folder holding config.json (a hub id must be "
                            "downloaded first)")


def _num_layers(target: str, name: str) -> int:
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or {}
    n = cfg.get("num_hidden_layers", text.get("num_hidden_layers") if isinstance(text, dict) else None)
    if not isinstance(n, int) or n < 1:
        raise EngineConfigError(f"{name}: the target's config.json ({target}) has no num_hidden_layers")
    return n


def _sglang_capture(draft_cfg: dict, num_layers: int) -> list:
    eagle = draft_cfg.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        return [("eagle_config.use_aux_hidden_state is false", None)]
    raw = eagle.get(wiring.IDS_KEY)
    if raw is None:
        return [("no eagle_config ids: SGLang's default [2, L//2, L - 3] layer inputs",
                 tuple(wiring.default_aux_ids(num_layers)))]
    out = []
    for conv in ("sglang-legacy", "sglang-2605"):
        try:
            ids = tuple(wiring.to_output_ids(raw, conv, num_layers, allow_embedding=True))
        except ValueError as e:
            raise EngineConfigError(f"the drafter's eagle_config.{wiring.IDS_KEY} = {raw}: {e}") from None
        if all(ids != seen for _, seen in out):
            out.append((f"eagle_config.{wiring.IDS_KEY} = {raw} read as {conv!r}", ids))
    return out


def _vllm_capture(draft_cfg: dict, num_layers: int) -> list:
    raw = draft_cfg.get(wiring.IDS_KEY)
    how = f"top-level {wiring.IDS_KEY} = {raw} as layer inputs ('input')"
    if not raw:
        eagle = draft_cfg.get("eagle_config") or {}
        raw = eagle.get("layer_ids") if isinstance(eagle, dict) else None
        how = f"eagle_config.layer_ids = {raw} as layer inputs ('input')"
    if not raw:
        nested = (draft_cfg.get("eagle_config") or {}).get(wiring.IDS_KEY)
        note = f"; it does not read eagle_config.{wiring.IDS_KEY} = {nested}" if nested is not None else ""
        return [(f"no top-level ids: vLLM's default (2, L//2, L - 3) layer inputs{note}",
                 tuple(wiring.default_aux_ids(num_layers)))]
    try:
        return [(how, tuple(wiring.to_output_ids(raw, "input", num_layers, allow_embedding=True)))]
    except ValueError as e:
        raise EngineConfigError(f"the drafter's {how}: {e}") from None


def check_launch(path: str) -> EngineCapture:
    """Read a launch file and its drafter: the capture the engine will make and the wiring the drafter was
    trained on (``drafter_formats.read_drafter_format``). Raises EngineConfigError (one line) when the file,
    its paths or the drafter's config cannot be read."""
    engine, flags = read_launch(path)
    base = os.path.dirname(os.path.abspath(path))
    if engine == "sglang":
        algorithm = str(flags["--speculative-algorithm"]).upper()
        if algorithm not in SGLANG_ALGORITHMS:
            raise EngineConfigError(f"{path}: --speculative-algorithm {flags['--speculative-algorithm']} is not one of "
                                    f"SGLang's {', '.join(SGLANG_ALGORITHMS)}")
        target_flag, draft = flags.get("--model-path"), flags.get("--speculative-draft-model-path")
    else:
        spec = flags["--speculative-config"]
        target_flag, draft = flags.get("--model"), spec.get("model")
        algorithm = spec.get("method")
        if algorithm is None and isinstance(draft, str):  # vLLM's detection from the draft path
            low = draft.lower()
            algorithm = "eagle" if "eagle-" in low else "eagle3" if "eagle3" in low else "draft_model"
    target = _local(target_flag, base, "the target (--model-path / --model)", path)
    drafter = _local(draft, base, "the draft model path", path)
    num_layers = _num_layers(target, path)
    with open(os.path.join(drafter, "config.json"), encoding="utf-8") as f:
        draft_cfg = json.load(f)
    try:
        trained = drafter_formats.read_drafter_format(drafter, num_layers, allow_embedding=True)
    except (ValueError, TypeError) as e:
        raise EngineConfigError(f"the drafter's training wiring is unclear: {e}") from None
    how = f"{trained.format} format" + (f", {trained.field} = {list(trained.config_ids)} read as "
                                        f"{trained.convention!r}" if trained.config_ids is not None else ", no ids")
    cap = EngineCapture(engine, str(algorithm), target, drafter, num_layers, trained=tuple(trained.ids),
                        trained_how=how)
    captures_aux = algorithm in SGLANG_CAPTURE if engine == "sglang" else algorithm == "eagle3"
    if not captures_aux:
        cap.captures = [(f"{algorithm} is not EAGLE-3: the target hands the drafter its last hidden state only", None)]
        fix = "--speculative-algorithm EAGLE3" if engine == "sglang" else '"method": "eagle3"'
        cap.findings.append(f"the launch runs {algorithm}, not EAGLE-3, so no aux states are captured and the "
                            f"EAGLE-3 drafter is fed the wrong features: use {fix}")
        return cap
    cap.captures = _sglang_capture(draft_cfg, num_layers) if engine == "sglang" else \
        _vllm_capture(draft_cfg, num_layers)
    if len(cap.captures) > 1:
        cap.findings.append("SGLang's reading of these ids changed in May 2026; the capture depends on the SGLang "
                            f"version: write the ids so both read alike (first id 1) or declare "
                            f"eagle_config.{wiring.CONVENTION_KEY}")
    for how_, ids in cap.captures:
        if ids is not None and tuple(ids) != cap.trained:
            cap.findings.append(f"captured {list(ids)} ({how_}) is not the trained {list(cap.trained)}")
    return cap
