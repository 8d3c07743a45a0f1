"""The project's shape, checked from its files: the import graph, module sizes, and the docs' commands.

- Import graph, read from the source with `ast` (every import at any depth, function bodies included):
  no cycle among the project's modules; `infer` and `train` do not import each other; `spd_jax` (the
  library) imports none of `train`, `infer`, `bench`.
- No non-test module over MAX_MODULE_LINES lines, and no function in spd_jax/ over MAX_FUNCTION_LINES (its
  decorators and body included): a function a reader can follow in one screen. `api.generate` takes at most
  MAX_GENERATE_PARAMETERS parameters (its options as typed objects).
- Every command in a fenced shell block of README.md and docs/**/*.md that runs a project module
  (`python -m X ...` / `python3 -m X ...`, X under spd_jax/, train/, infer/, bench/) parses as written:
  the module's `main(argv)` runs with `ArgumentParser.parse_args` / `parse_intermixed_args` patched to
  parse for real and then raise a sentinel, so nothing past the parse runs. Every repository path such a
  command names exists.
- No git commit hashes in README or docs prose: provenance lives in the shipped drafters' cards and
  lineage files, by content digest.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spd_jax", "train", "infer", "bench")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
MAX_GENERATE_PARAMETERS = 8


# ---------------------------------------------------------------------------------------------------------------
# import graph


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(root: Path | None = None) -> dict[str, Path]:
    """Project module name -> its file, for every .py under PACKAGES."""
    root = ROOT if root is None else root
    return {_module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def _resolve(name: str, modules) -> str | None:
    """The project module a dotted name refers to: the longest prefix of it that is a project module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in its file. `from P import x` counts as an import
    of the module P.x when that is a module, else of P."""
    return _graph(ROOT)


@functools.lru_cache(maxsize=None)
def _graph(root: Path) -> dict[str, set[str]]:  # read once per tree: every graph test shares it
    modules = _sources(root)
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 more
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for n in names:
                target = _resolve(n, modules)
                if target is not None and target != mod:
                    deps.add(target)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _top(mod: str) -> str:
    return mod.split(".")[0]


def test_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles among project modules: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("importer, forbidden", [
    ("infer", ("train",)),
    ("train", ("infer",)),
    ("spd_jax", ("train", "infer", "bench")),
])
def test_layers_import_downward_only(importer, forbidden):
    bad = sorted(f"{m} imports {d}" for m, deps in import_graph().items() if _top(m) == importer
                 for d in deps if _top(d) in forbidden)
    assert not bad, f"{importer} must not import {', '.join(forbidden)}: " + "; ".join(bad)


# the library's layers, lowest first (docs/design.md's diagram): a module imports only modules of its own layer
# or below. A name covers its package; the longest name that covers a module places it; `spd_jax` is the
# package's own __init__ only.
LAYERS = (
    ("spd_jax.config", "spd_jax.progress", "spd_jax.datasets", "spd_jax.placements"),
    ("spd_jax.models", "spd_jax.sharding", "spd_jax.convert"),  # convert: HF / GGUF / random checkpoints
    ("spd_jax.distributed",),
    ("spd_jax.drafters", "spd_jax.convert.eagle3"),  # eagle3: reads the drafter's weight schema
    ("spd_jax.pipeline",),  # partition and stages
    ("spd_jax.costs",),  # the analytic cost model, and the measured cycle profile it is fitted to
    ("spd_jax.decode",),
    ("spd_jax.methods", "spd_jax.api", "spd_jax"),
    ("spd_jax.reports", "spd_jax.convert.reference_psm"),  # reference_psm: converts to a drafter, with its card
)


def layer_of(mod: str) -> int | None:
    """The index in LAYERS of the longest name covering mod (`spd_jax` covers only itself), or None."""
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            if mod == n or (n != "spd_jax" and mod.startswith(n + ".")):
                if best is None or len(n) > len(best[1]):
                    best = (i, n)
    return None if best is None else best[0]


def test_library_imports_its_own_layer_or_below():
    graph = import_graph()
    lib = [m for m in graph if _top(m) == "spd_jax"]
    unplaced = sorted(m for m in lib if layer_of(m) is None)
    assert not unplaced, "library modules in no layer of LAYERS: " + ", ".join(unplaced)
    up = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})" for m in lib
                for d in graph[m] if _top(d) == "spd_jax" and layer_of(d) > layer_of(m))
    assert not up, "imports upward across the library's layers: " + "; ".join(up)


def test_the_graph_reader_sees_imports_in_functions_and_relative_ones(tmp_path, monkeypatch):
    pkg = tmp_path / "spd_jax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from spd_jax.sub.b import g\n    return g\n")
    (pkg / "sub" / "b.py").write_text("from .a import f\nimport spd_jax.c as c\n")
    (pkg / "c.py").write_text("from spd_jax import sub\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    g = import_graph()
    assert g["spd_jax.sub.a"] == {"spd_jax.sub.b"}
    assert g["spd_jax.sub.b"] == {"spd_jax.sub.a", "spd_jax.c"}
    assert g["spd_jax.sub"] == {"spd_jax.sub.b"}
    assert g["spd_jax.c"] == {"spd_jax.sub"}
    assert cycles(g) == [["spd_jax.c", "spd_jax.sub", "spd_jax.sub.a", "spd_jax.sub.b"]]


# ---------------------------------------------------------------------------------------------------------------
# sizes


def test_no_module_over_the_size_limit():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _sources().items()}
    over = sorted(((n, m) for m, n in sizes.items() if n > MAX_MODULE_LINES), reverse=True)
    assert not over, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(f"{m} ({n})" for n, m in over)


def long_functions(source: str, limit: int) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every function or method in source longer than limit lines, from its first
    decorator to its last line (nested functions counted in their parent and on their own)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - start + 1 > limit:
                found.append((node.lineno, node.name, node.end_lineno - start + 1))
    return found


def test_no_library_function_over_the_size_limit():
    over = [f"{path.relative_to(ROOT)}:{line} {name} ({n})" for mod, path in _sources().items()
            if _top(mod) == "spd_jax" for line, name, n in long_functions(path.read_text(), MAX_FUNCTION_LINES)]
    assert not over, f"functions in spd_jax/ over {MAX_FUNCTION_LINES} lines: " + ", ".join(over)


def test_generate_takes_one_options_object_per_concern():
    """`api.generate` takes the model, the prompt, the budget and at most five more: the sampling rule and the
    method as one typed value each (`Sampling`, a `methods.Method`), not their fields one by one."""
    import inspect

    from spd_jax import api
    params = inspect.signature(api.generate).parameters
    assert len(params) <= MAX_GENERATE_PARAMETERS, list(params)
    assert {"sampling", "method"} <= set(params)


def test_the_function_length_scan_counts_decorators_and_nested_functions():
    src = "@dec\ndef f():\n    def g():\n        a = 1\n        return a\n    return g\n"
    assert long_functions(src, 5) == [(2, "f", 6)]
    assert long_functions(src, 2) == [(2, "f", 6), (3, "g", 3)]


# ---------------------------------------------------------------------------------------------------------------
# layer kinds: objects in spd_jax/models/ (`models.kinds`), asked, never named, outside it

# the library modules outside spd_jax/models/ that may name a layer kind (`ATTENTION`, `LINEAR`): config.py
# defines the names and reads them from HF configs. docs/design.md ("where to change what") states the bound.
MAX_KIND_NAMERS = 3
KIND_NAMES = re.compile(r"\b(ATTENTION|LINEAR)\b")


def kind_namers() -> list[str]:
    """The library modules outside spd_jax/models/ whose source names a layer kind (as `grep -w` finds it)."""
    return sorted(path.relative_to(ROOT).as_posix() for mod, path in _sources().items()
                  if _top(mod) == "spd_jax" and not mod.startswith("spd_jax.models")
                  and KIND_NAMES.search(path.read_text()))


def test_layer_kinds_are_named_only_inside_models():
    found = kind_namers()
    assert len(found) <= MAX_KIND_NAMERS and found == ["spd_jax/config.py"], (
        "library modules outside spd_jax/models/ naming a layer kind (iterate `models.kinds.KINDS` or ask the "
        "kind object instead): " + ", ".join(found))


def residual_blocks(source: str) -> list[str]:
    """The functions (qualified names) of a module that run a layer's MLP half themselves: a call of `mlp` or
    a read of an `mlp_norm` weight. Only `residual_block` may."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                visit(child, scope + [getattr(child, "name", "<lambda>")])
                continue
            call = isinstance(child, ast.Call) and isinstance(child.func, (ast.Name, ast.Attribute)) and \
                (getattr(child.func, "id", None) or getattr(child.func, "attr", None)) == "mlp"
            norm = isinstance(child, ast.Subscript) and isinstance(child.slice, ast.Constant) and \
                child.slice.value == "mlp_norm"
            if (call or norm) and ".".join(scope) not in found:
                found.append(".".join(scope))
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def test_one_residual_block_definition():
    """The pre-norm residual block (mixer, then MLP, each over a norm, each added) is written once,
    `models.layers.residual_block`, which the decoder's kinds, the PSM, PPSD and EAGLE-3 call."""
    found = [f"{path.relative_to(ROOT).as_posix()}:{fn}" for mod, path in _sources().items()
             if _top(mod) in PACKAGES for fn in residual_blocks(path.read_text())]
    assert found == ["spd_jax/models/layers.py:residual_block"], found


