"""The package's architecture, read from its source: layers, no import cycles, group words only in groups.

Every `import` and `from ... import` in `dspark_jax/` counts, deferred ones inside functions included.
The rules (README, "Architecture"):

- top-level packages form the layers of `LAYERS`, bottom up: a module imports only its own package and
  packages of lower layers (so no package imports one above it, and no two packages import each other);
- no import cycle between modules either;
- the libraries (`LIBRARIES`) import nothing from `groups`, `run`, `training`, `inference`, `suite`, `cli`;
- no file outside `dspark_jax/groups/` holds a group's name or one of its config keys (read from the
  registry: names, shape/resumable/path keys, decoding flags, draft settings), except `ALLOWED`.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

from configs import baseline
from dspark_jax import groups
from dspark_jax.draft.model import DraftConfig

PACKAGE = Path(__file__).resolve().parents[1] / "dspark_jax"
# the commands: `python -m dspark_jax.<command>` runs dspark_jax/<command>.py (its flags and `main`)
ENTRY = "<commands>"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("<root>", "errors", "nn", "sharding"),  # <root>: the package's own __init__ (the shape legend)
    ("kernels",),
    ("target",),
    ("data",),
    ("cache",),
    ("draft",),
    ("interop",),
    ("inference",),
    ("groups",),
    ("run",),
    ("training",),
    ("suite",),
    ("cli",),
    (ENTRY,),
)
LIBRARIES = ("nn", "sharding", "kernels", "target", "data", "cache", "draft")
UPPER = ("groups", "run", "training", "inference", "suite", "cli")

# Words that name a group or one of its keys and still belong elsewhere, each with its reason.
GENERIC = {
    "baseline": "the seed's name for the base draft that every group extends (`draft/`)",
    "memory": "also device memory (the AOT check), and the attention's `[context; memory; block]` operand",
}
# Files outside groups/ that may name a group, each with its reason.
ALLOWED = {
    "fit_engram.py": "the Engram groups' table-fitting command, `python -m dspark_jax.fit_engram`",
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """`{dotted module name: path}` of every module of the package (a package as its `__init__`)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its body."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join([*base[: len(base) - node.level + 1], *([module] if module else [])])
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(package)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


# the top-level modules that are not commands: libraries at the root, and the commands' shared plumbing
TOP_MODULES = ("errors", "nn", "sharding", "cli")


def top_package(module: str, package: Path = PACKAGE) -> str:
    """The layer key of a module: its top-level package or module (`TOP_MODULES`), `<root>` for the
    package's `__init__`, `ENTRY` for a command (any other top-level module)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "<root>"
    command = len(parts) == 2 and not (package / parts[1]).is_dir() and parts[1] not in TOP_MODULES
    return ENTRY if command else parts[1]


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(graph: Mapping[str, set[str]], package: Path = PACKAGE) -> Iterator[str]:
    """Every import that breaks a layer rule, as `a -> b (why)`."""
    rank = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    for module, targets in sorted(graph.items()):
        here = top_package(module, package)
        for target in sorted(targets):
            there = top_package(target, package)
            if here not in rank or there not in rank:
                missing = here if here not in rank else there
                yield f"{module} -> {target} (a package missing from LAYERS: {missing})"
            elif rank[there] > rank[here]:
                yield f"{module} -> {target} (upward: {here} is below {there})"
            elif rank[there] == rank[here] and there != here:
                yield f"{module} -> {target} (sideways between {here} and {there})"
            elif here in LIBRARIES and there in UPPER:
                yield f"{module} -> {target} (a library imports {there})"


def module_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Module cycles, not counting a package's `__init__` importing its own modules."""
    inner = lambda a, b: a.startswith(b + ".") or b.startswith(a + ".")
    return cycles({m: {t for t in ts if not inner(m, t)} for m, ts in graph.items()})


