"""Byte-level text data for the shipped small pair (eagle3_ops/assets/byte-small): Python's own
standard-library sources, which every machine with Python has, so nothing is downloaded.

Tokens are bytes: token id = byte value (vocab 256), no special tokens.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except test suites and non-code
(any path component in ``EXCLUDED_DIRS``, a ``config-*`` folder, ``test_*.py``, ``_sysconfigdata*``).
Split, by file: a file is held out when ``int(sha256(relpath)[:8], 16) % HELDOUT_MODULUS == 0`` (about
5%), ``relpath`` its POSIX path relative to the stdlib folder (``"email/parser.py"``). The rule depends
on the path only, so it is the same on every Python version; which files exist, and their contents,
differ a little between versions, so the held-out prompts the demo and tests use are extracted once
and committed (``heldout_prompts.json``), never re-read from the local stdlib.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch import Tensor

VOCAB_SIZE = 256
HELDOUT_MODULUS = 20  # 1 file in 20 held out
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib",  # test suites (and IDLE, mostly GUI glue and its tests)
    "site-packages", "__pycache__",  # installed third-party code, bytecode
    "encodings",  # codec tables: generated data, not code
    "pydoc_data",  # one 700 KB string of documentation
    "turtledemo",  # demos
})
ASSETS = Path(__file__).resolve().parent / "assets" / "byte-small"
PROMPTS_FILE = ASSETS / "heldout_prompts.json"


# ---- tokens -----------------------------------------------------------------------------------------
def encode(text: Union[bytes, str]) -> Tensor:
    """Bytes (or a str, UTF-8 encoded) to token ids.

    Returns
    -------
    tokens : Tensor [T] int64
        token = byte value.
    """
    if isinstance(text, str):
        text = text.encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long() if text else torch.zeros(0, dtype=torch.long)


def to_bytes(tokens: Tensor) -> bytes:
    """Token ids [T] (any integer dtype, each in 0..255) back to bytes."""
    t = tokens.reshape(-1).cpu()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= VOCAB_SIZE):
        raise ValueError(f"tokens must be bytes (0..255), got values in [{int(t.min())}, {int(t.max())}]")
    return bytes(t.to(torch.uint8).tolist())


def decode(tokens: Tensor) -> str:
    """Token ids [T] to text (UTF-8; an invalid sequence, e.g. a character cut in half, becomes U+FFFD)."""
    return to_bytes(tokens).decode("utf-8", errors="replace")


# ---- the corpus ----------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """The split rule: held out when sha256 of the POSIX relative path, first 8 hex digits, is 0 mod 20."""
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def _included(relpath: str) -> bool:
    parts = relpath.split("/")
    if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
        return False
    name = parts[-1]
    return name.endswith(".py") and not name.startswith(("test_", "_sysconfigdata"))


def corpus_files(split: str, root: Optional[Path] = None) -> list[str]:
    """POSIX paths (relative to the stdlib folder, sorted) of the files in split "train" or "heldout"."""
    if split not in ("train", "heldout"):
        raise ValueError(f'split must be "train" or "heldout", got {split!r}')
    root = Path(root) if root is not None else stdlib_root()
    rels = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        rel = Path(folder).relative_to(root).as_posix()
        rels += [n if rel == "." else f"{rel}/{n}" for n in names if n.endswith(".py")]
    rels.sort()
    want = split == "heldout"
    return [r for r in rels if _included(r) and is_heldout(r) == want]


def load_corpus(split: str, root: Optional[Path] = None) -> tuple[Tensor, list[str]]:
    """The split's files concatenated in sorted path order (each as is, no separator).

    Returns
    -------
    data : Tensor [num_bytes] uint8
    files : list[str]
        The files, in order.
    """
    root = Path(root) if root is not None else stdlib_root()
    files = corpus_files(split, root)
    blob = b"".join((root / f).read_bytes() for f in files)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone(), files


def random_windows(data: Tensor, batch: int, length: int, generator: torch.Generator) -> Tensor:
    """`batch` windows of `length` consecutive bytes at uniformly random offsets.

    Returns
    -------
    windows : Tensor [batch, length] int64
    """
    if data.numel() < length:
        raise ValueError(f"corpus of {data.numel()} bytes is shorter than one window of {length}")
    starts = torch.randint(0, data.numel() - length + 1, (batch,), generator=generator)
    return data[starts[:, None] + torch.arange(length)].long()


def iterate_windows(data: Tensor, batch: int, length: int, seed: int) -> Iterator[Tensor]:
    """Endless stream of random_windows batches [batch, length] int64 from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield random_windows(data, batch, length, g)