def test_the_residual_block_scan_catches_each_form():
    src = """
def a(lp, x, cfg):
    return x + mlp(lp, rms_norm(x, lp["mlp_norm"], 1e-6), cfg)
class M:
    def b(self, lp, y):
        return layers.mlp(lp, y, None)
    def c(self, lp):
        return lp["mlp_norm"]
def ok(lp):
    return lp["attn_norm"], mlp_size(lp)
"""
    assert residual_blocks(src) == ["a", "M.b", "M.c"]


# ---------------------------------------------------------------------------------------------------------------
# method and drafter names: compared only inside their registries

# what a method or a drafter kind does is an attribute of its object (`spd_jax.methods`,
# `spd_jax.drafters.registry`); only these modules may compare names
REGISTRIES = ("spd_jax/methods.py", "spd_jax/drafters/registry.py", "spd_jax/drafters/kind.py")


def _registered_names() -> set[str]:
    from spd_jax.drafters.registry import KINDS
    from spd_jax.methods import METHODS
    return set(METHODS) | set(KINDS)


def name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every comparison (==, !=, in, is, ..., or a match case) of something against a string
    constant in names, or a tuple / list / set holding one."""
    def consts(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for e in node.elts:
                yield from consts(e)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            sides = [node.value]
        else:
            continue
        if any(v in names for side in sides for v in consts(side)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_method_or_drafter_name_compared_outside_the_registries():
    names = _registered_names()
    bad = [f"{path.relative_to(ROOT)}:{line}: {code}" for path in _sources().values()
           if path.relative_to(ROOT).as_posix() not in REGISTRIES
           for line, code in name_comparisons(path.read_text(), names)]
    assert not bad, ("method or drafter names compared outside the registries (use the method's or the "
                     "DrafterKind's attribute): " + "; ".join(bad))


def test_the_name_comparison_scan_catches_each_form():
    names = {"spd", "psm"}
    src = """
