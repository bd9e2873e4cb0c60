"""The documentation's promises: every file the repository cites is in it, the op tables name the schemas'
arguments (the README's their returns too), and docs/results.md (with the README's headline table) is what
scripts/results_table.py makes of bench/results/*.json."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Text files scanned for citations, by extension (and Makefile by name).
SCANNED = (".md", ".py", ".sh", ".cu", ".cuh", ".h", ".cpp", ".ini", ".toml", ".cfg", ".txt")
# A cited path starts at one of the repository's top folders; anything else (torch/..., $OUT/..., a URL's path)
# is not ours to check.
TOP = ("docs", "bench", "csrc", "tests", "scripts", "eagle3_ops", "triton_kernels", ".ci",
       "results")  # bench's own shorthand for bench/results/
EXT = r"(?:md|py|sh|cu|cuh|h|cpp|json|log|png|ini|toml|txt|safetensors)"
# `[../]*top/dir/name.ext`, not inside a longer word, path or URL; a name with {, < or * is generated (an f-string
# or a pattern) and never matches, since those characters end the match before the extension.
CITED = rf"(?:\.\./)*(?:{'|'.join(re.escape(t) for t in TOP)})/(?:[\w.\-]+/)*[\w\-.]+\.{EXT}"
PATH = re.compile(rf"(?<![\w./\-])({CITED})(?![\w/])")
# A file taken out of the tree but kept in git history (bench/results/ holds the current results only) is cited
# as `<commit>:<path>`, what `git show` takes: that commit must hold it.
HISTORY = re.compile(rf"(?<![\w./\-])([0-9a-f]{{7,40}}):({CITED})(?![\w/])")
# Bare names that must be a tracked file's somewhere: upper-case notes (DESIGN.md, STYLE.md, ...) and results
# files named without their folder (mla_sm90_early_h200.log: a device tag, or compile, before the extension).
BARE = re.compile(r"(?<![\w./\-$])([A-Z][A-Z0-9_]+\.md|[\w\-]+_(?:[a-z]\d{3}|compile|sm\d+a?)\.(?:log|json|png))\b")
# Cited paths that are not in the repository by design, with the reason.
ALLOWED: dict[str, str] = {
    "bench/session_run.sh": "kv_accept_h200.json's note (a measured record) names the run's script, never committed",
}
SELF = "tests/test_docs.py"  # its examples and patterns are not citations


def git(*args: str, stdin: str = "") -> list[str]:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, input=stdin.encode(), capture_output=True).stdout
    except OSError:
        pytest.skip("git is not installed: the file list is git's")
    return [p for p in out.decode().split("\0") if p]


def tracked() -> list[str]:
    """Tracked files, and new ones not yet committed (not ignored): a work in progress cites them too."""
    files = git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if not files:
        pytest.skip("not a git checkout: the file list is git's")
    return files


def lines(text: str):
    """(line number, line), a URL's path segments blanked: they look like ours (github.com/.../docs/x.md)."""
    for n, line in enumerate(text.splitlines(), 1):
        yield n, re.sub(r"\S+://\S+", " ", line) if "://" in line else line


def citations(path: str, text: str):
    """(line number, cited path as written, path relative to the repository root or None when outside it);
    `<commit>:<path>` citations are history_citations', not these."""
    here = os.path.dirname(path)
    for n, line in lines(text):
        line = HISTORY.sub(" ", line)
        for m in PATH.finditer(line):
            cited = m.group(1)
            base = here if cited.startswith("../") else ""
            resolved = os.path.normpath(os.path.join(base, "bench" if cited.startswith("results/") else "", cited))
            yield n, cited, None if resolved.startswith("..") else resolved
        for m in BARE.finditer(line):
            yield n, m.group(1), m.group(1)


def history_citations(text: str):
    """(line number, commit, cited path) of each `<commit>:<path>` citation."""
    for n, line in lines(text):
        for m in HISTORY.finditer(line):
            yield n, m.group(1), m.group(2)


def scanned(files: list[str]):
    """(path, text) of each tracked text file that may cite others."""
    for path in files:
        if path == SELF or not (path.endswith(SCANNED) or os.path.basename(path) == "Makefile"
                                or path.startswith(".ci/")):
            continue
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            continue  # deleted in the working tree, not yet committed
        with open(full, encoding="utf-8", errors="replace") as f:
            yield path, f.read()


def test_every_cited_file_is_in_the_repository():
    files = tracked()
    present = set(files)
    present |= {os.path.dirname(p) for p in files}
    names = {os.path.basename(p) for p in files}
    missing = []
    for path, text in scanned(files):
        for n, cited, resolved in citations(path, text):
            if resolved is None:  # outside the repository (../shared/...): not a citation of ours
                continue
            ok = (resolved in names) if "/" not in cited else (resolved in present)
            if not ok and cited not in ALLOWED:
                missing.append((f"{path}:{n}: {cited}", resolved))
    # A path git ignores is a build output (eagle3_ops/_built_with.py, written by setup.py), not a missing source.
    ignored = set(git("check-ignore", "-z", "--stdin", stdin="".join(r + "\0" for _, r in missing)))
    missing = [m for m, r in missing if r not in ignored]
    assert not missing, "cited but not in the repository (git ls-files):\n" + "\n".join(missing)


