"""The docs name only what exists: every backticked repository path and Python name in docs/*.md
and README.md resolves.

What counts (inline code spans, outside fenced blocks; anything with a space is a command):
- a path: has a `/` or ends in a known file extension. `a/b.py` and `a/b/` must exist at the
  repository root or end a path in it (`backends/` beside the gpu/ row of a table); `../x`
  must exist beside the repository (skipped where x is absent, as on a machine without
  shared/); a bare `name.py` (or .md, .sh, .cpp) must be some file's name, while other bare
  names (`config.json`) are a checkpoint's. UPPER_CASE first parts (`RUN_DIR/config.json`), `~`
  and absolute paths (`/health`, `/proc/PID/stat`) are not the repository's; a path of this
  machine (/work/..., /root/...) fails anywhere in a doc, fenced commands included.
- a dotted name (`conveyor.wire.channel.Sender`, `Scheduler.from_config`, `presets.CPU_TINY`):
  `conveyor.` and importable third-party names import and getattr; otherwise the first part is
  a class or module of the package and the second a name defined in it. A lowercase first part
  that is neither is a JSON path (`stream_options.include_usage`) and is skipped.
- a CapWords name (`BlockManager`, `StepPlan`): a class, function or top-level name somewhere in
  the package, or a string the package holds (the Hugging Face architecture names).
- a call (`execute()`, `fit(measurements)`, `WorkerReady(num_kv_blocks)`): the name before the
  parentheses, by the rules above; a bare lowercase call must be a function or method.
Snake-case words without parentheses (`max_tokens`, `may_plan`) are JSON keys, flags and metric
labels as often as Python names, and are not checked.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("conveyor", "stages", "wire", "gpu", "config")
DOCS = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]  # docs/benchmarks/ too
EXTENSIONS = {"py", "md", "json", "yml", "yaml", "sh", "cpp", "txt", "toml", "safetensors", "Dockerfile", "png", "pid", "csv"}
REPO_FILE_EXTENSIONS = {"py", "md", "sh", "cpp"}  # bare names with these are the repository's own files

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(?:\.{_IDENT})+")
_CALL = re.compile(rf"({_IDENT}(?:\.{_IDENT})*)\([^()]*\)")
_CAPWORDS = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")
_PATHLIKE = re.compile(r"[\w.~$-]*(?:/[\w.*-]*)+|[\w-]+\.[\w]+")


@dataclass
class Index:
    """Names the package defines, from its source with ast (nothing imported)."""

    modules: dict[str, set[str]] = field(default_factory=dict)  # file stem -> its top-level names
    classes: dict[str, set[str]] = field(default_factory=dict)  # class name -> its members
    functions: set[str] = field(default_factory=set)  # every def, top-level or method
    strings: set[str] = field(default_factory=set)  # identifier-like string constants

    def top_level(self) -> set[str]:
        return set().union(*self.modules.values())


def _class_members(node: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):  # attributes set in methods: self.x = ...
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                members.add(t.attr)
    return members


def build_index(roots: list[Path]) -> Index:
    index = Index()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            top = index.modules.setdefault(path.stem if path.stem != "__init__" else path.parent.name, set())
            for stmt in tree.body:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    top.add(stmt.name)
                elif isinstance(stmt, ast.Assign):
                    top.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    top.add(stmt.target.id)
                elif isinstance(stmt, ast.ImportFrom | ast.Import):
                    top.update((a.asname or a.name).split(".")[0] for a in stmt.names)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    index.classes.setdefault(node.name, set()).update(_class_members(node))
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    index.functions.add(node.name)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    index.strings.add(node.value)
    return index


@cache
def package_index() -> Index:
    return build_index([REPO / d for d in PACKAGE_DIRS])


@cache
def repo_paths(repo: Path = REPO) -> frozenset[str]:
    """Every file and folder, relative to the repository root (a folder ending in /)."""
    skip = {".git", "build", "__pycache__"}
    paths = (p for p in repo.rglob("*") if not skip & set(p.relative_to(repo).parts))
    return frozenset(p.relative_to(repo).as_posix() + ("/" if p.is_dir() else "") for p in paths)


def _import_attr(dotted: str) -> bool:
    """`a.b.c`: import the longest importable prefix, getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


GENERATED = {"build"}  # git-ignored folders the tools write (setuptools' build/)


def check_path(token: str, repo: Path = REPO) -> str | None:
    """None when the path resolves (or is a placeholder), else why not."""
    if token.startswith(("~", "$", "/")) or "*" in token:
        return None
    first = token.split("/")[0]
    if first.isupper():  # RUN_DIR/config.json
        return None
    if first in GENERATED:  # made by a tool, absent from a fresh clone
        return None
    if first == "..":
        beside = repo.parent / token.split("/")[1]
        if not beside.is_dir():
            return None  # shared/ is not on every machine
        return None if (repo / token).exists() else "not found beside the repository"
    if "/" not in token:
        if token.rsplit(".", 1)[-1] not in REPO_FILE_EXTENSIONS:
            return None
        found = any(p == token or p.endswith("/" + token) for p in repo_paths(repo))
        return None if found else "no file of this name in the repository"
    if (repo / token).exists() or any(p.endswith("/" + token) for p in repo_paths(repo)):
        return None
    return "not found in the repository"


