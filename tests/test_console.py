"""console.Progress: one progress line, drawn in place on a terminal, a few lines elsewhere."""
from __future__ import annotations

import io
import math

from kvstream_hicache.tools import console
from kvstream_hicache.tools.console import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_prints_a_line_per_tenth_and_the_end():
    out = io.StringIO()
    p = Progress(100, "bench", stream=out)
    for done in range(1, 101):
        p.show(done, f"{done}/100")
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == [f"bench {k}/100" for k in range(10, 101, 10)]


def test_lines_one_prints_only_the_end_and_force_prints_anyway():
    out = io.StringIO()
    p = Progress(5, stream=out, lines=1)
    for done in range(1, 6):
        p.show(done, f"{done} of 5")
    p.show(5, "final", force=True)
    assert out.getvalue().splitlines() == ["5 of 5", "final"]


def test_terminal_redraws_in_place_at_most_every_interval():
    out = Terminal()
    p = Progress(4, "run", stream=out, interval=3600.0)
    p.show(1, "one")  # first draw
    p.show(2, "two")  # within the interval: skipped
    p.show(4, "four")  # the last step is always drawn
    p.close()
    text = out.getvalue()
    assert text.startswith("\r[" + "#" * 7 + "." * 23 + "] run one\033[K")
    assert "two" not in text
    assert "\r[" + "#" * 30 + "] run four\033[K" in text and text.endswith("\n")


def test_disabled_writes_nothing_and_eta_follows_the_pace(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    out = Terminal()
    p = Progress(10, stream=out, enabled=False)
    p.show(3, "x", force=True)
    p.close()
    assert out.getvalue() == ""
    now[0] = 104.0  # 4 s into the run
    assert p.eta(10) == 0.0 and p.eta(5) == 4.0 and p.eta(2) == 16.0 and math.isnan(p.eta(0))


def test_info_says_a_file_given_as_a_tier_is_not_a_directory(tmp_path, capsys):
    """A file where a tier directory should be: kvstream info said 'missing', and the user looked for a
    typo in a path that exists (kvstream check and the engine say 'is not a directory')."""
    from kvstream_hicache.tools import cli

    afile, gone, tier = tmp_path / "afile", tmp_path / "gone", tmp_path / "tier"
    afile.write_text("")
    tier.mkdir()
    assert cli.main(["info", "--tiers", str(afile), str(gone), str(tier)]) == 1
    out = capsys.readouterr().out
    assert f"{afile}: PROBLEM: not a directory" in out
    assert f"{gone}: PROBLEM: missing" in out


def test_info_names_the_file_system_of_a_tier_whose_mount_point_has_a_space(tmp_path, capsys):
    """/proc/self/mounts writes a space in a mount point as \\040 (and '#' in a source, MooseFS's
    'mfs#host:port', as \\043): kvstream info compared the raw field with the tier's path, never matched
    the mount, and named the file system above it (a MooseFS tier at '/mnt/mfs a' shown as 'ext4 on
    /dev/vda', trial moosefs)."""
    import os
    import subprocess

    import pytest

    from kvstream_hicache.tools import cli

    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs (root)")
    mnt = tmp_path / "a tier"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "kv#src", str(mnt)], check=True)
    try:
        assert cli.main(["info", "--tiers", str(mnt)]) == 0
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert f"tier0 {mnt}: tmpfs on kv#src," in capsys.readouterr().out