if method == "spd":
    pass
a = kind != 'psm'
b = m in ("ar", "spd")
c = "psm" == k
match method:
    case "spd":
        pass
ok = method == "speed" or key in ("wq", "wk") or f"{method}" != ""
"""
    assert [line for line, _ in name_comparisons(src, names)] == [2, 4, 5, 6, 8]


# ---------------------------------------------------------------------------------------------------------------
# train/ asks a drafter kind's Training record, never which drafter it trains


def _drafter_identities() -> tuple[set[str], set[str]]:
    """(the drafter kinds' config class names, the registry's names for its kinds: PSM, EAGLE3)."""
    from spd_jax.drafters import registry
    from spd_jax.drafters.kind import DrafterKind
    return ({k.config.__name__ for k in registry.KINDS.values()},
            {name for name, v in vars(registry).items() if isinstance(v, DrafterKind)})


def drafter_identity_checks(source: str, configs: set[str], kinds: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every place that asks which drafter something is: isinstance / issubclass against a
    config class in configs, a comparison (is, ==, in, ...) with one of those classes or with a kind named
    in kinds (registry.PSM, PSM), a match case on one of those classes. A kind's attributes (registry.PSM.name,
    kind.staged: what it can do) are not its identity."""
    def names(node):  # what node names itself: PSM, registry.PSM, (A, b.B); not registry.PSM.name
        if isinstance(node, ast.Name):
            return {node.id}
        if isinstance(node, ast.Attribute):
            return {node.attr}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*map(names, node.elts))
        return set()

    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            hit = names(node.args[1]) & configs
        elif isinstance(node, ast.Compare):
            hit = set().union(*(names(side) for side in [node.left, *node.comparators])) & (configs | kinds)
        elif isinstance(node, ast.MatchClass):
            hit = names(node.cls) & configs
        else:
            continue
        if hit:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_train_never_asks_which_drafter_it_trains():
    configs, kinds = _drafter_identities()
    assert configs == {"PSMConfig", "Eagle3Config", "PPSDConfig"} and kinds == {"PSM", "EAGLE3", "PPSD"}
    bad = [f"{path.relative_to(ROOT)}:{line}: {code}" for mod, path in _sources().items() if _top(mod) == "train"
           for line, code in drafter_identity_checks(path.read_text(), configs, kinds)]
    assert not bad, ("train/ branches on which drafter it trains (ask the kind's `Training` record, "
                     "`registry.of_config(spec).training` or `tc.drafter.kind.training`): " + "; ".join(bad))


