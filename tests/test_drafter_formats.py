"""Drafter config formats (eagle3_ops.drafter_formats): every format the shipped pair is exported in reads back
to its wiring, each format in its producer's convention; a config that two readings explain differently is
refused with both named. Plain Python, no torch."""

import ast
import json
import os
import struct

import pytest

from eagle3_ops import drafter_formats as F
from eagle3_ops import wiring

HERE = os.path.dirname(__file__)
EXPORTS = os.path.join(HERE, "data", "byte-small-formats")  # <format>/config.json: the shipped drafter's
SHIPPED = os.path.join(HERE, os.pardir, "eagle3_ops", "assets", "byte-small", "drafter", "config.json")
TRAINED, LAYERS = (1, 5, 6), 8  # the shipped drafter: outputs of layers 1, 5, 6 of its 8-layer target
KIMI = 61
# the field each format keeps its ids in, and the ids as written there for TRAINED
WRITTEN = {"eagle3_ops": (F.NESTED, (1, 5, 6)), "sglang": (F.NESTED, (1, 5, 6)), "modelopt": (F.NESTED, (1, 5, 6)),
           "torchspec": (F.NESTED, (1, 5, 6)), "vllm-speculators": (F.TOP, (2, 6, 7)), "vllm": (F.TOP, (2, 6, 7))}


def _shipped() -> dict:
    with open(SHIPPED, encoding="utf-8") as f:
        return json.load(f)


def _write_safetensors(path, names):
    """A valid .safetensors file holding one fp32 scalar per name (only the header matters here)."""
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"\0" * (4 * len(names)))


def test_module_is_torch_free():
    tree = ast.parse(open(F.__file__, encoding="utf-8").read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "torch"], names


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_every_exported_format_reads_back_to_the_trained_wiring(fmt):
    w = F.read_drafter_format(os.path.join(EXPORTS, fmt), LAYERS)  # the folder, as engines take it
    field, written = WRITTEN[fmt]
    assert w.ids == TRAINED  # ours: id k = output of layer k
    assert (w.format, w.field, w.config_ids) == (fmt, field, written)
    assert all(r.ids == TRAINED for r in w.readings)


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_exports_are_the_writer_output(fmt):
    """The files under tests/data are export_drafter_config's output for the shipped config (regenerable)."""
    with open(os.path.join(EXPORTS, fmt, "config.json"), encoding="utf-8") as f:
        assert json.load(f) == F.export_drafter_config(_shipped(), fmt, LAYERS)


def test_shipped_config_and_folder():
    assert F.read_drafter_format(SHIPPED, LAYERS).format == "eagle3_ops"
    assert F.read_drafter_format(os.path.dirname(SHIPPED), LAYERS).ids == TRAINED


def test_markers_name_the_producer():
    # real configs' shapes: SpecForge configs/deepseek-v3-671b-eagle3.json; a ModelOpt export; vLLM speculators
    specforge = {"architectures": ["LlamaForCausalLMEagle3"],
                 "eagle_config": {F.TOP: [1, 29, 57], "use_aux_hidden_state": True}}
    w = F.read_drafter_format(specforge, KIMI)
    assert (w.format, w.ids) == ("sglang", (1, 29, 57))
    assert {r.convention for r in w.readings} == {"sglang-legacy", "sglang-2605"}  # both SGLang readings agree
    modelopt = {"eagle_config": {F.TOP: [1, 29, 57], "next_layer_regular": True, "parallel_draft_step": 1}}
    assert (F.read_drafter_format(modelopt, KIMI).format, F.read_drafter_format(modelopt, KIMI).ids) == \
        ("modelopt", (1, 29, 57))
    # a speculators conversion of an SGLang-trained drafter that kept [1, 46, 90] as written: vLLM reads it one
    # layer early (the reader says what vLLM captures; eagle3 diagnose tells whether it is what was trained)
    speculators = {"speculators_model_type": "eagle3", F.TOP: [1, 46, 90]}
    assert F.read_drafter_format(speculators, 94).ids == (0, 45, 89)
    assert F.read_drafter_format({F.TOP: [2, 30, 58]}, KIMI).ids == (1, 29, 57)  # plain top level: vLLM's


def test_no_ids_is_every_producers_default():
    for cfg in ({}, {"eagle_config": {"use_aux_hidden_state": True}}, {"speculators_model_type": "eagle3"}):
        w = F.read_drafter_format(cfg, KIMI)
        assert (w.ids, w.format, w.config_ids) == ((1, 29, 57), "default", None)


def test_sglang_ids_read_two_ways_are_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"eagle_config": {F.TOP: [2, 30, 58]}}))
    with pytest.raises(ValueError) as e:
        F.read_drafter_format(tmp_path, KIMI)
    msg = str(e.value)
    assert str(path) in msg and "eagle_config.eagle_aux_hidden_state_layer_ids" in msg
    assert "'sglang-legacy' -> aux ids [2, 30, 58]" in msg and "'sglang-2605' -> aux ids [1, 29, 57]" in msg
    assert wiring.CONVENTION_KEY in msg  # and how to settle it
    # declared, the same ids read one way
    path.write_text(json.dumps({"eagle_config": {F.TOP: [2, 30, 58], wiring.CONVENTION_KEY: "input"}}))
    assert F.read_drafter_format(path, KIMI).ids == (1, 29, 57)


