"""Installing: the torch-version check at import, setup.py without torch, and the Makefile's choice of torch."""

import os
import shutil
import subprocess
import sys
import types

import pytest

from eagle3_ops import _version_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE = shutil.which("make")
needs_make = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def fake_torch(version, cuda):
    return types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda))


# --- the version check ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("built, installed", [
    (("2.14.1+cu130", "13.0"), ("2.14.1+cu130", "13.0")),
    (("2.14.1+cu130", "13.0"), ("2.14.1", "13.0")),  # a local label alone is the wheel's name, not its build
    (("2.13.0+cpu", None), ("2.13.0+cpu", None)),
])
def test_same_torch_passes(built, installed):
    assert _version_check.mismatch(*built, *installed) is None


@pytest.mark.parametrize("built, installed, named", [
    (("2.14.1+cu130", "13.0"), ("2.13.0+cpu", None), ["2.14.1+cu130 (CUDA 13.0)", "2.13.0+cpu (CPU)"]),
    (("2.14.1+cu130", "13.0"), ("2.14.1+cpu", None), ["(CUDA 13.0)", "2.14.1+cpu (CPU)"]),  # the same release
    (("2.14.1+cu130", "13.0"), ("2.14.1+cu128", "12.8"), ["(CUDA 13.0)", "(CUDA 12.8)"]),
    (("2.14.1+cu130", "13.0"), ("2.14.0+cu130", "13.0"), ["torch 2.14.1+cu130", "torch 2.14.0+cu130"]),
    (("2.15.0.dev20260101+cu130", "13.0"), ("2.15.0.dev20260102+cu130", "13.0"), ["dev20260101", "dev20260102"]),
])
def test_other_torch_is_named(built, installed, named):
    message = _version_check.mismatch(*built, *installed)
    assert message.startswith("eagle3_ops was built for torch ")
    assert message.endswith("reinstall eagle3_ops (pip install --no-build-isolation .) against this torch")
    for part in named:
        assert part in message


def test_check_reads_the_recorded_torch(monkeypatch):
    import eagle3_ops

    built = types.ModuleType("eagle3_ops._built_with")
    built.TORCH_VERSION, built.TORCH_CUDA = "2.14.1+cu130", "13.0"
    monkeypatch.setitem(sys.modules, "eagle3_ops._built_with", built)
    monkeypatch.setattr(eagle3_ops, "_built_with", built, raising=False)
    _version_check.check(fake_torch("2.14.1+cu130", "13.0"))
    with pytest.raises(ImportError, match=r"built for torch 2\.14\.1\+cu130 \(CUDA 13\.0\) but torch 2\.13\.0\+cpu"):
        _version_check.check(fake_torch("2.13.0+cpu", None))


