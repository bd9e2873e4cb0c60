"""The error word's two halves agree (csrc/include/eagle3/errors.h and eagle3_ops/errors.py), the one
wording of a violation, the CPU helpers that pick the element to name, and check_errors / strict mode."""

from __future__ import annotations

import os
import re
import struct

import pytest
import torch

import eagle3_ops
from eagle3_ops import errors
from eagle3_ops.errors import Eagle3InputError

HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "include", "eagle3",
                      "errors.h")


def header_enum(name: str) -> list[tuple[str, int]]:
    """The enumerators of `enum name ...` in errors.h with their values, by C's rules (an implicit value is
    the previous one + 1)."""
    text = re.sub(r"//[^\n]*", "", open(HEADER).read())
    body = re.search(r"enum\s+" + name + r"\b[^{]*\{([^}]*)\}", text)
    assert body, f"enum {name} not found in {HEADER}"
    out, value = [], -1
    for entry in (e.strip() for e in body.group(1).split(",")):
        if not entry:
            continue
        ident, _, explicit = (p.strip() for p in entry.partition("="))
        value = int(explicit) if explicit else value + 1
        out.append((ident, value))
    return out


def snake(ident: str, prefix: str) -> str:
    """kOpTreeAttentionMla -> tree_attention_mla, kArgD2t -> d2t, kKindNaN -> nan."""
    words = ident[len(prefix):].replace("NaN", "Nan")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", words).lower()


@pytest.mark.parametrize("enum, prefix, table", [("ErrorOp", "kOp", errors.OPS), ("ErrorArg", "kArg", errors.ARGS),
                                                 ("ErrorKind", "kKind", errors.KINDS)])
def test_tables_match_the_header(enum, prefix, table):
    entries = header_enum(enum)
    assert all(ident.startswith(prefix) for ident, _ in entries)
    names = tuple(snake(ident, prefix) for ident, _ in entries)
    assert names == table, f"{enum} and errors.py differ in names or order"
    assert [v for _, v in entries] == list(range(1, len(table) + 1)), f"{enum}: ids must be position + 1"


def test_names_are_the_schemas():
    """Every op and argument the error word can name is the op table's (csrc/registration.cpp): a renamed
    argument cannot leave a message naming the old one."""
    assert all(hasattr(torch.ops.eagle3, op) for op in errors.OPS)
    named = {a.name for op in errors.OPS for a in getattr(torch.ops.eagle3, op).default._schema.arguments}
    assert [a for a in errors.ARGS if a not in named] == [], "errors.ARGS names an argument no schema has"


def test_word_layout_matches_the_header():
    fields = header_enum("ErrorField")
    assert [v for _, v in fields] == list(range(10))
    python = (errors._STATE, errors._OP, errors._ARG, errors._KIND, errors._I0, errors._I1, errors._I2, errors._VALUE,
              errors._LO, errors._HI)
    names = [snake(i, "kErr") for i, _ in fields]
    assert names == ["state", "op", "arg", "kind", "i0", "i1", "i2", "value", "lo", "hi"]
    assert list(python) == [v for _, v in fields]
    text = open(HEADER).read()
    assert re.search(r"kErrorWords\s*=\s*(\d+)", text).group(1) == str(errors.WORDS)
    assert "kNoIndex = INT64_MIN" in text and errors.NO_INDEX == -(2**63)


# ---- the wording ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, kind, expected", [
    (("kv_accept", "accept_nodes", (1, 2), 99, 0, 15), "range",
     "kv_accept: accept_nodes[1, 2] = 99 is out of range (valid: 0..15)"),
    (("capture_aux", "rows", (3,), 5_000_000, 0, 12), "range",
     "capture_aux: rows[3] = 5000000 is out of range (valid: 0..12)"),
    (("capture_aux", "rows", (0,), -7, 0, -1), "range", "capture_aux: rows[0] = -7 is out of range (valid: 0..-1)"),
    (("fc_proj", "rows", (), 4, 0, 3), "range", "fc_proj: rows = 4 is out of range (valid: 0..3)"),  # no index
    (("build_tree", "draft_scores", (0, 1, 3), float("nan")), "nan", "build_tree: draft_scores[0, 1, 3] is NaN"),
    (("build_tree", "draft_scores", (), float("nan")), "nan", "build_tree: draft_scores is NaN"),
    (("verify_sampling", "temperature", (2,), -1.0), "negative", "verify_sampling: temperature[2] = -1.0 must be >= 0"),
    (("verify_sampling", "temperature", (0,), -2.5e-8), "negative",
     "verify_sampling: temperature[0] = -2.5e-08 must be >= 0"),
    (("verify_sampling", "temperature", (1,), float("-inf")), "negative",
     "verify_sampling: temperature[1] = -inf must be >= 0"),
])
def test_message_wording(args, kind, expected):
    assert errors.message(*args, kind=kind) == expected
    err = errors.input_error(*args, kind=kind)
    assert isinstance(err, Eagle3InputError) and isinstance(err, IndexError) and isinstance(err, ValueError)
    assert str(err) == expected


