"""The byte-level data of the shipped small pair (eagle3_ops.data): the committed held-out prompts, the
byte tokenizer, and the file split rule. Fast; reads the local stdlib only to check the split."""

import json

import pytest
import torch

from eagle3_ops import data


def test_heldout_prompts_load():
    prompts = data.load_heldout_prompts()
    assert len(prompts) == 64
    assert all(isinstance(p, bytes) and 64 <= len(p) <= 128 for p in prompts)
    assert len(set(prompts)) == len(prompts), "duplicate prompts"
    # whole lines: each ends at a line end, none starts with a blank line
    assert all(p.endswith(b"\n") and p.split(b"\n", 1)[0].strip() for p in prompts)


def test_prompt_records_match_prompts():
    records = data.load_heldout_prompt_records()
    assert [r["text"].encode("utf-8") for r in records] == data.load_heldout_prompts()
    with open(data.PROMPTS_FILE, encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["heldout_modulus"] == data.HELDOUT_MODULUS


def test_prompts_come_from_heldout_files_only():
    # the split rule is a hash of the path: checkable without the files, on any Python version
    for r in data.load_heldout_prompt_records():
        assert data.is_heldout(r["file"]), f"{r['file']} is a training file"


@pytest.mark.parametrize("text", [b"", b"x", bytes(range(256)), "caf\u00e9 \u2192 \u00fc\n".encode("utf-8")])
def test_encode_decode_round_trip(text):
    # empty, one byte, every byte value (decode must not drop any), multi-byte UTF-8
    t = data.encode(text)
    assert t.dtype == torch.int64 and t.shape == (len(text),)
    assert data.to_bytes(t) == text
    assert data.decode(t) == text.decode("utf-8", errors="replace")


def test_round_trip_on_prompts():
    for p in data.load_heldout_prompts():
        t = data.encode(p)
        assert int(t.max()) < data.VOCAB_SIZE
        assert data.to_bytes(t) == p and data.decode(t) == p.decode("utf-8")
        assert data.encode(p.decode("utf-8")).equal(t)


def test_to_bytes_refuses_non_bytes():
    with pytest.raises(ValueError, match="0..255"):
        data.to_bytes(torch.tensor([1, 256]))


def test_split_is_disjoint_and_excludes_tests():
    train, heldout = data.corpus_files("train"), data.corpus_files("heldout")
    assert train and heldout and not set(train) & set(heldout)
    assert all(not data.is_heldout(f) for f in train) and all(data.is_heldout(f) for f in heldout)
    for f in train + heldout:
        parts = f.split("/")
        assert not set(parts[:-1]) & data.EXCLUDED_DIRS and not parts[-1].startswith("test_"), f
    # about 5% of the files held out
    assert 0.02 < len(heldout) / (len(train) + len(heldout)) < 0.1


def test_prompts_do_not_occur_in_training_files_of_this_python():
    # extraction skipped any candidate that occurs verbatim in a training file (licence headers,
    # boilerplate), so that held-out numbers are not memorisation
    train = set(data.corpus_files("train"))
    assert not {r["file"] for r in data.load_heldout_prompt_records()} & train
    blob = data.load_corpus("train")[0].numpy().tobytes()
    leaked = [p for p in data.load_heldout_prompts() if p in blob]
    assert not leaked, f"{len(leaked)} held-out prompts occur verbatim in training files, e.g. {leaked[0]!r}"


def test_random_windows_shape_and_range():
    corpus = torch.arange(1000).to(torch.uint8)
    g = torch.Generator().manual_seed(0)
    w = data.random_windows(corpus, 3, 17, g)  # odd sizes
    assert w.shape == (3, 17) and w.dtype == torch.int64
    assert ((w[:, 1:] - w[:, :-1]) % 256 == 1).all()  # consecutive bytes
    with pytest.raises(ValueError):
        data.random_windows(corpus[:5], 1, 17, g)