def in_history(ref: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", ref], cwd=ROOT, capture_output=True).returncode == 0


def test_every_file_cited_from_history_is_in_that_commit():
    """A shallow clone that lacks a cited commit cannot tell: that citation is not checked."""
    files = tracked()
    shallow = git("rev-parse", "--is-shallow-repository") == ["true\n"]
    missing = []
    for path, text in scanned(files):
        for n, commit, cited in history_citations(text):
            if shallow and not in_history(commit + "^{commit}"):
                continue
            if not in_history(f"{commit}:{cited}"):
                missing.append(f"{path}:{n}: {commit}:{cited}")
    assert not missing, "cited from git history but not in that commit (git cat-file -e):\n" + "\n".join(missing)


def test_scanner_finds_paths_and_skips_what_is_not_ours():
    text = ("see docs/design.md and `bench/results/capture_aux_h200.json`; DESIGN.md\n"
            "https://github.com/x/y/blob/main/docs/nothing.md ../shared/DESIGN_NOTES.txt\n"
            "f'bench/results/e2e_{name}.json' csrc/<op>.cu tests/test_*.py torch/utils/cpp_extension.py\n"
            "[chart](../bench/results/e2e.png) (results/fc_sweep_h200.log)\n"
            "(b819f17:bench/results/mla_sweep_cut_h200.log; mla_sm90_early_h200.log) math.log $OUT/e2e_h200.json\n")
    found = [(n, c, r) for n, c, r in citations("docs/x.md", text)]
    assert found == [(1, "docs/design.md", "docs/design.md"),
                     (1, "bench/results/capture_aux_h200.json", "bench/results/capture_aux_h200.json"),
                     (1, "DESIGN.md", "DESIGN.md"),
                     (4, "../bench/results/e2e.png", "bench/results/e2e.png"),
                     (4, "results/fc_sweep_h200.log", "bench/results/fc_sweep_h200.log"),
                     (5, "mla_sm90_early_h200.log", "mla_sm90_early_h200.log")]
    assert list(history_citations(text)) == [(5, "b819f17", "bench/results/mla_sweep_cut_h200.log")]


def test_results_doc_is_generated():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "results_table.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def schemas() -> dict[str, tuple[list[str], list[str]]]:
    """op -> (argument names, return names), from csrc/registration.cpp's m.def strings (public ops only)."""
    with open(os.path.join(ROOT, "csrc", "registration.cpp")) as f:
        src = f.read()
    ops = {}
    for m in re.finditer(r"m\.def\(\s*((?:\"[^\"]*\"\s*)+)\)", src):
        schema = "".join(re.findall(r"\"([^\"]*)\"", m.group(1)))
        name, args, returns = re.match(r"(\w+)\((.*?)\)\s*->\s*\(?(.*?)\)?$", schema).groups()
        if not name.startswith("_"):
            ops[name] = ([a.split("=")[0].split()[-1] for a in args.split(",")],
                         [r.split()[-1] for r in returns.split(",") if r.strip()])
    return ops


def schema_args() -> dict[str, list[str]]:
    """op -> argument names (schemas())."""
    return {op: args for op, (args, _) in schemas().items()}


def documented_args(path: str) -> dict[str, list[str]]:
    """op -> argument names, from the first column of a markdown table of `op(arg [shape], ...)` rows."""
    ops = {}
    with open(os.path.join(ROOT, path)) as f:
        for m in re.finditer(r"^\| `(\w+)\(([^`]*?)\)(?: -> [^`]*)?` \|", f.read(), re.M):
            args = re.sub(r"\[[^\]]*\]", "", m.group(2))  # shapes, and kv_accept's caches![]
            ops[m.group(1)] = [re.match(r"\s*(\w+)", a).group(1) for a in args.split(",")]
    return ops


@pytest.mark.parametrize("path", ["README.md", "docs/design.md"])
def test_op_tables_name_the_schemas_arguments(path):
    expected = schema_args()
    assert len(expected) == 9
    assert documented_args(path) == expected, f"{path}'s op table differs from csrc/registration.cpp"


def test_readme_op_table_names_the_schemas_returns():
    """An op that returns tensors shows them in the README's table as `op(...) -> (name, ...)`, the schema's
    names in order; a mutating op returns () and shows no arrow."""
    with open(os.path.join(ROOT, "README.md")) as f:
        rows = dict(re.findall(r"^\| `(\w+)\([^`]*?\)((?: -> [^`]*)?)` \|", f.read(), re.M))
    shown = {op: [r.strip() for r in arrow.strip(" ->()").split(",")] if arrow else [] for op, arrow in rows.items()}
    assert shown == {op: returns for op, (_, returns) in schemas().items()}
