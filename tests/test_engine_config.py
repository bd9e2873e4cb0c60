"""`eagle3 diagnose --engine-config PATH`: SGLang and vLLM launch configurations (written by us after their
documented flags, tests/data/launch/) read for the capture they imply, against the shipped drafter's training
wiring [1, 5, 6]. Torch-free: the command answers before torch loads."""

import os

import pytest

from eagle3_ops import engine_config as E

LAUNCH = os.path.join(os.path.dirname(__file__), "data", "launch")
TRAINED = (1, 5, 6)


def _check(name):
    return E.check_launch(os.path.join(LAUNCH, name))


@pytest.mark.parametrize("name, engine", [("sglang_eagle3.sh", "sglang"), ("sglang.yaml", "sglang"),
                                          ("vllm_eagle3.sh", "vllm")])
def test_wired_launches_match(name, engine):
    found = _check(name)
    assert (found.engine, found.num_layers, found.trained) == (engine, 8, TRAINED)
    assert found.matches and found.captures and not found.findings, found.report()
    assert found.report().endswith(f"the drafter's training wiring {list(TRAINED)}.")


@pytest.mark.parametrize("name, fix", [("sglang_eagle_trap.sh", "--speculative-algorithm EAGLE3"),
                                       ("vllm_eagle.json", '"method": "eagle3"')])
def test_eagle_instead_of_eagle3_is_the_trap(name, fix):
    found = _check(name)
    assert found.algorithm.upper() == "EAGLE" and not found.matches
    assert found.captures == [(found.captures[0][0], None)]  # no aux capture at all
    assert any("not EAGLE-3" in f and fix in f for f in found.findings), found.report()
    assert "MISWIRED" in found.report()


def test_vllm_does_not_read_nested_ids():
    """An SGLang/SpecForge-format drafter (ids only in eagle_config) served by vLLM gets vLLM's default capture."""
    found = _check("vllm_nested_ids.yaml")
    assert found.captures[0][1] == (1, 3, 4) and not found.matches  # (2, L//2, L - 3) inputs of an 8-layer target
    assert "does not read eagle_config" in found.report()


def _launch(tmp_path, text, draft="draft", draft_cfg=None):
    import json

    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 61}))
    (tmp_path / draft).mkdir(exist_ok=True)
    (tmp_path / draft / "config.json").write_text(json.dumps(draft_cfg or {}))
    path = tmp_path / "launch.sh"
    path.write_text(text)
    return str(path)


def test_sglang_version_dependent_reading(tmp_path):
    path = _launch(tmp_path, "python -m sglang.launch_server --model-path target --speculative-algorithm EAGLE3 "
                             "--speculative-draft-model-path draft\n",
                   draft_cfg={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58],
                                               "eagle_aux_hidden_state_layer_convention": "input"}})
    found = E.check_launch(path)
    assert [ids for _, ids in found.captures] == [(2, 30, 58), (1, 29, 57)]  # SGLang before / since May 2026
    assert found.trained == (1, 29, 57) and not found.matches
    assert any("depends on the SGLang version" in f for f in found.findings)


def test_vllm_method_named_from_the_draft_path(tmp_path):
    path = _launch(tmp_path, "vllm serve target --speculative-config '{\"model\": \"EAGLE3-drafter\"}'",
                   draft="EAGLE3-drafter", draft_cfg={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]})
    found = E.check_launch(path)
    assert (found.algorithm, found.captures[0][1], found.matches) == ("eagle3", (1, 29, 57), True)


@pytest.mark.parametrize("text, pattern", [
    ("python -m sglang.launch_server --model-path target\n", "no speculative decoding flags"),
    ("vllm serve target --speculative-config '{not json'\n", "not a JSON object"),
    ("python -m sglang.launch_server --model-path target --speculative-algorithm MEDUSA "
     "--speculative-draft-model-path draft\n", "not one of SGLang's"),
    ("python -m sglang.launch_server --model-path target --speculative-algorithm EAGLE3 "
     "--speculative-draft-model-path lmsys/hub-id\n", "not a local folder"),
    ("model-path target\n", "not a 'key: value' line"),
])
def test_unreadable_launches_name_the_problem(tmp_path, text, pattern):
    with pytest.raises(E.EngineConfigError, match=pattern):
        E.check_launch(_launch(tmp_path, text))


def test_ambiguous_drafter_is_refused(tmp_path):
    path = _launch(tmp_path, "python -m sglang.launch_server --model-path target --speculative-algorithm EAGLE3 "
                             "--speculative-draft-model-path draft\n",
                   draft_cfg={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}})
    with pytest.raises(E.EngineConfigError, match="training wiring is unclear.*'sglang-legacy'.*'sglang-2605'"):
        E.check_launch(path)


def test_cli_exit_codes(capsys, tmp_path):
    from eagle3_ops.cli import main

    assert main(["diagnose", "--engine-config", os.path.join(LAUNCH, "sglang_eagle3.sh")]) == 0
    assert "OK:" in capsys.readouterr().out
    assert main(["diagnose", "--engine-config", os.path.join(LAUNCH, "sglang_eagle_trap.sh")]) == 3
    assert "not EAGLE-3" in capsys.readouterr().out
    assert main(["diagnose", "--engine-config", str(tmp_path / "absent.sh")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("eagle3 diagnose: --engine-config ") and "cannot read" in err
    assert main(["diagnose", "--engine-config", os.path.join(LAUNCH, "sglang.yaml"), "--aux-ids", "1", "5", "6"]) == 2
    assert "exclude each other" in capsys.readouterr().err
