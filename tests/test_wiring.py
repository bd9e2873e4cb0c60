"""Aux-id wiring: conventions, validation, drafter-config reading and capture sites (plain Python, no GPU)."""

import ast
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_ops import wiring

KIMI_LAYERS = 61  # Kimi-K2 / K2.5 and DeepSeek-V3 targets
KIMI_OURS = [1, 29, 57]  # outputs of layers 1, 29, 57: what every shipped Kimi drafter was trained on
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
CONV_KEY = "eagle_aux_hidden_state_layer_convention"


def test_wiring_does_not_import_torch():
    # wiring is plain Python so configs can be checked on machines without torch; and it imports no other
    # eagle3_ops module: diagnose and the engine import wiring, so the reverse would be an import cycle
    tree = ast.parse(open(wiring.__file__, encoding="utf-8").read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("torch", "eagle3_ops")], names
    relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative


def test_kimi_default():
    assert wiring.default_aux_ids(KIMI_LAYERS) == KIMI_OURS


def test_kimi_input_convention():
    # AQ-MedAI / SpecForge Kimi configs ship [2, 30, 58]: HF output_hidden_states indices
    assert wiring.to_output_ids([2, 30, 58], "input", KIMI_LAYERS) == KIMI_OURS


def test_kimi_sglang_legacy():
    assert wiring.to_output_ids([1, 29, 57], "sglang-legacy", KIMI_LAYERS) == KIMI_OURS
    # The miswiring: legacy SGLang added +1 to [2, 30, 58] and captured the inputs of layers 3, 31, 59,
    # i.e. the outputs of 2, 30, 58 -- one layer late in every slot for a drafter trained on 1, 29, 57.
    assert wiring.to_output_ids([2, 30, 58], "sglang-legacy", KIMI_LAYERS) == [2, 30, 58]


def test_kimi_sglang_2605_reads_both_forms():
    assert wiring.to_output_ids([1, 29, 57], "sglang-2605", KIMI_LAYERS) == KIMI_OURS
    assert wiring.to_output_ids([2, 30, 58], "sglang-2605", KIMI_LAYERS) == KIMI_OURS


def test_input_zero_is_the_embedding():
    with pytest.raises(ValueError, match="embedding.*allow_embedding=True"):
        wiring.to_output_ids([0, 30, 58], "input", KIMI_LAYERS)
    assert wiring.to_output_ids([0, 30, 58], "input", KIMI_LAYERS, allow_embedding=True) == [-1, 29, 57]


def test_order_is_kept_never_sorted():
    # slot order decides the fc input's concat order; sorting silently would permute the drafter's input
    assert wiring.to_output_ids([58, 2, 30], "input", KIMI_LAYERS) == [57, 1, 29]
    assert wiring.validate_aux_ids([57, 1, 29], KIMI_LAYERS) == [57, 1, 29]


@pytest.mark.parametrize("num_layers", [1, 2, 3, 4, 5, 6])  # every L whose default is invalid
def test_default_refused_for_small_targets(num_layers):
    with pytest.raises(ValueError, match="pass aux ids explicitly"):
        wiring.default_aux_ids(num_layers)