def test_message_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        errors.message("kv_accept", "rows", (0,), 1, 0, 0, kind="bogus")


# ---- check_range / check_float: the first bad element, row-major -------------------------------------------


def raised(fn, *args, **kwargs) -> str:
    with pytest.raises(Eagle3InputError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_check_range_first_bad_row_major():
    t = torch.tensor([[0, 1, 2], [3, 9, -1], [7, 0, 0]])
    assert raised(errors.check_range, t, 0, 4, "op", "a") == "op: a[1, 1] = 9 is out of range (valid: 0..4)"
    # a transposed view: row-major in its own (logical) order, not in memory order
    assert raised(errors.check_range, t.t(), 0, 4, "op", "a") == "op: a[0, 2] = 7 is out of range (valid: 0..4)"
    assert raised(errors.check_range, t[:, 2], 0, 1, "op", "a") == "op: a[0] = 2 is out of range (valid: 0..1)"
    errors.check_range(t, -1, 9, "op", "a")  # all in range: no error
    errors.check_range(torch.zeros(0, 3, dtype=torch.int64), 0, 0, "op", "a")


def test_check_range_bounds_as_tensors_and_dtypes():
    t = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    hi = torch.tensor([[5], [3]])  # per row
    assert raised(errors.check_range, t, 0, hi, "op", "a") == "op: a[1, 1] = 4 is out of range (valid: 0..3)"
    lo = torch.tensor([0, 3])  # per column
    assert raised(errors.check_range, t, lo, 9, "op", "a") == "op: a[0, 1] = 2 is out of range (valid: 3..9)"
    big = torch.tensor([2**40], dtype=torch.int64)
    assert raised(errors.check_range, big, 0, 7, "op", "a") == f"op: a[0] = {2**40} is out of range (valid: 0..7)"


def test_check_range_offset():
    t = torch.tensor([[0, 0], [0, 0], [0, 5]])
    # t[1:] is rows 1.. of the argument: the reported index is the argument's
    assert raised(errors.check_range, t[1:], 0, 4, "op", "a", offset=(1,)) == \
        "op: a[2, 1] = 5 is out of range (valid: 0..4)"
    assert raised(errors.check_range, t[1:, 1:], 0, 4, "op", "a", offset=(1, 1)) == \
        "op: a[2, 1] = 5 is out of range (valid: 0..4)"
    # an offset shorter than the index shifts the leading dimensions only
    assert raised(errors.check_range, t[2:], 0, 4, "op", "a", offset=(2,)) == \
        "op: a[2, 1] = 5 is out of range (valid: 0..4)"


def test_check_float_first_bad_row_major():
    nan = float("nan")
    t = torch.tensor([[1.0, -2.0], [nan, 0.0]])
    assert raised(errors.check_float, t, "op", "s") == "op: s[1, 0] is NaN"  # negatives allowed by default
    assert raised(errors.check_float, t, "op", "s", nonnegative=True) == "op: s[0, 1] = -2.0 must be >= 0"
    t2 = torch.tensor([[1.0, nan], [-3.0, 0.0]])
    assert raised(errors.check_float, t2, "op", "s", nonnegative=True) == "op: s[0, 1] is NaN"
    assert raised(errors.check_float, t.t(), "op", "s") == "op: s[0, 1] is NaN"
    assert raised(errors.check_float, torch.tensor(-0.5), "op", "s", nonnegative=True) == "op: s = -0.5 must be >= 0"
    errors.check_float(torch.tensor([0.0, -0.0, 3.0]), "op", "s", nonnegative=True)  # -0.0 is not below zero
    errors.check_float(torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16), "op", "s")


# ---- the CPU word: check_errors decodes what a kernel under the interpreter recorded ---------------------


def record(op, arg, kind, index, value, lo=0, hi=0):
    """Write a record into the CPU word by hand, as a kernel does."""
    w = [0] * errors.WORDS
    idx = list(index) + [errors.NO_INDEX] * (3 - len(index))
    if kind != "range":
        value = struct.unpack("<q", struct.pack("<d", value))[0]
    w[1:10] = [errors.OPS.index(op) + 1, errors.ARGS.index(arg) + 1, errors.KINDS.index(kind) + 1, *idx, value, lo,
               hi]
    w[0] = 2
    errors._cpu_word.copy_(torch.tensor(w, dtype=torch.int64))