def fixed_windows(data: Tensor, count: int, length: int) -> Tensor:
    """`count` windows [count, length] int64 at evenly spaced offsets: a fixed evaluation set."""
    step = max((data.numel() - length) // max(count, 1), 1)
    starts = torch.arange(count) * step
    return data[starts[:, None] + torch.arange(length)].long()


# ---- held-out prompts ----------------------------------------------------------------------------
def extract_prompts(root: Optional[Path] = None, count: int = 64, min_len: int = 64, max_len: int = 128,
                    seed: int = 0, avoid: bytes = b"") -> list[dict]:
    """Prompts of whole lines from held-out files: each starts at the start of a non-blank line and ends
    at a line end, `min_len..max_len` bytes. Files are visited round robin in sorted order; in each, a
    seeded generator picks a line at random (at most one prompt per file per round). A candidate that
    occurs verbatim in `avoid` (the training corpus: licence headers, boilerplate) is skipped.

    Returns
    -------
    prompts : list[dict]
        ``{"file": relpath, "offset": byte offset in the file, "text": the prompt}``.
    """
    root = Path(root) if root is not None else stdlib_root()
    rng = random.Random(seed)
    pools = []
    for rel in corpus_files("heldout", root):
        blob = (root / rel).read_bytes()
        starts = [0] + [i + 1 for i, b in enumerate(blob) if b == 0x0A and i + 1 < len(blob)]
        ends = starts[1:] + [len(blob)]
        cands = []
        for k, s in enumerate(starts):
            if not blob[s:ends[k]].strip():
                continue
            e = k
            while e + 1 < len(starts) and ends[e + 1] - s <= max_len:
                e += 1
            if min_len <= ends[e] - s <= max_len:
                cands.append((s, ends[e]))
        rng.shuffle(cands)
        if cands:
            pools.append((rel, blob, cands))
    prompts: list[dict] = []
    used: dict[str, list[tuple[int, int]]] = {}
    while len(prompts) < count and any(p[2] for p in pools):
        for rel, blob, cands in pools:
            while cands:  # next candidate that does not overlap one already taken from this file
                s, e = cands.pop()
                if all(e <= s2 or s >= e2 for s2, e2 in used.get(rel, [])):
                    try:
                        text = blob[s:e].decode("utf-8")
                    except UnicodeDecodeError:
                        continue
                    if avoid and blob[s:e] in avoid:
                        continue
                    used.setdefault(rel, []).append((s, e))
                    prompts.append({"file": rel, "offset": s, "text": text})
                    break
            if len(prompts) == count:
                break
    if len(prompts) < count:
        raise RuntimeError(f"only {len(prompts)} prompts could be cut from the held-out files under {root}")
    return prompts


def load_heldout_prompts(path: Optional[Path] = None) -> list[bytes]:
    """The committed held-out prompts (eagle3_ops/assets/byte-small/heldout_prompts.json): 64 prompts of
    64..128 bytes, whole lines from held-out stdlib files, independent of the local Python."""
    with open(path or PROMPTS_FILE, encoding="utf-8") as f:
        return [p["text"].encode("utf-8") for p in json.load(f)["prompts"]]


def load_heldout_prompt_records(path: Optional[Path] = None) -> list[dict]:
    """The same prompts with where they came from: ``{"file", "offset", "text"}``."""
    with open(path or PROMPTS_FILE, encoding="utf-8") as f:
        return json.load(f)["prompts"]


__all__ = [
    "VOCAB_SIZE", "HELDOUT_MODULUS", "EXCLUDED_DIRS", "PROMPTS_FILE", "encode", "decode", "to_bytes",
    "stdlib_root", "is_heldout", "corpus_files", "load_corpus", "random_windows", "iterate_windows",
    "fixed_windows", "extract_prompts", "load_heldout_prompts", "load_heldout_prompt_records",
]