def test_the_drafter_identity_scan_catches_each_form():
    src = """
if isinstance(spec, Eagle3Config):
    pass
a = isinstance(spec, (eagle3.Eagle3Config, int))
b = registry.kind(m) is registry.PSM
c = kind == PSM
d = type(spec) is PSMConfig
match spec:
    case PSMConfig():
        pass
ok = isinstance(spec, dict) or kind.staged or registry.PSM.name == "x" or spec.kind is other
"""
    found = [line for line, _ in drafter_identity_checks(src, {"PSMConfig", "Eagle3Config"}, {"PSM", "EAGLE3"})]
    assert found == [2, 4, 5, 6, 7, 9]


# ---------------------------------------------------------------------------------------------------------------
# the docs' commands


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "&>"}


def fenced_shell_lines(text: str):
    """(line number, logical line) of every line in a fenced shell block, `\\` continuations joined."""
    fence = None
    pending, start = "", 0
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = (m.group(1), m.group(2).lower() in SHELL_LANGS)
            continue
        if m and m.group(1).startswith(fence[0]) and not m.group(2):
            fence = None
            continue
        if not fence[1]:
            continue
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def simple_commands(line: str) -> list[list[str]]:
    """A shell line's simple commands (split at && || ; | &), comments and redirections dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    cmds, cur, skip = [], [], False
    for tok in lex:
        if skip:
            skip = False
        elif tok in OPERATORS:
            cmds.append(cur)
            cur = []
        elif tok in REDIRECTS:
            skip = True
        else:
            cur.append(tok)
    cmds.append(cur)
    return [c for c in cmds if c]


def project_module(cmd: list[str]) -> tuple[str, list[str]] | None:
    """(module, argv) of a `python[3] -m X ...` command whose X is a project module, else None."""
    for i, tok in enumerate(cmd[:-2]):
        if re.fullmatch(r"(\S*/)?python3?(\.\d+)?", tok) and cmd[i + 1] == "-m":
            mod = cmd[i + 2]
            return (mod, cmd[i + 3:]) if mod.split(".")[0] in PACKAGES else None
    return None


def readme_inline_commands(text: str):
    """(line number, command) of the README's inline `python -m ...` spans (its table of main commands)."""
    for i, line in enumerate(text.splitlines(), 1):
        for cmd in re.findall(r"`(python3? -m [^`]+)`", line):
            yield i, cmd