def package_cycles(graph: Mapping[str, set[str]], package: Path = PACKAGE) -> list[list[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        here = top_package(module, package)
        edges[here] |= {top_package(t, package) for t in targets} - {here}
    return cycles(edges)


def group_words() -> set[str]:
    """Every registered group's name, config sections of its own, and config keys (the last part of a
    dotted key: its draft settings beyond the base draft's, shape/resumable keys, decoding flags), and the
    first word of each (`rerank_width` -> `rerank`), lower case, less `GENERIC`."""
    shared = set(baseline.get_config("smoke"))  # the sections every config has
    base_settings = {f.name for f in dataclasses.fields(DraftConfig)}
    words = set()
    for e in groups.registered():
        keys = [*e.run.shape_keys, *e.run.resumable_keys, *(option.key for option in e.run.decode_options)]
        sections = {k.split(".")[0] for k in keys} | {s for s, _ in (*e.run.path_keys, *e.run.source_keys)}
        words |= {e.name, *(k.rsplit(".", 1)[-1] for k in keys), *(sections - shared)}
        words |= {f.name for f in dataclasses.fields(e.model.config_class)} - base_settings
    words |= {w.split("_")[0] for w in words}  # 'rerank_width' -> 'rerank', 'engram_markov' -> 'engram'
    return {w.lower() for w in words} - set(GENERIC)


def group_word_lines(package: Path = PACKAGE, words: set[str] | None = None) -> list[str]:
    """`path:line: word` for every code line (comments aside) outside `groups/` that holds a group word."""
    alternatives = sorted(map(re.escape, words or group_words()), key=len, reverse=True)
    pattern = re.compile("|".join(alternatives), re.I)
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("groups/") or rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if found := pattern.search(line.split("#", 1)[0]):
                out.append(f"{rel}:{n}: {found.group(0)}")
    return out


def test_layers_hold_and_nothing_imports_upward():
    assert list(violations(import_graph())) == []


def test_no_import_cycle_between_modules_or_packages():
    graph = import_graph()
    assert module_cycles(graph) == [] and package_cycles(graph) == []


def test_every_top_level_package_has_a_layer():
    packages = {top_package(m) for m in modules()}
    assert packages <= {p for layer in LAYERS for p in layer}, packages


def test_no_group_word_outside_the_group_packages():
    assert {"engram", "engram_dim", "memory_source", "rerank", "reranker_joint"} <= group_words()
    assert group_word_lines() == []


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    package = tmp_path / "dspark_jax"
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_checks_fail_on_an_upward_import_a_cycle_and_a_group_word(tmp_path):
    """The rules above, applied to a tiny package that breaks each of them once (a deferred import too)."""
    package = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "draft/__init__.py": "",
            "draft/model.py": "def f():\n    from dspark_jax.run import assemble  # deferred: counted\n",
            "run/__init__.py": "",
            "run/assemble.py": "from dspark_jax.draft import model\nfrom dspark_jax.run import other\n",
            "run/other.py": "from dspark_jax.run import assemble\nENGRAM_TABLE = 1\n",
            "groups/__init__.py": "ENGRAM = 1\n",
        },
    )
    graph = import_graph(package)
    assert list(violations(graph, package)) == [
        "dspark_jax.draft.model -> dspark_jax.run (upward: draft is below run)",
        "dspark_jax.draft.model -> dspark_jax.run.assemble (upward: draft is below run)",
    ]
    assert module_cycles(graph) == [
        ["dspark_jax.draft.model", "dspark_jax.run.assemble", "dspark_jax.run.other"]
    ]
    assert package_cycles(graph, package) == [["draft", "run"]]
    assert group_word_lines(package, {"engram"}) == ["run/other.py:2: ENGRAM"]


def runnable_modules(package: Path = PACKAGE) -> set[str]:
    """The package's modules that `python -m` runs: a `__main__.py`, or a `__name__ == "__main__"` guard."""
    guard = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)
    return {
        name
        for name, path in modules(package).items()
        if path.name == "__main__.py" or guard.search(path.read_text())
    }


def documented_commands() -> set[str]:
    """Every `python -m dspark_jax.<command>` that the README and `docs/` name."""
    found = set()
    for path in [PACKAGE.parent / "README.md", *sorted((PACKAGE.parent / "docs").glob("*.md"))]:
        found |= set(re.findall(r"python -m (dspark_jax\.\w+)", path.read_text()))
    return found


def test_each_command_is_one_runnable_module_and_every_documented_one_exists():
    commands = {m for m in modules() if top_package(m) == ENTRY}
    assert runnable_modules() == commands
    assert documented_commands() <= commands, documented_commands() - commands
    assert {"dspark_jax.train", "dspark_jax.experiments", "dspark_jax.speculate"} <= commands


# The run config's sections that nothing else is named after (`configs/base.py`): reading one of them off an
# object means reading the run config. `run/` resolves a config into the libraries' own inputs (specs,
# rules, paths); the layers below `groups` take those, never the config.
RUN_CONFIG_SECTIONS = {"data", "train", "generate", "init", "mesh", "sharding", "preset", "experiment"}
NO_RUN_CONFIG = (*LIBRARIES, "interop", "inference")


def run_config_reads(package: Path = PACKAGE) -> list[str]:
    """`path:line: name.section` for every read of a run-config section (`x.data`, `x.get("data")`) in a
    module of `NO_RUN_CONFIG`."""
    out = []
    for name, path in modules(package).items():
        if top_package(name, package) not in NO_RUN_CONFIG:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner, section = node.value.id, node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name)
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                owner, section = node.func.value.id, node.args[0].value
            else:
                continue
            if owner in ("config", "cfg", "run_config") and section in RUN_CONFIG_SECTIONS:
                out.append(f"{path.relative_to(package).as_posix()}:{node.lineno}: {owner}.{section}")
    return sorted(out)


def test_no_library_reads_the_run_config():
    assert run_config_reads() == []


def test_the_run_config_check_finds_a_library_reading_it(tmp_path):
    package = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "cache/__init__.py": "",
            "cache/build.py": "def f(config):\n    return config.data.max_length, config.get('train')\n",
            "run/__init__.py": "",
            "run/caches.py": "def spec(config):\n    return config.data.max_length\n",  # run/ may
        },
    )
    assert run_config_reads(package) == ["cache/build.py:2: config.data", "cache/build.py:2: config.train"]
