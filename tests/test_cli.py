"""The `eagle3` command's user errors: one line on stderr naming the flag, exit code 2, no traceback, and
no model loaded (checked before torch: eagle3_ops.cli.check_args); `--help` fast and torch-free."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import eagle3_ops
from eagle3_ops import _startup, cli
from eagle3_ops.engine import SpecConfig

ROOT = Path(__file__).resolve().parent.parent
# the package's __init__ asks _startup.defer() before torch: without that gate `--help` still loads torch
HELP_SECONDS = 2.0  # generous for a loaded CI machine; about 0.1 s idle (torch alone takes 2-3 s)


@pytest.fixture
def no_models(monkeypatch):
    """A usage error must be found before any model loads."""
    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")
    monkeypatch.setattr(cli, "_load_pair", loaded)


def _run(argv, capsys):
    """(exit code, stderr) of the command run in-process."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's per-flag types exit from parse_args
        rc = e.code
    return rc, capsys.readouterr().err


MISTAKES = [  # argv, what the one line must name
    (["demo", "--batch", "0"], "--batch: must be >= 1, got 0"),
    (["demo", "--batch", "100"], "--batch must be at most 64 without --prompt"),
    (["demo", "--max-new", "0"], "--max-new: must be >= 1, got 0"),
    (["demo", "--steps", "0"], "--steps: must be >= 1"),
    (["demo", "--topk", "0"], "--topk: must be >= 1, got 0"),
    (["demo", "--tokens", "1"], "--tokens: must be >= 2, got 1"),
    (["demo", "--tokens", "5"], "--tokens must be in [2, 4] for --steps 3 --topk 1"),
    (["demo", "--steps", "2", "--topk", "2", "--tokens", "8"], "--tokens must be in [2, 7] for --steps 2 --topk 2"),
    (["demo", "--temperature", "-1"], "--temperature: must be a finite number >= 0, got -1"),
    (["demo", "--temperature", "nan"], "--temperature: must be a finite number >= 0"),
    (["demo", "--oracle", "1.5"], "--oracle: must be a finite number in [0, 1], got 1.5"),
    (["demo", "--oracle", "0.9", "--temperature", "1"], "--oracle needs greedy decoding (--temperature 0)"),
    (["demo", "--policy", "greedy"], "--policy: invalid choice: 'greedy' (choose from 'fixed', 'adaptive')"),
    (["demo", "--accept-length", "0.5"], "--accept-length: must be a finite number >= 1, got 0.5"),
    (["demo", "--accept-length", "4.5"], "--accept-length must be in [1, 4] for a chain of --steps 3 drafts"),
    (["demo", "--steps", "5", "--tokens", "6", "--accept-length", "6.5"], "--accept-length must be in [1, 6]"),
    (["demo", "--accept-length", "2.4", "--oracle", "0.7"], "--accept-length and --oracle exclude each other"),
    (["demo", "--accept-length", "2.4", "--temperature", "1"], "--accept-length needs greedy decoding"),
    (["demo", "--seed", "-1"], "--seed: must be >= 0, got -1"),
    (["demo", "--threads", "0"], "--threads: must be >= 1, got 0"),
    (["demo", "--batch", "x"], "--batch: must be an integer >= 1, got 'x'"),
    (["demo", "--preset", "nosuch"], "--preset: invalid choice: 'nosuch'"),
    (["demo", "--dtype", "float16"], "--dtype: invalid choice: 'float16'"),
    (["demo", "--device", "gpu"], "--device: must be cpu, cuda or cuda:N, got 'gpu'"),
    (["demo", "--prompt", ""], "--prompt must be non-empty text"),
    (["demo", "--graphs"], "--graphs needs --device cuda (CUDA graphs), got --device cpu"),
    (["demo", "--graphs", "--device", "cuda"], "--graphs needs --dtype bfloat16"),
    (["demo", "--graphs", "--device", "cuda", "--dtype", "bfloat16", "--batch-invariant"],
     "--graphs and --batch-invariant exclude each other"),
    (["diagnose", "--aux-ids", "99", "100", "101"], "--aux-ids 99 is out of range for preset byte-small (8 layers)"),
    (["diagnose", "--preset", "tiny", "--aux-ids", "1", "8", "3"], "--aux-ids 8 is out of range for preset tiny"),
    (["diagnose", "--aux-ids", "1", "5"], "--aux-ids takes 3 layer ids (the drafter's capture slots), got 2"),
    (["diagnose", "--aux-ids", "1", "5", "5"], "--aux-ids must be distinct layers, got 1 5 5"),
    (["diagnose", "--aux-ids", "1.5", "2", "3"], "--aux-ids: invalid int value: '1.5'"),
    (["selfcheck", "--device", "tpu"], "--device: invalid choice: 'tpu'"),
    ([], "the following arguments are required: COMMAND"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["nosuch"], "COMMAND: invalid choice: 'nosuch' (choose from 'demo', 'diagnose', 'selfcheck')"),
]


