"""The layer rule: every posttrain module imports only from its own layer or the layers below it,
no two modules import each other (directly or round a cycle), and nothing in the SDK imports
`posttrain.notebook`. Imports are read with `ast`, including those inside functions and those
under `if TYPE_CHECKING:` (for annotations only, never executed): a type checker follows them,
so a module that names the type of an object from a module importing it is a cycle too; the
type belongs in a module below both (e.g. `train/plan_value.py`) or a Protocol the lower module
owns (`launch/run_record.py:RecordedJob`).

The layers, lowest first, are `LAYERS` below (docs/design/architecture.md draws them). A failure
names the offending edge: the importing module, the imported one and their layers.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A module's layer is its first two name parts (posttrain.rl.trainer -> "rl");
# `posttrain` itself (lazy names for notebooks) stands on every layer below the command line.
# `posttrain.cli` is the top: it loads a recipe (recipes/*.py, which stand on `posttrain` and
# every layer below) and calls its `main`, so nothing imports it
# (`test_nothing_below_the_cli_names_it`).
LAYERS = (
    "core",
    "models",
    "policy",
    "data",
    "rewards",
    "verifiers",
    "train",
    "preference",
    "rl",
    "envs",
    "launch",
    "workflows",
    "notebook",
    "",
    "cli",
)
RANK = {name: i for i, name in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    """Every posttrain module name -> its file, from pyproject's package-dir mapping."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mods: dict[str, Path] = {}
    for pkg, folder in cfg["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [
                p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"
            ]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _owner(name: str) -> str | None:
    """The posttrain module that `name` (a module or module.attribute) lives in."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """posttrain modules that `module` imports anywhere in its file (functions and
    `if TYPE_CHECKING:` blocks included)."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                node_module = ".".join(base)
            else:
                node_module = node.module or ""
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            targets = [
                f"{node_module}.{a.name}" if f"{node_module}.{a.name}" in MODULES else node_module
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            owner = _owner(target)
            if owner is not None and owner != module:
                found.add(owner)
    return found


EDGES = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_known_layer():
    unknown = sorted(m for m in MODULES if layer(m) not in RANK)
    assert not unknown, f"modules outside every layer (add the layer to LAYERS and docs): {unknown}"


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in sorted(EDGES.items())
        for t in sorted(targets)
        if RANK[layer(t)] > RANK[layer(m)]
    ]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.py") if not p.name.startswith("_"))
_NAMES_THE_CLI = re.compile(r"\bposttrain\.cli\b|\bfrom\s+posttrain\s+import\s[^\n]*\bcli\b")


def _absolute_imports(path: Path) -> set[str]:
    """Dotted names a file's absolute imports load (`from a import b` gives a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_nothing_below_the_cli_names_it():
    """cli -> recipes -> workflows -> ...: the command line loads a recipe and calls its `main`,
    so no recipe and no package module below the cli imports `posttrain.cli`, nor names it in a
    string or comment (an `importlib` call, or text that describes what the command line does
    instead of the function below it that does it)."""
    files = {m: p for m, p in MODULES.items() if layer(m) != "cli"}  # the cli package's own
    files.update({f"recipes/{p.name}": p for p in RECIPES})
    importers = [
        f"{name} imports posttrain.cli"
        for name, path in sorted(files.items())
        if "posttrain.cli" in _absolute_imports(path)
    ]
    named = [
        f"{name}:{i}: {line.strip()}"
        for name, path in sorted(files.items())
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _NAMES_THE_CLI.search(line)
    ]
    assert RECIPES and not importers and not named, "\n".join(
        ["below the cli (cli -> recipes -> workflows -> ...):", *importers, *named]
    )


def test_the_cli_check_sees_an_import_and_a_mention(tmp_path):
    recipe = tmp_path / "r.py"
    recipe.write_text("from posttrain import cli, workflows\nimport posttrain.cli as c\n")
    assert {"posttrain.cli", "posttrain.workflows"} <= _absolute_imports(recipe)
    assert _NAMES_THE_CLI.search("# a recipe file loaded by posttrain.cli")
    assert _NAMES_THE_CLI.search("from posttrain import data, cli")
    assert not _NAMES_THE_CLI.search("posttrain.client, posttrain.clip, cli_args")


def test_nothing_in_the_sdk_imports_the_notebook_layer():
    users = [
        f"{m} imports {t}"
        for m, targets in sorted(EDGES.items())
        for t in sorted(targets)
        if layer(t) == "notebook" and layer(m) not in ("notebook", "")
    ]
    assert not users, "\n".join(users)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(EDGES)
    described = []
    for component in cycles:
        inside = set(component)
        described.append(
            "; ".join(f"{m} -> {t}" for m in component for t in sorted(EDGES[m] & inside))
        )
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_cycle_and_names_its_edges():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", ["posttrain.rl.trainer", "posttrain.envs.reasoning_gym_env"])
def test_imports_inside_functions_are_read(module):
    # rl.trainer imports the engine at module level; envs' calculator imports inside a function.
    assert EDGES[module], f"{module} reads as importing nothing"


# Not the project's files: the virtual environment, git's own folder, the `posttrain -> sdk`
# link (its files are sdk/'s) and build output.
_NOT_THE_PROJECTS = {".venv", ".git", "posttrain", "build"}


def _python_files() -> list[Path]:
    """Every *.py file of the repository, relative to ROOT: the ones git tracks and the new ones it
    would (not ignored), so a file is checked before it is committed; outside a git checkout (an
    unpacked copy), every *.py under ROOT. The virtual environment, the `posttrain` link and
    build output are left out either way."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split("\0")
        paths = {Path(name) for name in listed if name}
    except (OSError, subprocess.SubprocessError):
        paths = {p.relative_to(ROOT) for p in ROOT.rglob("*.py")}
    return sorted(
        p
        for p in paths
        if p.parts[0] not in _NOT_THE_PROJECTS
        and "__pycache__" not in p.parts
        and (ROOT / p).is_file()  # tracked, but deleted in the working tree
    )


def test_sizes_stay_under_500_lines():
    """Every Python file of the repository (package, recipes, tests, benchmarks, ...) has at most
    500 lines; a failure names each file over it with its line count."""
    files = _python_files()
    tops = {p.parts[0] for p in files}
    assert {"sdk", "envs", "verifiers", "recipes", "tests", "benchmarks"} <= tops, tops
    big = {str(p): n for p in files if (n := len((ROOT / p).read_text().splitlines())) > 500}
    assert not big, (
        f"files over 500 lines (two ideas share them; split each by idea into a new module): {big}"
    )