@pytest.fixture
def cpu_word():
    errors._cpu_word.zero_()
    yield errors._cpu_word
    errors._cpu_word.zero_()


def test_check_errors_is_a_no_op_when_clear(cpu_word):
    eagle3_ops.check_errors()
    eagle3_ops.check_errors("cpu")
    assert not bool(cpu_word.any())


@pytest.mark.parametrize("op, arg, kind, index, value, lo, hi, expected", [
    ("capture_aux", "rows", "range", (3,), 5_000_000, 0, 12,
     "capture_aux: rows[3] = 5000000 is out of range (valid: 0..12)"),
    ("fc_proj", "rows", "range", (), -1, 0, 7, "fc_proj: rows = -1 is out of range (valid: 0..7)"),
    ("kv_accept", "accept_nodes", "range", (1, 2), 99, 0, 15,
     "kv_accept: accept_nodes[1, 2] = 99 is out of range (valid: 0..15)"),
    ("build_tree", "draft_scores", "nan", (0, 1, 3), float("nan"), 0, 0, "build_tree: draft_scores[0, 1, 3] is NaN"),
    ("verify_sampling", "temperature", "negative", (2,), -1.0, 0, 0,
     "verify_sampling: temperature[2] = -1.0 must be >= 0"),
    ("tree_attention", "page_table", "range", (0, 5, 1), -(2**62), 0, 2**40,
     f"tree_attention: page_table[0, 5, 1] = {-(2**62)} is out of range (valid: 0..{2**40})"),
])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_check_errors_decodes_and_clears(cpu_word, device, op, arg, kind, index, value, lo, hi, expected):
    record(op, arg, kind, index, value, lo, hi)
    with pytest.raises(Eagle3InputError, match="^" + re.escape(expected) + "$"):
        eagle3_ops.check_errors(device)
    assert not bool(cpu_word.any()), "check_errors must clear the word"
    eagle3_ops.check_errors(device)  # cleared: silent


def test_check_errors_unknown_ids(cpu_word):
    cpu_word.copy_(torch.tensor([2, 99, 98, 1, 0, errors.NO_INDEX, errors.NO_INDEX, 5, 0, 1, 0, 0]))
    with pytest.raises(Eagle3InputError, match=r"^op 99: argument 98\[0\] = 5 is out of range \(valid: 0\.\.1\)$"):
        eagle3_ops.check_errors("cpu")


def test_error_word_cpu_is_the_interpreter_word():
    assert errors.error_word("cpu") is errors._cpu_word
    assert errors._cpu_word.dtype == torch.int64 and errors._cpu_word.shape == (errors.WORDS,)


# ---- GPU: the device word and strict mode ------------------------------------------------------------------


def capture_call(rows):
    hidden = torch.randn(13, 64, device="cuda", dtype=torch.bfloat16)
    aux = torch.zeros(len(rows), 128, device="cuda", dtype=torch.bfloat16)
    r = torch.tensor(rows, device="cuda", dtype=torch.int32)
    return lambda: torch.ops.eagle3.capture_aux(hidden, None, aux, 1, r)


@pytest.mark.gpu
def test_cuda_strict_mode_raises_at_the_call():
    eagle3_ops.check_errors()
    bad, good = capture_call([0, 12, 5, 5_000_000]), capture_call([0, 12, 5])
    eagle3_ops.set_strict(True)
    try:
        assert errors.strict()
        good()  # silent
        with pytest.raises(Eagle3InputError,
                           match=r"^capture_aux: rows\[3\] = 5000000 is out of range \(valid: 0\.\.12\)$"):
            bad()
        good()  # the raise cleared the word
    finally:
        eagle3_ops.set_strict(False)
    assert not errors.strict()
    eagle3_ops.check_errors()  # nothing left


@pytest.mark.gpu
def test_cuda_not_strict_defers_to_check_errors():
    eagle3_ops.check_errors()
    capture_call([0, -7])()  # returns: no sync, no raise
    capture_call([1, 2])()
    with pytest.raises(Eagle3InputError, match=r"^capture_aux: rows\[1\] = -7 is out of range \(valid: 0\.\.12\)$"):
        eagle3_ops.check_errors()
    eagle3_ops.check_errors()


@pytest.mark.gpu
def test_cuda_error_word_is_one_tensor():
    w = errors.error_word("cuda")
    assert errors.error_word("cuda") is w
    assert errors.error_word(torch.device("cuda", torch.cuda.current_device())) is w
    assert w.device.type == "cuda" and w.dtype == torch.int64 and w.shape == (errors.WORDS,)
    ptr = w.data_ptr()
    eagle3_ops.check_errors()
    assert errors.error_word("cuda").data_ptr() == ptr
    assert int(w[0]) == 0
