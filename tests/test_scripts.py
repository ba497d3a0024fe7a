"""scripts/system-deps.sh, which the README's two commands run first: as root without sudo (containers),
as a user with sudo, and as a user with neither. The system tools it calls are stand-ins on PATH that
record what they were asked to do; nothing is installed."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "system-deps.sh")
TOOL = """#!/bin/sh
echo "{name} $*" >> "$CALLS"
{body}
"""
TOOLS = {
    "id": 'echo "$FAKE_UID"',
    "dpkg": 'case " $MISSING " in *" $2 "*) exit 1;; esac',  # dpkg -s PKG: installed unless listed
    "apt-get": "exit 0",
    "pkg-config": '[ -z "$NO_LIBURING" ]',
    "sudo": 'exec "$@"',
}


def run(tmp_path, uid: int, sudo: bool, missing: str = "", no_liburing: bool = False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in TOOLS.items():
        if name == "sudo" and not sudo:
            continue
        path = bin_dir / name
        path.write_text(TOOL.format(name=name, body=body))
        path.chmod(0o755)
    for name in ("env", "sh"):  # what the script and the stand-ins need besides them
        os.symlink(shutil.which(name), bin_dir / name)
    calls = tmp_path / "calls"
    calls.touch()
    env = {"PATH": str(bin_dir), "CALLS": str(calls), "FAKE_UID": str(uid), "MISSING": missing,
           "NO_LIBURING": "1" if no_liburing else ""}
    proc = subprocess.run([shutil.which("bash"), SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    return proc, calls.read_text().splitlines()


def installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith(("sudo", "apt-get"))]


def test_root_without_sudo_installs_directly(tmp_path):
    proc, calls = run(tmp_path, 0, sudo=False, missing="fio gcc")
    assert proc.returncode == 0, proc.stderr
    assert installs(calls) == ["apt-get update -qq", "apt-get install -y -qq gcc fio"]


def test_user_with_sudo_installs_through_sudo(tmp_path):
    proc, calls = run(tmp_path, 1000, sudo=True, missing="liburing-dev")
    assert proc.returncode == 0, proc.stderr
    assert installs(calls) == ["sudo apt-get update -qq", "apt-get update -qq",
                               "sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev",
                               "apt-get install -y -qq liburing-dev"]


def test_nothing_missing_installs_nothing(tmp_path):
    proc, calls = run(tmp_path, 1000, sudo=False)
    assert proc.returncode == 0 and installs(calls) == [] and proc.stderr == ""


@pytest.mark.parametrize("no_liburing", [False, True])
def test_user_without_sudo_is_told_what_to_install(tmp_path, no_liburing):
    proc, calls = run(tmp_path, 1000, sudo=False, missing="fio liburing-dev", no_liburing=no_liburing)
    assert installs(calls) == []
    assert "liburing-dev" in proc.stderr and "root" in proc.stderr and "sudo" in proc.stderr
    assert proc.returncode == (1 if no_liburing else 0)  # without liburing's headers nothing can build
