"""The demo (the README's first command) runs end to end on plain directories with a small workload."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstream_hicache.tools import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_page_content_is_a_function_of_the_key():
    a = demo.page_content("ab" * 32, 3 * demo.TILE + 10)
    assert len(a) == 3 * demo.TILE + 10
    assert (a == demo.page_content("ab" * 32, 3 * demo.TILE + 10)).all()
    assert (a[: demo.TILE] != demo.page_content("cd" * 32, demo.TILE)).any()


def test_temporary_tiers_say_what_they_are_and_clean_up():
    args = demo.parse_args(["--no-testbed"])
    tiers = demo.prepare_tiers(args)
    try:
        assert tiers.kind == "temporary" and len(tiers.roots) == 2
        assert "NOT throttled" in tiers.note
        dirs = tiers.run_dirs("kvstream")
        assert len(dirs) == 2 and all(os.path.isdir(d) for d in dirs)
        assert len(tiers.run_dirs("file")) == 1
    finally:
        tiers.close()
    assert not any(os.path.exists(r) for r in tiers.roots)


def test_a_tier_that_does_not_exist_is_refused_not_created(tier_root):
    """--tiers with a mistyped or unmounted directory: refused, naming it (before: created, and the demo,
    serve-cpu, serve_swebench.py and kvstream bench ran on the file system below it)."""
    missing = os.path.join(tier_root, "nvme-typo")
    with pytest.raises(SystemExit, match="--tiers: tier .*nvme-typo does not exist"):
        demo.prepare_tiers(demo.parse_args(["--tiers", os.pathsep.join([missing, tier_root])]))
    assert not os.path.exists(missing)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the real sglang (see docs/sglang.md)")
def test_demo_small_on_plain_directories(tier_root, tmp_path):
    tiers = [os.path.join(tier_root, "fast"), os.path.join(tier_root, "slow")]
    for d in tiers:
        os.mkdir(d)
    png, out = tmp_path / "demo.png", tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvstream_hicache.tools.demo", "--small", "--tiers", os.pathsep.join(tiers),
         "--plot", str(png), "--json", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "real sglang HiCache controller" in text and "reads by tier" in text
    report = json.loads(out.read_text())
    kv, fb = report["runs"]["kvstream"], report["runs"]["file"]
    assert kv["zero_copy"] is True and fb["zero_copy"] is False
    assert kv["pages_checked"] > 0 and kv["pages_bad"] == 0 and fb["pages_bad"] == 0
    assert kv["read_bytes"] == fb["read_bytes"] > 0  # both backends served the same prefixes
    assert sum(kv["tier_read_share"]) == pytest.approx(1.0)
    assert report["tiers"]["kind"] == "given"
    # the plot's bound is each batch's D / sum(b_k) at the rates it got: no curve can run below it
    bound, took = np.cumsum(kv["per_request_bound_s"]), np.cumsum(kv["per_request_retrieval_s"])
    assert bound[-1] > 0 and len(bound) == len(took) and (took >= bound).all()
    assert png.stat().st_size > 1000
    for t in tiers:  # the demo removed its own run directories, and only those
        assert os.path.isdir(t) and os.listdir(t) == []


# The child: `kvstream serve-cpu --no-testbed` with a stand-in server (a sleeping process that records its pid,
# its KVSTREAM_TIERS and a file in its TMPDIR, as sglang's IPC sockets are), model and health wait.
_SERVE_CPU_CHILD = """
import sys
from kvstream_hicache.tools import cli, serve_cpu
server = ("import os, time; open(os.path.join(os.environ['TMPDIR'], 'ipc'), 'w').close(); "
          "print('KVSTREAM_TIERS', os.getpid(), os.environ['KVSTREAM_TIERS'], flush=True); time.sleep(600)")