def test_torchspec_kimi_export_needs_its_weights(tmp_path):
    """convert_to_hf writes the same config.json for a native kimi_k2 export and one for vLLM (+1 to every id):
    only the weights' key names tell them apart."""
    cfg = {"_torchspec_version": "0.1.0", "model_type": "kimi_k2", "eagle_config": {F.TOP: [2, 30, 58]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'output' -> aux ids \[2, 30, 58\].*'input' -> aux ids \[1, 29, 57\]"):
        F.read_drafter_format(tmp_path, KIMI)
    _write_safetensors(tmp_path / F.SAFETENSORS, ["layers.0.self_attn.q_proj.weight", "fc.weight"])
    w = F.read_drafter_format(tmp_path, KIMI)
    assert (w.format, w.convention, w.ids) == ("torchspec", "input", (1, 29, 57))
    _write_safetensors(tmp_path / F.SAFETENSORS, ["midlayer.self_attn.q_proj.weight", "fc.weight"])
    assert F.read_drafter_format(tmp_path, KIMI).ids == (2, 30, 58)
    cfg["model_type"] = "llama"  # other models keep their ids in both exports
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert F.read_drafter_format(tmp_path, KIMI).ids == (2, 30, 58)


def test_disagreeing_fields_and_markers_are_refused():
    # a ModelOpt export (nested ids) with a top-level field that vLLM reads one layer early
    modelopt = {"next_layer_regular": True, F.TOP: [2, 30, 58]}
    both = {F.TOP: [2, 30, 58], "eagle_config": dict(modelopt)}
    pattern = r"modelopt: eagle_config.*-> aux ids \[2, 30, 58\].*vllm: .*-> aux ids \[1, 29, 57\]"
    with pytest.raises(ValueError, match=pattern):
        F.read_drafter_format(both, KIMI)
    agree = {F.TOP: [2, 30, 58], "eagle_config": dict(modelopt, **{F.TOP: [1, 29, 57]})}
    assert F.read_drafter_format(agree, KIMI).ids == (1, 29, 57)
    # two producers' markers: a TorchSpec export that also carries ModelOpt's keys agrees ('output' both)
    assert F.read_drafter_format({"_torchspec_version": "0.1.0", "eagle_config": modelopt}, KIMI).ids == (2, 30, 58)
    # ours declares 'input' while ModelOpt's keys say 'output'
    with pytest.raises(ValueError, match="these readings disagree"):
        F.read_drafter_format({"eagle_config": dict(modelopt, **{wiring.CONVENTION_KEY: "input"})}, KIMI)
    with pytest.raises(ValueError, match="no reading is in range"):
        F.read_drafter_format({F.TOP: [0, 29, 57]}, KIMI)  # vLLM's 0 is the embedding
    assert F.read_drafter_format({F.TOP: [0, 29, 57]}, KIMI, allow_embedding=True).ids == (-1, 28, 56)


def test_safetensors_keys_of_a_pointer_or_missing_file(tmp_path):
    pointer = tmp_path / "model.safetensors"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 3\n")
    assert F.safetensors_keys(str(pointer)) is None
    assert F.safetensors_keys(str(tmp_path / "absent.safetensors")) is None
    _write_safetensors(pointer, ["a", "b"])
    assert F.safetensors_keys(str(pointer)) == ["a", "b"]


@pytest.mark.parametrize("config, exc, pattern", [
    ("not json", ValueError, "not valid JSON"),
    ("[1, 2]", TypeError, "JSON object"),
    (json.dumps({"eagle_config": [1]}), TypeError, "eagle_config"),
    (json.dumps({F.TOP: "1,5,6"}), TypeError, "list of ints"),
])
def test_bad_files_name_the_problem(tmp_path, config, exc, pattern):
    path = tmp_path / "config.json"
    path.write_text(config)
    with pytest.raises(exc, match=pattern):
        F.read_drafter_format(path, LAYERS)


def test_export_refuses_what_its_format_cannot_say():
    cfg = {"eagle_config": wiring.drafter_config_fields([2, 30, 58], "output", KIMI)}
    with pytest.raises(ValueError, match="disagree"):
        F.export_drafter_config(cfg, "sglang", KIMI)  # SGLang's two readings of [2, 30, 58] differ
    assert F.read_drafter_format(F.export_drafter_config(cfg, "modelopt", KIMI), KIMI).ids == (2, 30, 58)
    with pytest.raises(ValueError, match="fmt='trtllm'"):
        F.export_drafter_config(cfg, "trtllm", KIMI)