def _is_installed_module(name: str) -> bool:
    """A top-level module installed outside the repository (torch, triton): its name wins over a
    subpackage of ours with the same name (gpu/backends/torch/)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = spec.origin if spec is not None else None
    return origin is not None and not Path(origin).resolve().is_relative_to(REPO)


def check_name(token: str, index: Index | None = None) -> str | None:
    """None when the Python name resolves, else why not."""
    index = index or package_index()
    parts = token.split(".")
    head = parts[0]
    ours = head in index.modules or head in index.classes
    if head == "conveyor" or _is_installed_module(head) or (not ours and importlib.util.find_spec(head)):
        return None if _import_attr(token) else "does not import"
    if len(parts) > 1:
        if head in index.classes:
            return None if parts[1] in index.classes[head] else f"{head} has no {parts[1]}"
        if head in index.modules:
            return None if parts[1] in index.modules[head] else f"module {head} has no {parts[1]}"
        if head in index.top_level():
            return None  # a constant (A100_7B.scaled): its type is not known without running it
        if head[0].islower():
            return None  # a JSON path such as stream_options.include_usage
        return "no class or module of this name in the package"
    if head in index.classes or head in index.functions or head in index.top_level() or head in index.strings:
        return None
    return "defined nowhere in the package"


def classify(token: str) -> tuple[str, str] | None:
    """(kind, what to check) for a code span, or None when it is not a path or Python name."""
    token = token.strip()
    if " " in token or ":" in token or "=" in token.split("(")[0]:
        return None  # a command, a URL, an environment assignment
    if call := _CALL.fullmatch(token):
        return "name", call.group(1)
    if "(" in token or "[" in token or "{" in token:
        return None  # an expression such as ewm(span=16).mean()
    if _DOTTED.fullmatch(token) and token.rsplit(".", 1)[1] not in EXTENSIONS:
        return "name", token
    if _PATHLIKE.fullmatch(token) and ("/" in token or token.rsplit(".", 1)[-1] in EXTENSIONS):
        return "path", token
    if _CAPWORDS.fullmatch(token):
        return "name", token
    return None


def spans(text: str) -> list[str]:
    return _SPAN.findall(_FENCE.sub("", text))


def unresolved(text: str, repo: Path = REPO, index: Index | None = None) -> list[str]:
    problems = []
    for token in spans(text):
        kind_and_target = classify(token)
        if kind_and_target is None:
            continue
        kind, target = kind_and_target
        why = check_path(target, repo) if kind == "path" else check_name(target, index)
        if why is not None:
            problems.append(f"`{token}`: {why}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_names_resolve(doc: Path):
    problems = unresolved(doc.read_text())
    assert not problems, f"{doc.relative_to(REPO)} names what does not exist:\n" + "\n".join(problems)


def machine_paths(text: str) -> list[str]:
    """Absolute paths of one machine's file system, fenced commands included."""
    return re.findall(r"(?<![\w./])/(?:work|root|home)/[^\s`]*", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_has_no_machine_paths(doc: Path):
    found = machine_paths(doc.read_text())
    assert not found, f"{doc.relative_to(REPO)}: write these relative to the repository: {found}"


def test_package_docstrings_name_files_that_exist():
    """Each package's docstring names only files that exist beside it."""
    problems = []
    for init in sorted(p for d in PACKAGE_DIRS for p in (REPO / d).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for name in re.findall(r"\b[\w]+\.py\b", doc):
            if not (init.parent / name).exists():
                problems.append(f"{init.relative_to(REPO)}: {name}")
    assert not problems, "package docstrings name missing files:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "text",
    [
        "the `BlockPool` hands out blocks",
        "see `stages/scheduler/block_pool.py`",
        "`conveyor.wire.channel.NoSuchSender`",
        "`Scheduler.no_such_method`",
        "`no_such_function()`",
        "`no_such_module.py`",
    ],
)
def test_a_made_up_name_fails(text: str):
    assert unresolved(text), text


def test_a_machine_path_fails():
    assert machine_paths("python -m conveyor.sim --path /work/shared/workloads/sharegpt_sample.json")
    assert not machine_paths("`GET /health`, ../shared/workloads/sharegpt_sample.json, /proc/PID/stat")


@pytest.mark.parametrize(
    "text",
    [
        "`stages/scheduler/block_manager.py`, `docs/benchmarks.md`, `block_manager.py`, `gpu/sampling/`",
        "`BlockManager`, `conveyor.wire.channel.Sender`, `Scheduler.add_request`, `execute()`",
        "`--max-num-seqs`, `max_tokens`, `conveyor serve --help`, `GET /health`, `CONVEYOR_API_KEY`",
        "`stream_options.include_usage`, `RUN_DIR/config.json`, `~/.cache/conveyor`, `config.json`, `/health`",
        "```\n`NotCheckedInAFence`\n```",
    ],
)
def test_real_names_and_non_names_pass(text: str):
    assert unresolved(text) == []


def test_a_generated_folder_resolves_before_it_is_made(tmp_path):
    # setuptools writes build/ while building a wheel: a doc may name what it holds.
    assert check_path("build/lib/conveyor/", tmp_path) is None
    assert check_path("stages/lib/conveyor/", tmp_path) == "not found in the repository"