serve_cpu.ensure_packages = lambda: None
serve_cpu.build_model = lambda: "tiny-model"
serve_cpu.launch_command = lambda model, **kw: [sys.executable, "-c", server]
serve_cpu.ServerProcess.wait = lambda self, timeout=0: self
sys.exit(cli.main(["serve-cpu", "--no-testbed", "--port", "1", "--log", sys.argv[1]]))
"""


def _start_serve_cpu(tmp_path, source: str):
    """The child ``source`` (a form of _SERVE_CPU_CHILD) with a demo directory and a TMPDIR of its own:
    (the process, its demo directory, its TMPDIR, the stand-in server's log)."""
    demo_dir, tmp, log = tmp_path / "demo", tmp_path / "tmp", tmp_path / "server.log"
    demo_dir.mkdir()
    tmp.mkdir()
    env = dict(os.environ, KVSTREAM_DEMO_DIR=str(demo_dir), TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, "-c", source, str(log)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    return child, demo_dir, tmp, log


def _end_serve_cpu(child: subprocess.Popen, server: int | None) -> None:
    """Whatever a failed test left: the child, and the stand-in server (it leads its own group: ServerProcess)."""
    if child.poll() is None:
        child.kill()
        child.communicate()
    if server is not None:
        try:
            os.killpg(server, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_serve_cpu_stopped_by_a_signal_removes_its_server_and_tiers(tmp_path, sig):
    """`kill`, `timeout` or a closed terminal stop `kvstream serve-cpu` as Ctrl-C does (before, it died at
    once: its server, in a session of its own, went on serving, and a testbed's mounts stayed); it prints
    the directories the server stores pages in (KVSTREAM_TIERS: what kvstream info/check take), and the
    server's temporary files go with it."""
    child, demo_dir, tmp, log = _start_serve_cpu(tmp_path, _SERVE_CPU_CHILD)
    server = None
    try:
        out = []
        for line in child.stdout:  # (ends when the child does: never waits forever)
            out.append(line)
            if "serving at" in line:
                break
        assert "serving at" in out[-1], "".join(out)
        deadline = time.monotonic() + 60
        while "KVSTREAM_TIERS" not in (log.read_text() if log.exists() else ""):  # (the stand-in's line)
            assert time.monotonic() < deadline and child.poll() is None, "".join(out)
            time.sleep(0.05)
        pid, tiers = log.read_text().splitlines()[-1].split()[1:]
        server = int(pid)
        child.send_signal(getattr(signal, sig))
        child.communicate(timeout=120)
        assert child.returncode == 0
        with pytest.raises(ProcessLookupError):
            os.kill(server, 0)
        assert os.listdir(demo_dir) == [] and os.listdir(tmp) == []
        assert f"[serve-cpu] KVSTREAM_TIERS={tiers}\n" in out
    finally:
        _end_serve_cpu(child, server)


def test_serve_cpu_stopped_by_a_second_signal_still_stops_its_server_and_removes_its_tiers(tmp_path):
    """A closed terminal sends SIGHUP twice (the kernel's hang-up to the foreground job, then the shell's to its
    jobs), an impatient user `kill`s twice. The second came while the first's stop waited for the server (its
    grace before SIGKILL) and raised KeyboardInterrupt there: no SIGKILL, and a server slow to stop (here: one
    that ignores SIGTERM; sglang's schedulers outlive its launcher) stayed, its tiers unmounted under it. Found by
    a review."""
    slow = _SERVE_CPU_CHILD.replace(
        "server = (\"import os, time; ",
        "serve_cpu.STOP_GRACE_S = 10.0\nserver = (\"import os, signal, time; "
        "signal.signal(signal.SIGTERM, lambda *a: print('TERM', flush=True)); ")
    assert slow != _SERVE_CPU_CHILD
    child, demo_dir, tmp, log = _start_serve_cpu(tmp_path, slow)
    server = None

    def wait_log(text: str) -> str:
        deadline = time.monotonic() + 60
        while text not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "(no log)"
            time.sleep(0.05)
        return log.read_text()

    try:
        for line in child.stdout:
            if "serving at" in line:
                break
        server = int(wait_log("KVSTREAM_TIERS").splitlines()[-1].split()[1])
        child.send_signal(signal.SIGHUP)
        wait_log("TERM")  # the server is being stopped
        child.send_signal(signal.SIGHUP)
        child.communicate(timeout=120)
        with pytest.raises(ProcessLookupError):
            os.kill(server, 0)
        assert os.listdir(demo_dir) == [] and os.listdir(tmp) == []
    finally:
        _end_serve_cpu(child, server)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's link needs root (CI runs as root)")
def test_serve_cpu_s_default_log_follows_no_link_another_user_planted(tmp_path):
    """`kvstream serve-cpu` without --log, its TMPDIR a shared sticky directory (/tmp): another user who plants a
    link at the log's name (before: kvstream-serve-cpu-<pid>.log, a pid anyone can guess) to a file only the
    victim may write has the server's log appended to that file (open "ab" followed the link; a FIFO there hung
    the start, a file of theirs received the log). Found by an attacker's trial."""
    planted = """
import os, tempfile
target = os.path.join(os.path.dirname(tempfile.gettempdir()), 'victim.conf')
with open(target, 'w') as fh:
    fh.write('secret\\n')
link = os.path.join(tempfile.gettempdir(), f'kvstream-serve-cpu-{os.getpid()}.log')
os.symlink(target, link)  # (another user's: the name is the one the old code took)
os.lchown(link, 65534, 65534)
"""
    source = _SERVE_CPU_CHILD.replace(', "--log", sys.argv[1]]', "]").replace("import sys\n", "import sys\n" + planted)
    assert source != _SERVE_CPU_CHILD
    child, demo_dir, tmp, _ = _start_serve_cpu(tmp_path, source)
    tmp.chmod(0o1777)
    server = None
    try:
        out = []
        for line in child.stdout:
            out.append(line)
            if "serving at" in line:
                break
        text = "".join(out)
        logs = [line.split("log: ", 1)[1].strip() for line in out if line.startswith("[serve-cpu] log: ")]
        assert "serving at" in text and len(logs) == 1, text
        deadline = time.monotonic() + 60
        while True:
            with open(logs[0]) as fh:
                written = fh.read()
            if "KVSTREAM_TIERS" in written:  # (the stand-in server's line)
                break
            assert time.monotonic() < deadline and child.poll() is None, text
            time.sleep(0.05)
        server = int(written.split("KVSTREAM_TIERS", 1)[1].split()[0])
        child.send_signal(signal.SIGTERM)
        child.communicate(timeout=120)
        assert (tmp_path / "victim.conf").read_text() == "secret\n"
        assert os.path.dirname(logs[0]) == str(tmp) and not os.path.islink(logs[0])
        assert os.stat(logs[0]).st_mode & 0o077 == 0  # (the server's log is the user's alone, as mkstemp makes it)
    finally:
        _end_serve_cpu(child, server)


def test_kvstream_info_finds_the_scan_of_a_serve_cpu_server(tmp_path, monkeypatch):
    """docs/sglang.md: `kvstream info` shows the start-up scan's progress, and serve-cpu's tiers are for
    `kvstream info --tiers`. serve-cpu gave its server the run's scratch as TMPDIR (sglang's IPC sockets), and
    kvstream's progress directory follows TMPDIR where XDG_RUNTIME_DIR is unset (`su -`, a container): the
    server's scan went into the scratch and `kvstream info` in the user's shell listed no scan."""
    from kvstream_hicache.tools import serve_cpu

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    env = serve_cpu.run_env([str(tmp_path / "t0"), str(tmp_path / "t1")], str(tmp_path / "scratch"))
    assert env["TMPDIR"] == str(tmp_path / "scratch")  # (kept: sglang's sockets go there)
    code = "from kvstream_hicache.scan import progress_dir; print(progress_dir())"
    server = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    shell = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert server.stdout == shell.stdout, (server.stdout, shell.stdout)