def doc_commands():
    """(file, line, module, argv, the line as written) of every project command in the docs: fenced shell
    blocks everywhere, and the README's inline ones."""
    out = []
    for path in doc_files():
        lines = list(fenced_shell_lines(path.read_text()))
        if path.name == "README.md" and path.parent == ROOT:
            lines += list(readme_inline_commands(path.read_text()))
        for lineno, line in lines:
            try:
                cmds = simple_commands(line)
            except ValueError as e:  # unbalanced quotes
                if re.search(r"python3? -m (spd_jax|train|infer|bench)\b", line):
                    out.append((path, lineno, None, str(e), line))
                continue
            for cmd in cmds:
                pm = project_module(cmd)
                if pm:
                    out.append((path, lineno, pm[0], pm[1], line))
    return out


COMMANDS = doc_commands()


class Parsed(Exception):
    """Raised by the patched parser once the command line has parsed."""


@pytest.fixture(scope="module")
def parse_only():
    """ArgumentParser's entry points parse for real, then raise Parsed: nothing past the parse runs."""
    originals = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_intermixed_args")}

    def stop_after(orig):
        def parse(self, args=None, namespace=None):
            ns = orig(self, args, namespace)
            raise Parsed(ns)
        return parse

    for name, orig in originals.items():
        setattr(argparse.ArgumentParser, name, stop_after(orig))
    yield
    for name, orig in originals.items():
        setattr(argparse.ArgumentParser, name, orig)


_imported: dict[str, object] = {}


def _module(name: str):
    if name not in _imported:  # each module imported once, whatever the number of commands naming it
        _imported[name] = importlib.import_module(name)
    return _imported[name]


def _run_entry(mod_name: str, argv: list[str]) -> None:
    """Run the module's command-line entry with argv, as `python -m mod_name argv...` would."""
    import runpy

    mod = _module(mod_name)
    old = sys.argv
    sys.argv = [mod_name] + list(argv)
    try:
        if callable(getattr(mod, "main", None)):
            mod.main(list(argv))
        else:
            runpy.run_module(mod_name, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = old


TRACKED_TOPS = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} - {"runs", "wip"}


def _repo_paths(argv: list[str]) -> list[str]:
    """The arguments (or key=value values) that name a path inside the repository (not runs/ or /tmp)."""
    out = []
    for tok in argv:
        for val in ([tok] + ([tok.split("=", 1)[1]] if "=" in tok and not tok.startswith("-") else [])):
            for v in val.split(","):
                if "/" in v and v.split("/")[0] in TRACKED_TOPS:
                    out.append(v)
    return out


def _where(path: Path, lineno: int, line: str) -> str:
    return f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}"


def test_the_docs_hold_project_commands():
    mods = {m for _, _, m, _, _ in COMMANDS}
    assert {"infer.generate", "infer.evaluate", "train.main"} <= mods, mods