def import_in_subprocess(built_version, built_cuda, block_c=False):
    """`import eagle3_ops` in a fresh interpreter whose recorded build torch is the one given."""
    code = (
        "import sys, types, torch\n"
        "m = types.ModuleType('eagle3_ops._built_with')\n"
        f"m.TORCH_VERSION, m.TORCH_CUDA = {built_version!r}, {built_cuda!r}\n"
        "if m.TORCH_VERSION == 'this': m.TORCH_VERSION, m.TORCH_CUDA = str(torch.__version__), torch.version.cuda\n"
        "sys.modules['eagle3_ops._built_with'] = m\n"
        + ("sys.modules['eagle3_ops._C'] = None\n" if block_c else "")
        + "try:\n    import eagle3_ops\nexcept ImportError as e:\n"
        "    print('C loaded' if sys.modules.get('eagle3_ops._C') else 'C not loaded'); print(e); sys.exit(3)\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_import_refuses_another_torch_before_loading_the_extension():
    import torch

    r = import_in_subprocess("1.0.0+cpu", None)
    assert r.returncode == 3, r.stderr
    first, message = r.stdout.splitlines()
    assert first == "C not loaded"
    assert f"built for torch 1.0.0+cpu (CPU) but torch {torch.__version__}" in message


def test_import_error_of_the_extension_gets_the_hint():
    import torch

    r = import_in_subprocess("this", None, block_c=True)
    assert r.returncode == 3, r.stderr
    message = r.stdout.splitlines()[1]
    assert message.startswith("eagle3_ops: its native extension did not load (")
    assert f"the torch installed now, {torch.__version__} (" in message
    assert "pip install --no-build-isolation ." in message


# --- setup.py ------------------------------------------------------------------------------------------------

def test_setup_without_torch_says_no_build_isolation():
    # What pip's isolated build environment is: setuptools without torch (a None entry makes `import torch` fail).
    code = ("import runpy, sys\nsys.modules['torch'] = None\nsys.argv = ['setup.py', '--name']\n"
            "runpy.run_path('setup.py', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "eagle3_ops compiles against the torch installed beside it and finds none: install torch first, then "
        "`pip install --no-build-isolation .` (a plain `pip install .` builds in an isolated environment without torch)"
    ]


# --- Makefile ------------------------------------------------------------------------------------------------

def fake_nvidia_smi(tmp_path, status):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if status is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nexit {status}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return str(bin_dir)


@needs_make
@pytest.mark.parametrize("nvidia_smi, torch", [
    (None, "torch==2.13.0"),  # absent
    (9, "torch==2.13.0"),  # there but failing (no driver, no device)
    (0, "torch==2.14.1"),
])
def test_new_venv_gets_the_torch_that_fits(tmp_path, nvidia_smi, torch):
    # Only nvidia-smi's directory on PATH: make runs its recipes through /bin/bash, and -n runs none of them.
    env = {"PATH": fake_nvidia_smi(tmp_path, nvidia_smi), "HOME": str(tmp_path)}
    r = subprocess.run([MAKE, "-n", f"VENV={tmp_path}/venv", "demo"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f'-m pip install "{torch}" ninja' in r.stdout
    assert f"creating {tmp_path}/venv with {torch} (" in r.stdout
    assert "--no-build-isolation --no-deps -e ." in r.stdout
    assert r.stdout.rstrip().endswith("-m eagle3_ops demo --batch 4")


@needs_make
@pytest.mark.parametrize("given, reinstalled", [
    (None, False),  # an existing .venv keeps its torch when TORCH is not given
    ("torch==2.13.0", False),  # the one it has
    ("torch==2.14.1", True),
])
def test_given_torch_is_honoured_on_an_existing_venv(tmp_path, given, reinstalled):
    # A .venv made with torch==2.13.0 and built, whose python records its arguments instead of running.
    shutil.copy(os.path.join(ROOT, "Makefile"), tmp_path)
    (tmp_path / "setup.py").write_text("")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls"
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".torch").write_text("torch==2.13.0\n")
    for k, stamp in enumerate([tmp_path / "setup.py", venv / ".deps-installed", venv / ".torch", venv / ".eagle3-built"]):
        stamp.touch()
        os.utime(stamp, (1e9 + k, 1e9 + k))
    # Run from `make TORCH=... test`, the variables given to that make reach this one through MAKEFLAGS.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH")}
    env["PATH"] = fake_nvidia_smi(tmp_path, 9) + os.pathsep + os.environ["PATH"]
    r = subprocess.run([MAKE, "VENV=venv", "demo"] + ([f"TORCH={given}"] if given else []), cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    if reinstalled:
        assert "venv has torch==2.13.0, TORCH=torch==2.14.1 asked for: reinstalling torch, then rebuilding" in r.stdout
        assert calls[:2] == ["-m pip install torch==2.14.1", "-m pip install -v --no-build-isolation --no-deps -e ."]
        assert (venv / ".torch").read_text() == "torch==2.14.1\n"
    else:
        assert "reinstalling" not in r.stdout
        assert len(calls) == 1 and (venv / ".torch").read_text() == "torch==2.13.0\n"
    assert calls[-1] == "-m eagle3_ops demo --batch 4"
