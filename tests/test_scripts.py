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


# The README's two commands build .venv (setup-env.sh) and .venv-lmcache (setup-lmcache-env.sh) with CPU torch:
# the constraint files pin torch==2.13.0+cpu, a build PyPI does not carry (PyTorch's CPU index does). Run as a
# fresh user whose pip knows PyPI alone, both stopped at their first torch install with pip's bare
# "Cannot install torch==2.13.0 ... ResolutionImpossible". The venv here is a stand-in whose pip finds
# torch 2.13.0+cpu only where PyTorch's CPU index is named, as PyPI alone answers.
FAKE_PIP = r"""#!/bin/sh
[ "$1" = "-m" ] && { [ "$2" = "pip" ] || exit 0; shift 2; }
echo "pip $*" >> "$CALLS"
case " $* " in
  *" torch==2.13.0"*)
    case " $* " in *"download.pytorch.org/whl/cpu"*) exit 0;; esac
    echo "ERROR: Cannot install torch==2.13.0 because these package versions have conflicting dependencies." >&2
    exit 1;;
esac
exit 0
"""
FAKE_PYTHON = r"""#!/bin/sh
[ "$1" = "-m" ] && [ "$2" = "pip" ] && exec "$(dirname "$0")/pip" "$@"
exit 0
"""


@pytest.mark.parametrize("script,venv_var", [("setup-env.sh", "KVSTREAM_VENV"),
                                             ("setup-lmcache-env.sh", "KVSTREAM_LMCACHE_VENV")])
def test_the_setup_finds_cpu_torch_where_pip_knows_pypi_alone(tmp_path, script, venv_var):
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    for path, body in ((venv / "bin" / "pip", FAKE_PIP), (venv / "bin" / "python", FAKE_PYTHON),
                       (bin_dir / "dpkg", "#!/bin/sh\nexit 0\n"), (bin_dir / "pkg-config", "#!/bin/sh\nexit 0\n")):
        path.write_text(body)
        path.chmod(0o755)
    calls = tmp_path / "calls"
    calls.touch()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), venv_var: str(venv), "HOME": str(tmp_path),
           "PYTHON": shutil.which("python3") or "python3"}
    proc = subprocess.run([shutil.which("bash"), os.path.join(ROOT, "scripts", script)], capture_output=True,
                          text=True, env=env, timeout=60, cwd=ROOT)
    torch = [c for c in calls.read_text().splitlines() if "torch==2.13.0" in c]
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:], torch)
    assert "download.pytorch.org/whl/cpu" in torch[-1], torch
    assert "PyTorch's CPU index" in proc.stdout, proc.stdout  # (said, so a user behind a mirror knows what it took)
