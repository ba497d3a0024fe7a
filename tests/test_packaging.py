"""What the two wheels of this repository carry. A worker's ``pip install kvstream-hicache`` is the engine
and its adapters only: no ``kvstream_hicache.tools`` module, no ``kvstream``/``kvsim`` command (those are
kvstream-hicache-tools, built from kvstream-hicache-tools/); and its extension links liburing statically
where the system has liburing.a, so the wheel runs where liburing is not installed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = "kvstream_hicache/tools/"


def _wheel(source: str, out: str) -> str:
    """Build the wheel of ``source`` with this interpreter's pip (no isolation: setuptools and Cython of
    this venv, nothing fetched); the path of the wheel."""
    before = set(os.listdir(out))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                           source, "-w", out], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (name,) = set(os.listdir(out)) - before
    return os.path.join(out, name)


# What a build reads: a copy of these is built, so no build output (egg-info, build/) lands in the
# checkout, where importlib.metadata would find it before the installed distribution.
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "_uring", "kvstream_hicache",
           "kvstream-hicache-tools")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("src"), str(tmp_path_factory.mktemp("wheels"))
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.c", "build", "*.egg-info")
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=skip)
        else:
            shutil.copy2(path, src / name)
    return _wheel(str(src), out), _wheel(str(src / "kvstream-hicache-tools"), out)


def _entry_points(names: list[str], zf: zipfile.ZipFile) -> str:
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    return zf.read(ep).decode()


def test_the_engine_wheel_carries_no_tools(wheels):
    with zipfile.ZipFile(wheels[0]) as zf:
        names = zf.namelist()
        entry_points = _entry_points(names, zf)
    assert [n for n in names if n.startswith(TOOLS)] == []
    assert "kvstream_hicache/engine.py" in names and "kvstream_hicache/sglang/storage.py" in names
    assert "console_scripts" not in entry_points  # kvstream and kvsim are the tools' commands
    assert "kvstream = kvstream_hicache.sglang.plugin:register" in entry_points  # the sglang plugin stays


def test_the_tools_wheel_carries_the_tools_and_their_commands_only(wheels):
    with zipfile.ZipFile(wheels[1]) as zf:
        names = zf.namelist()
        entry_points = _entry_points(names, zf)
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    modules = [n for n in names if ".dist-info/" not in n]
    assert modules and all(n.startswith(TOOLS) for n in modules), modules
    assert {TOOLS + "cli.py", TOOLS + "bench/runner.py", TOOLS + "sim/cli.py", TOOLS + "demo.py"} <= set(modules)
    assert "kvstream = kvstream_hicache.tools.cli:main" in entry_points
    assert "kvsim = kvstream_hicache.tools.sim.cli:main" in entry_points
    assert "Requires-Dist: kvstream-hicache==0.1.0" in metadata


def _liburing_a() -> str | None:
    libdir = subprocess.run(["pkg-config", "--variable=libdir", "liburing"], capture_output=True, text=True,
                            check=True).stdout.strip()
    path = os.path.join(libdir, "liburing.a")
    return path if os.path.exists(path) else None


def test_the_extension_links_liburing_statically_where_the_system_has_it(wheels, tmp_path):
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extractall(tmp_path)
    (so,) = [os.path.join(tmp_path, "kvstream_hicache", n) for n in os.listdir(tmp_path / "kvstream_hicache")
             if n.startswith("_uring") and n.endswith(".so")]
    needed = subprocess.run(["ldd", so], capture_output=True, text=True, check=True).stdout
    if _liburing_a():
        assert "liburing" not in needed, needed
    else:  # no static library here: the shared one is linked, and must be installed where the wheel runs
        assert "liburing.so" in needed, needed
    # The wheel's extension loads and runs a ring on its own (not the checkout's build).
    code = ("import kvstream_hicache._uring as u, sys; assert u.__file__.startswith(sys.argv[1]), u.__file__; "
            "r = u.Ring(4); r.close(); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.stdout.strip() == "ok", proc.stderr