@pytest.mark.parametrize("argv, says", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_usage_error_is_one_line_exit_2(argv, says, capsys, no_models):
    t0 = time.perf_counter()
    rc, err = _run(argv, capsys)
    assert rc == 2, err
    assert err.count("\n") == 1 and says in err, err
    assert "Traceback" not in err
    assert time.perf_counter() - t0 < 1.0, "checked before anything heavy"


def test_demo_adaptive_policy_with_a_calibrated_oracle(capsys):
    """demo --policy adaptive --accept-length 2.4: the oracle's p solved (0.6646), the adaptive run lossless, its
    decisions' histogram and both acceptance figures printed."""
    rc = cli.main(["demo", "--batch", "2", "--max-new", "12", "--policy", "adaptive", "--accept-length", "2.4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "p = 0.6646 (acceptance length 2.4 at 3 drafts" in out
    assert "adaptive policy:" in out and "decisions over" in out and "identical to plain greedy: yes" in out
    assert out.count("accept rate") >= 2


def test_with_prompt_any_batch_is_allowed(capsys):
    args = cli.parser().parse_args(["demo", "--prompt", "def f(", "--batch", "100"])
    cli.check_args(args)  # repeats the prompt: no held-out limit


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("argv", [["demo", "--device", "cuda"], ["diagnose", "--device", "cuda:0"],
                                  ["selfcheck", "--device", "cuda"]])
def test_cuda_without_a_gpu(argv, capsys, no_models):
    rc, err = _run(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and "torch sees no CUDA device" in err and "use --device cpu" in err, err
    assert f"--device {argv[-1]}" in err


def test_preset_too_large_for_memory(monkeypatch, capsys, no_models):
    monkeypatch.setattr(cli, "_host_available", lambda: 2**30)
    rc, err = _run(["demo", "--preset", "kimi-k2-slice", "--dtype", "bfloat16"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "--preset kimi-k2-slice needs 68.9 GiB for the target's weights in bfloat16, but cpu has 1.0 GiB free" in err


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
@pytest.mark.parametrize("topk", [1, 2, 4])
def test_tokens_bound_is_spec_configs(steps, topk):
    """The CLI checks --tokens without the engine (torch); the bound must stay SpecConfig's."""
    most = cli._most_tokens(steps, topk)
    SpecConfig(steps, topk, most)
    with pytest.raises(ValueError, match="num_tokens"):
        SpecConfig(steps, topk, most + 1)


def test_help_lists_exit_codes(capsys):
    for argv in (["--help"], ["demo", "--help"], ["diagnose", "--help"], ["selfcheck", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        out = capsys.readouterr().out
        assert e.value.code == 0 and "exit codes:" in out and "3   diagnose" in out, out
    assert cli.EXIT_CODES.split("\n", 1)[1] in cli.__doc__  # the docstring says the same


def test_m_target():
    assert _startup._m_target(["python", "-X", "importtime", "-m", "eagle3_ops", "--help"]) == "eagle3_ops"
    assert _startup._m_target(["python", "-meagle3_ops.cli"]) == "eagle3_ops.cli"
    assert _startup._m_target(["python", "script.py", "-m", "x"]) == "x"  # only asked while argv[0] == "-m"
    assert _startup._m_target(["python", "-c", "pass"]) is None


def test_library_import_is_not_deferred():
    """Only the command defers: this process imported the package in full."""
    assert not _startup.deferred and hasattr(eagle3_ops, "build_info") and hasattr(torch.ops.eagle3, "capture_aux")


def _command(*args, script=False):
    exe = [str(Path(sys.executable).parent / "eagle3")] if script else [sys.executable, "-X", "importtime", "-m",
                                                                        "eagle3_ops"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    p = subprocess.run(exe + list(args), capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    return p, time.perf_counter() - t0


def _imported(stderr: str) -> set[str]:
    """Module names from -X importtime's lines ('import time: self | cumulative | name')."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["demo", "--batch", "0"],
                                  ["diagnose", "--aux-ids", "99", "100", "101"]])
def test_python_m_help_and_errors_skip_torch(argv):
    p, seconds = _command(*argv)
    assert p.returncode == (0 if "--help" in argv else 2), p.stderr[-2000:]
    assert "torch" not in _imported(p.stderr) and "eagle3_ops._C" not in _imported(p.stderr)
    assert seconds < HELP_SECONDS, f"{seconds:.2f} s"


@pytest.mark.skipif(not (Path(sys.executable).parent / "eagle3").exists(), reason="no eagle3 console script here")
def test_console_script_help_is_fast():
    p, seconds = _command("--help", script=True)
    assert p.returncode == 0 and "exit codes:" in p.stdout, p.stderr[-2000:]
    assert seconds < HELP_SECONDS, f"{seconds:.2f} s"
