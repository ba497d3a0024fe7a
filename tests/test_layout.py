"""The package layout: core, adapters (sglang/, lmcache/), tools/; the import paths users type keep working."""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

import pytest


def _entry_point(group: str, name: str) -> importlib.metadata.EntryPoint:
    (ep,) = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
    return ep


# -- old import paths: thin re-exports of the very same objects ---------------------------------------
def test_old_sglang_backend_path_is_the_same_class():
    if importlib.util.find_spec("sglang") is None:  # the backend imports the real sglang and torch (.venv)
        pytest.skip("sglang is not installed: scripts/setup-env.sh installs it")
    from kvstream_hicache.tools import cpu_sglang

    cpu_sglang.install_stubs()
    from kvstream_hicache.hicache import KVStreamHiCacheStorage as old
    from kvstream_hicache.sglang.storage import KVStreamHiCacheStorage

    assert old is KVStreamHiCacheStorage


def test_old_lmcache_adapter_path_names_the_same_attribute_without_lmcache():
    """The class itself needs LMCache (tests/test_lmcache_adapter.py loads it through LMCache from the old
    path); the old module imports without it, and forwards exactly the adapter and its config class."""
    from kvstream_hicache import lmcache_adapter

    assert lmcache_adapter.__all__ == ["KVStreamL2Adapter", "KVStreamL2AdapterConfig"]
    with pytest.raises(AttributeError):
        lmcache_adapter.L2Core  # noqa: B018  (only the documented name is re-exported)


def test_old_plugin_path_is_the_same_function():
    from kvstream_hicache import plugin
    from kvstream_hicache.sglang import plugin as new

    assert plugin.register is new.register


def test_sglang_entry_point_loads_register():
    from kvstream_hicache.sglang.plugin import register

    assert _entry_point("sglang.srt.plugins", "kvstream").load() is register


@pytest.mark.parametrize("command,module", [("kvstream", "kvstream_hicache.tools.cli"),
                                            ("kvsim", "kvstream_hicache.tools.sim.cli")])
def test_commands_run(command, module):
    assert _entry_point("console_scripts", command).load() is importlib.import_module(module).main
    script = os.path.join(os.path.dirname(sys.executable), command)  # installed beside this interpreter
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {command}"), proc.stderr


# -- no import cycle; tools/ on top -------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "kvstream_hicache"
# Imported once and kept: a Cython module cannot be initialised twice in one process, and it imports
# nothing of the package.
EXTENSION = "kvstream_hicache._uring"


def package_modules(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """``{dotted module name: source path}`` of every module of ``package`` under ``root``."""
    out = {}
    base = os.path.join(root, package)
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
                name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                out[name] = os.path.join(d, f)
    return out


def imports_of(name: str, path: str, modules) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its source (module level, functions,
    ``TYPE_CHECKING`` blocks): ``from .x import y`` counts as ``x``, and ``x.y`` when that is a module."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    here = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # kvstream_hicache.layout.ALIGN -> kvstream_hicache.layout
                t = t.rpartition(".")[0]
            # a module's own packages are always imported before it: an edge to them is no cycle
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def import_cycles(root: str = ROOT, package: str = PACKAGE) -> list[list[str]]:
    """Strongly connected groups of modules that import each other, function-level imports included."""
    modules = package_modules(root, package)
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


IMPORT_EACH = """
import importlib, json, sys, traceback
names, keep, prelude = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
if prelude:
    exec(prelude)
failed = {}
for name in names:
    for loaded in [m for m in sys.modules if m.split(".")[0] == names[0].split(".")[0] and m != keep]:
        del sys.modules[loaded]  # a fresh start for the package: nothing of it imported yet
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print("FAILED " + json.dumps(failed))
"""


def import_each_alone(names, root: str = ROOT, keep: str = EXTENSION, prelude: str = "") -> dict[str, str]:
    """Import every module of ``names`` alone, each into a ``sys.modules`` holding nothing of its package
    (one interpreter: third-party modules stay loaded); ``{module: traceback}`` of those that fail."""
    import json

    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH, json.dumps(list(names)), keep, prelude],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("FAILED "):])


CYCLIC = {  # a -> b at module level; c -> d -> c only inside a function
    "__init__.py": "",
    "a.py": "from .b import B\nA = 1\n",
    "b.py": "from .a import A\nB = 2\n",
    "c.py": "def f():\n    from .d import D\n    return D\nC = 3\n",
    "d.py": "from .c import C\nD = 4\n",
}


def test_the_checks_find_cycles(tmp_path):
    """Both checks below on a package with one cycle of each kind: neither passes it."""
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    for name, text in CYCLIC.items():
        (pkg / name).write_text(text)
    assert import_cycles(str(tmp_path), "cyclic") == [["cyclic.a", "cyclic.b"], ["cyclic.c", "cyclic.d"]]
    failed = import_each_alone(sorted(package_modules(str(tmp_path), "cyclic")), str(tmp_path), keep="")
    assert set(failed) == {"cyclic.a", "cyclic.b"}  # the hidden one imports fine: only the static check sees it
    assert "partially initialized module" in failed["cyclic.a"]