@pytest.mark.parametrize("num_layers", [7, 8, 32, 61, 99])  # 7: smallest valid (1, 2, 3)
def test_default_valid(num_layers):
    ids = wiring.default_aux_ids(num_layers)
    assert wiring.validate_aux_ids(ids, num_layers) == ids == [1, num_layers // 2 - 1, num_layers - 4]


@pytest.mark.parametrize(
    "ids, exc, pattern",
    [
        ([1, 29, 29], ValueError, r"ids\[2\].*duplicate of ids\[1\]"),
        ([1, 29, 61], ValueError, r"ids\[2\]: aux id 61, out of range for a 61-layer target \(valid: 0\.\.60"),
        ([-1, 29, 57], ValueError, r"ids\[0\].*embedding; pass allow_embedding=True"),
        ([-2, 29, 57], ValueError, r"ids\[0\].*out of range"),
        ([1, True, 57], TypeError, r"ids\[1\] = True is a bool"),
        ([1, 29.0, 57], TypeError, r"ids\[1\] = 29\.0 is a float"),
        ([], ValueError, r"ids is empty"),
        ("1,29,57", TypeError, r"ids must be a list of ints"),
        (57, TypeError, r"ids must be a list of ints"),
    ],
)
def test_validate_refusals_name_the_argument(ids, exc, pattern):
    with pytest.raises(exc, match=pattern):
        wiring.validate_aux_ids(ids, KIMI_LAYERS)


def test_validate_embedding_allowed():
    assert wiring.validate_aux_ids((-1, 29, 57), KIMI_LAYERS, allow_embedding=True) == [-1, 29, 57]


def test_unknown_convention_names_every_choice():
    with pytest.raises(ValueError) as e:
        wiring.to_output_ids([2, 30, 58], "hf", KIMI_LAYERS)
    for name in wiring.CONVENTIONS:
        assert repr(name) in str(e.value) and wiring.CONVENTION_DESCRIPTIONS[name] in str(e.value)
    with pytest.raises(ValueError, match="'sglang-2605'"):
        wiring.from_output_ids(KIMI_OURS, "sglang", KIMI_LAYERS)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(data=st.data(), num_layers=st.integers(1, 99), convention=st.sampled_from(wiring.CONVENTIONS))
def test_from_output_ids_round_trips(data, num_layers, convention):
    ids = data.draw(st.lists(st.integers(-1, num_layers - 1), min_size=1, max_size=5, unique=True))
    if convention == "sglang-2605" and ids[0] == 0:
        # written as 0.. it reads as -1.., written as 1.. it reads as 1..: no config says "output of layer 0 first"
        with pytest.raises(ValueError, match="cannot be written"):
            wiring.from_output_ids(ids, convention, num_layers)
        return
    written = wiring.from_output_ids(ids, convention, num_layers)
    assert wiring.to_output_ids(written, convention, num_layers, allow_embedding=True) == ids
    fields = wiring.drafter_config_fields(ids, convention, num_layers=num_layers)
    got = wiring.read_drafter_config({"eagle_config": fields}, num_layers, allow_embedding=True)
    assert list(got.ids) == ids and got.convention == convention and list(got.config_ids) == written


def test_from_output_ids_examples():
    assert wiring.from_output_ids(KIMI_OURS, "input", KIMI_LAYERS) == [2, 30, 58]
    assert wiring.from_output_ids(KIMI_OURS, "sglang-2605", KIMI_LAYERS) == KIMI_OURS
    assert wiring.from_output_ids([5, 29, 57], "sglang-2605", KIMI_LAYERS) == [6, 30, 58]
    assert wiring.from_output_ids([60], "input", KIMI_LAYERS) == [61]  # the last layer's pre-norm output
    with pytest.raises(ValueError, match="cannot be written in convention 'sglang-2605'"):
        wiring.from_output_ids([0, 29, 57], "sglang-2605", KIMI_LAYERS)
    with pytest.raises(ValueError, match="out of range"):
        wiring.from_output_ids([61], "output", KIMI_LAYERS)


def _kimi_config(ids, **eagle):
    return {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {IDS_KEY: ids, **eagle}}


def test_read_from_dict_file_and_folder(tmp_path):
    cfg = _kimi_config([2, 30, 58], **{CONV_KEY: "input"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for source in (cfg, tmp_path / "config.json", str(tmp_path / "config.json"), tmp_path, str(tmp_path)):
        w = wiring.read_drafter_config(source, KIMI_LAYERS)
        assert w == wiring.AuxWiring((1, 29, 57), "input", (2, 30, 58), KIMI_LAYERS)
    assert str(w) == "aux ids [1, 29, 57]: outputs of layers 1, 29, 57 of 61 (config [2, 30, 58] read as 'input')"


def test_read_convention_argument():
    w = wiring.read_drafter_config(_kimi_config([2, 30, 58]), KIMI_LAYERS, convention="sglang-2605")
    assert w.ids == (1, 29, 57) and w.convention == "sglang-2605"
    top = {IDS_KEY: [1, 29, 57]}  # vLLM speculators configs lift the key to the top level
    assert wiring.read_drafter_config(top, KIMI_LAYERS, convention="output").ids == (1, 29, 57)


def test_read_ambiguous_refused_with_every_convention_named():
    with pytest.raises(ValueError) as e:
        wiring.read_drafter_config(_kimi_config([2, 30, 58]), KIMI_LAYERS)
    msg = str(e.value)
    for name in wiring.CONVENTIONS:
        assert repr(name) in msg, name
    assert "[2, 30, 58]" in msg and "1, 29, 57" in msg and "convention=" in msg


def test_read_conflicts_refused():
    cfg = _kimi_config([2, 30, 58], **{CONV_KEY: "input"})
    with pytest.raises(ValueError, match="convention='output' disagrees.*'input'"):
        wiring.read_drafter_config(cfg, KIMI_LAYERS, convention="output")
    both = {IDS_KEY: [1, 29, 57], "eagle_config": {IDS_KEY: [2, 30, 58], CONV_KEY: "input"}}
    with pytest.raises(ValueError, match="disagree"):
        wiring.read_drafter_config(both, KIMI_LAYERS)
    both[IDS_KEY] = [2, 30, 58]  # equal copies are fine
    assert wiring.read_drafter_config(both, KIMI_LAYERS).ids == (1, 29, 57)
    with pytest.raises(ValueError, match=f"{CONV_KEY}.*'hf' is not a known"):
        wiring.read_drafter_config(_kimi_config([2, 30, 58], **{CONV_KEY: "hf"}), KIMI_LAYERS)


def test_read_without_ids_uses_default():
    for cfg in ({}, {"eagle_config": {}}, {"eagle_config": None, "hidden_size": 7168}):
        w = wiring.read_drafter_config(cfg, KIMI_LAYERS)
        assert w == wiring.AuxWiring((1, 29, 57), "output", None, KIMI_LAYERS)
    assert "(default)" in str(w)


@pytest.mark.parametrize(
    "ids, exc, pattern",
    [
        ([1, 29, 29], ValueError, r"\[2\] = 29 read as 'output' is aux id 29, a duplicate"),
        ([1, 29, 61], ValueError, r"\[2\] = 61 read as 'output' is aux id 61, out of range"),
        ([1, False, 57], TypeError, r"\[1\] = False is a bool"),
        ([], ValueError, r"is empty"),
    ],
)
def test_read_refusals_name_the_config_key(ids, exc, pattern):
    with pytest.raises(exc, match=r'config\["eagle_config"\]\["eagle_aux_hidden_state_layer_ids"\]' + ".*" + pattern):
        wiring.read_drafter_config(_kimi_config(ids), KIMI_LAYERS, convention="output")


def test_read_embedding_needs_allow_embedding():
    cfg = _kimi_config([0, 30, 58], **{CONV_KEY: "input"})
    with pytest.raises(ValueError, match=r"\[0\] = 0 read as 'input' is aux id -1, the embedding"):
        wiring.read_drafter_config(cfg, KIMI_LAYERS)
    w = wiring.read_drafter_config(cfg, KIMI_LAYERS, allow_embedding=True)
    assert w.ids == (-1, 29, 57) and "embedding, 29, 57" in str(w)


def test_drafter_config_fields():
    assert wiring.drafter_config_fields(KIMI_OURS, "input", num_layers=KIMI_LAYERS) == {
        IDS_KEY: [2, 30, 58], CONV_KEY: "input"}
    assert wiring.drafter_config_fields(KIMI_OURS, num_layers=KIMI_LAYERS) == {IDS_KEY: KIMI_OURS, CONV_KEY: "output"}
    with pytest.raises(TypeError, match="num_layers"):
        wiring.drafter_config_fields(KIMI_OURS)


def test_capture_sites_kimi():
    assert wiring.capture_sites(KIMI_OURS, KIMI_LAYERS) == [(2, 0), (30, 1), (58, 2)]
    # unsorted slots: sites come out in forward order, each still tagged with its slot
    assert wiring.capture_sites([57, 1, 60], KIMI_LAYERS) == [(2, 1), (58, 0), (61, 2)]  # 61 = final norm


def test_capture_sites_four_layers():
    # 4 layers: site 0 = embedding, site k+1 = input norm of layer k+1, site 4 = the final norm
    assert wiring.capture_sites([3, 0, 2], 4) == [(1, 1), (3, 2), (4, 0)]
    assert wiring.capture_sites([-1, 1], 4) == [(0, 0), (2, 1)]
    with pytest.raises(ValueError, match="out of range for a 4-layer target"):
        wiring.capture_sites([4], 4)
