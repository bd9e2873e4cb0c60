"""The op table: every docs/design.md op is registered, passes opcheck on CPU, and keeps one signature
across schema, reference and wrapper; the build says what it holds; our Triton package shadows nothing."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import eagle3_ops
from eagle3_ops import ops, reference
from eagle3_ops.samples import sample_args

DESIGN_OPS = ["capture_aux", "add_rmsnorm_capture", "fc_proj", "build_tree", "tree_attention_mla", "tree_attention",
              "verify_greedy", "verify_sampling", "kv_accept"]


def _schema(name):
    return getattr(torch.ops.eagle3, name).default._schema


@pytest.mark.parametrize("name", DESIGN_OPS)
def test_registered(name):
    assert hasattr(torch.ops.eagle3, name), f"torch.ops.eagle3.{name} is missing"


@pytest.mark.parametrize("name", DESIGN_OPS)
def test_opcheck_cpu(name):
    torch.library.opcheck(getattr(torch.ops.eagle3, name).default, sample_args(name))


@pytest.mark.parametrize("name", DESIGN_OPS)
def test_signatures_match_schema(name):
    schema_names = [a.name for a in _schema(name).arguments]
    ref = list(inspect.signature(getattr(reference, name)).parameters)
    assert ref == schema_names, f"reference.{name}{ref} != schema {schema_names}"
    wrapper = [p.name for p in inspect.signature(getattr(ops, name)).parameters.values()
               if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert wrapper == schema_names, f"ops.{name}{wrapper} != schema {schema_names}"


@pytest.mark.parametrize("name", DESIGN_OPS)
def test_mutating_ops_return_nothing(name):
    schema = _schema(name)
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if mutated:
        assert len(schema.returns) == 0, f"{name} mutates {mutated} and must return ()"
    else:
        assert name.startswith("verify_"), f"{name} mutates nothing: only the verify ops return tensors"


@pytest.mark.parametrize("name", DESIGN_OPS)
def test_docstrings_give_shapes(name):
    doc = getattr(reference, name).__doc__
    for arg in _schema(name).arguments:
        assert f"\n    {arg.name} : " in doc, f"reference.{name} docstring does not describe {arg.name}"


@pytest.mark.parametrize("name", DESIGN_OPS)
def test_fake_matches_real_on_meta(name):
    """The fakes run on meta tensors (no values) and give the real op's output shapes."""
    args = sample_args(name)
    to_meta = lambda a: a.to("meta") if isinstance(a, torch.Tensor) else (  # noqa: E731
        [t.to("meta") for t in a] if isinstance(a, list) else a)
    meta_out = getattr(torch.ops.eagle3, name)(*[to_meta(a) for a in args])
    real_out = getattr(torch.ops.eagle3, name)(*args)
    if real_out is None or real_out == ():
        assert meta_out is None or meta_out == ()
    else:
        assert [(t.shape, t.dtype) for t in meta_out] == [(t.shape, t.dtype) for t in real_out]


def test_compile_fullgraph_cpu():
    """A step's ops trace into one graph (fakes) and run (references) under torch.compile."""
    args = sample_args("verify_greedy")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(logits, tokens, parents):
        return torch.ops.eagle3.verify_greedy(logits, tokens, parents)

    for got, want in zip(step(*args), torch.ops.eagle3.verify_greedy(*args)):
        assert torch.equal(got, want)


def test_build_info():
    info = eagle3_ops.build_info()
    assert set(info) == {"cuda", "cuda_archs", "cuda_version", "torch_version", "cuda_kernels", "device_checks",
                         "dev_build"}
    assert info["device_checks"] in (True, False)  # False: built with EAGLE3_DEVICE_CHECKS=0
    assert info["dev_build"] in (True, False)  # True: built with EAGLE3_DEV_BUILD=1
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    if info["cuda"]:
        assert "capture_aux" in info["cuda_kernels"] and info["cuda_archs"]
    else:
        assert info["cuda_kernels"] == []


def test_production_op_table_has_no_development_arguments():
    """The sm90 MLA kernel's diagnostic builds (per-block trace, no-math skeletons) are a development build's own op
    (setup.py EAGLE3_DEV_BUILD=1), never arguments of the op that tree_attention_mla calls."""
    schema = str(torch.ops.eagle3._tree_attention_mla_sm90.default._schema)
    assert "trace" not in schema and "skeleton" not in schema, schema
    assert hasattr(torch.ops.eagle3, "_tree_attention_mla_sm90_dev") == eagle3_ops.build_info()["dev_build"]


def test_triton_kernels_is_ours_and_shadows_nothing(tmp_path):
    """Ours is eagle3_ops.triton_kernels; an unrelated top-level `triton_kernels` still imports as itself."""
    import eagle3_ops.triton_kernels as ours

    assert ours.__name__ == "eagle3_ops.triton_kernels"
    other = tmp_path / "site" / "triton_kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'the other project'\n")
    probe = textwrap.dedent("""
        import importlib.util, eagle3_ops, eagle3_ops.triton_kernels, triton_kernels
        print(triton_kernels.WHO)
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    if "No module named 'eagle3_ops'" in run.stderr:
        pytest.skip("eagle3_ops is built in place, not installed: nothing to shadow")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "the other project"
    # And nothing named triton_kernels is installed at top level by us:
    env = dict(os.environ, PYTHONPATH="")
    probe = "import importlib.util, eagle3_ops; print(importlib.util.find_spec('triton_kernels'))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    spec = run.stdout.strip()
    assert spec == "None" or os.path.dirname(os.path.dirname(eagle3_ops.__file__)) not in spec, spec