def test_no_import_cycle_in_the_package():
    assert import_cycles() == []


def test_every_module_imports_alone():
    modules = sorted(package_modules())
    # sglang's import chain needs the CPU stubs first (tools/cpu_sglang.py); they are not package modules
    prelude = "from kvstream_hicache.tools import cpu_sglang; cpu_sglang.install_stubs()"
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed: scripts/setup-env.sh installs it (the SGLang backend imports it)")
    assert len(modules) > 50
    assert import_each_alone(modules, prelude=prelude) == {}


def test_nothing_outside_tools_imports_tools():
    modules = package_modules()
    tools = f"{PACKAGE}.tools"
    offenders = {name: sorted(t for t in imports_of(name, path, modules) if t == tools or t.startswith(tools + "."))
                 for name, path in modules.items() if not (name == tools or name.startswith(tools + "."))}
    assert {k: v for k, v in offenders.items() if v} == {}


# -- the docs describe this layout --------------------------------------------------------------------
OLD_PATHS = {"hicache", "lmcache_adapter", "plugin"}  # re-exports of moved modules (tested above)


def test_the_core_imports_no_adapter():
    modules = package_modules()
    adapters = (f"{PACKAGE}.sglang", f"{PACKAGE}.lmcache")
    core = {f"{PACKAGE}.{name}" for name in _core_modules()}
    offenders = {name: sorted(t for t in imports_of(name, modules[name], modules)
                              if any(t == a or t.startswith(a + ".") for a in adapters)) for name in core}
    assert len(core) > 15 and {k: v for k, v in offenders.items() if v} == {}


def _core_modules() -> list[str]:
    return sorted(name.rsplit(".", 1)[1] for name, path in package_modules().items()
                  if name.count(".") == 1 and not path.endswith("__init__.py")
                  and name.rsplit(".", 1)[1] not in OLD_PATHS)


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_readme_and_design_name_every_core_module():
    readme = _read("README.md")
    layout = readme[readme.index("## Layout"):]
    design = _read("docs", "design.md")
    module_map = design[design.index("### Module map"):design.index("## API")]
    for name in _core_modules():
        assert f" {name}" in layout, f"README's layout block lacks {name}"
        assert f"{name}.py" in module_map, f"docs/design.md's module map lacks {name}.py"
    for package in ("sglang/", "lmcache/", "tools/"):
        assert package in layout and package in module_map


@pytest.mark.parametrize("module", ["reads.py", "writes.py"])
def test_each_path_holds_one_policy_in_a_small_room(module):
    """The read and write paths are where most later work lands: each keeps its path's policy and hands
    whole concepts to rooms of their own (inflight, files, getcall, delivery, damage; writequeue, jobs,
    puts, admission). A path past this size has grown a second concept: give it its own module."""
    lines = _read("kvstream_hicache", module).count("\n")
    assert lines < 480, f"kvstream_hicache/{module}: {lines} lines"


def test_docs_give_the_enospc_retry_count():
    from kvstream_hicache.tiers import SPACE_RETRIES

    for doc in (("docs", "design.md"), ("docs", "guarantees.md")):
        assert f"up to {SPACE_RETRIES} times" in _read(*doc), doc


def test_no_test_module_imports_another():
    """Tests share code through helpers.py, sglang_fixtures.py, lmcache_fixtures.py and conftest.py's
    fixtures, never by importing a test module (which would collect its tests twice)."""
    tests = os.path.join(ROOT, "tests")
    offenders = []
    for name in sorted(os.listdir(tests)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(tests, name)) as f:
            tree = ast.parse(f.read(), name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{name}: {m}" for m in mods if m.split(".")[0].startswith("test_") or m == "conftest"]
    assert offenders == []


def test_every_test_the_docs_cite_exists():
    """The docs cite the tests that show each guarantee (``test_x.py::test_y``, a bare ``::test_y`` after
    one): a test renamed or folded into another left its old name there, a claim with no test behind it."""
    ours = {}
    for name in os.listdir(os.path.join(ROOT, "tests")):
        if name.startswith("test_") and name.endswith(".py"):
            ours[name] = set(re.findall(r"^\s*def (test_\w+)", _read("tests", name), re.M))
    every = set().union(*ours.values())
    stale = []
    for doc in [("README.md",)] + [("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                   if n.endswith(".md")]:
        text = _read(*doc)
        # (``Class::test_y``: a test of LMCache's own suites, which docs/lmcache.md cites: not ours)
        for m in re.finditer(r"(?:\b(test_\w+\.py)|(?<![\w.]))::(test_\w+)", text):
            module, test = m.groups()
            if module in ours and test not in ours[module] or module is None and test not in every:
                stale.append(f"{'/'.join(doc)}: {m.group(0)}")
    assert stale == []