@pytest.mark.parametrize("path, lineno, mod, argv, line", COMMANDS,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, *_ in COMMANDS])
def test_docs_command_parses(parse_only, path, lineno, mod, argv, line):
    where = _where(path, lineno, line)
    assert mod is not None, f"{where}\n  not a valid shell line: {argv}"
    missing = [p for p in _repo_paths(argv) if not (ROOT / p).exists()]
    assert not missing, f"{where}\n  names paths that do not exist: {', '.join(missing)}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _run_entry(mod, argv)
    except Parsed:
        return
    except SystemExit as e:
        pytest.fail(f"{where}\n  does not parse (exit {e.code}): {err.getvalue().strip()}")
    pytest.fail(f"{where}\n  {mod} returned without parsing a command line")


def test_the_command_reader_handles_continuations_chains_and_comments():
    text = ("x\n```bash\nnice -n 19 python3 -m train.replies --out a \\\n    --verify 0   # comment\n"
            "mkdir -p x && python -m infer.generate --n 4 > out.txt\npython3 -m pip install -e .\n```\n"
            "```python\npython -m infer.generate\n```\n")
    got = []
    for n, line in fenced_shell_lines(text):
        got += [(n, pm) for c in simple_commands(line) if (pm := project_module(c))]
    assert got == [(3, ("train.replies", ["--out", "a", "--verify", "0"])), (5, ("infer.generate", ["--n", "4"]))]


# ---------------------------------------------------------------------------------------------------------------
# no commit hashes in the docs' text

# 7 to 12 hex digits with at least one digit and one letter, standing alone: git's short hashes. Longer runs
# (content digests, orbax file names) and words (no digit) or numbers (no letter) do not match; a digest
# labelled as one (sha256:..., digest ...) is allowed.
HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![0-9A-Za-z_])")
LABELLED = re.compile(r"(sha256|sha1|blake2b|digest|content_id|drafter_id)[\s:=`'\"]*$", re.I)
# Reports written by a program, not by hand: their labels are what the program was given (a replay's PSM
# directories), and regenerating them is the only way to change them.
GENERATED = {
    "docs/eval/smollm2-135m-instruct/long/n8-lineage.md": "infer.replay (its PSM labels are the --psm paths)",
}


def commit_hashes(text: str) -> list[tuple[int, str]]:
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in HASH.finditer(line):
            if not LABELLED.search(line[: m.start()]):
                found.append((i, m.group()))
    return found


def test_no_commit_hashes_in_docs():
    bad = []
    for path in doc_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in GENERATED:
            continue
        bad += [f"{rel}:{i}: {h}" for i, h in commit_hashes(path.read_text())]
    assert not bad, "commit hashes in the docs (name the config, recipe or card instead): " + ", ".join(bad)


def test_the_hash_pattern():
    assert commit_hashes("git show 0c7f719:spd_jax/x, /tmp/psm-f02294c and a125301.") == [
        (1, "0c7f719"), (1, "f02294c"), (1, "a125301")]
    assert commit_hashes("1234567 tokens, a facade, float32, sha256: 3f2a9c1d4e5b, d/7c8082b2cb95871206a51e8df1a79acc"
                         ) == []


def anchors(md: Path) -> set[str]:
    """The heading anchors GitHub makes for a markdown file: lower case, punctuation dropped, spaces to -."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", md.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_links_in_docs_resolve():
    """Every relative link in README.md and docs/ names a file that exists, and a heading of it that exists."""
    bad = []
    for path in doc_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                name, _, anchor = target.partition("#")
                file = (path.parent / name).resolve() if name else path
                if not file.exists():
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {target}")
                elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {target} (no such heading)")
    assert not bad, "links to files or headings that do not exist: " + ", ".join(bad)


def test_config_files_named_in_docs_exist():
    """Every configs/... file the README or docs name, in a command or in prose, exists: a recipe renamed or
    removed leaves no stale pointer."""
    bad = []
    for path in doc_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in GENERATED:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"\bconfigs/[\w./-]+\.ya?ml\b", line):
                if not (ROOT / name).is_file():
                    bad.append(f"{rel}:{i}: {name}")
    assert not bad, "config files that do not exist: " + ", ".join(bad)
