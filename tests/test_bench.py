"""Unit tests of the benchmark's pure parts: the gap arithmetic, the testbed's commands, fio job files,
page geometry, the data set check, the span instrument and the drift scenarios (with fakes)."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from kvstream_hicache.tools.bench import drift, fio, gap, geometry, testbed
from kvstream_hicache.tools.bench.dataset import Dataset, check, page_segments, page_views, poison
from kvstream_hicache.tools.bench.instrument import SpanRecorder, TimedRing
from kvstream_hicache.io import OP_READ, OP_WRITE

MB = 1_000_000


def rec(policy, t0, t_ret, nbytes, tier_bytes, tier_busy, served=()):
    return gap.BatchRecord(policy=policy, round=0, t0=t0, t_ret=t_ret, nbytes=nbytes, pages=1, found=1,
                           tier_bytes=tier_bytes, tier_busy=tier_busy, tier_served=served)


# ---------------------------------------------------------------------------------------------- gap
def test_bound_uses_the_batch_own_tier_rates():
    r = rec("kvstream", 0.0, 1.0, 800 * MB, (600 * MB, 200 * MB), (1.0, 1.0))
    gap.assign_bounds([r], 2, min_bytes=1)
    assert r.tier_bps == pytest.approx((600 * MB, 200 * MB))
    assert r.tier_bps_source == ("batch", "batch")
    assert r.bound_s == pytest.approx(1.0)
    assert gap.gap([r]) == pytest.approx(0.0)


def test_static_split_mismatch_pays_eq6():
    # b0 = 600, b1 = 200 MB/s, D = 800 MB, g = 0.5: tier 1 needs 400/200 = 2 s, the bound is 1 s.
    r = rec("static-0.5", 0.0, 2.0, 800 * MB, (400 * MB, 400 * MB), (400 / 600, 2.0))
    gap.assign_bounds([r], 2, min_bytes=1)
    assert r.bound_s == pytest.approx(1.0)
    assert gap.gap([r]) == pytest.approx(1.0)


def test_idle_tier_rate_is_interpolated_from_neighbours():
    a = rec("kvstream", 0.0, 1.0, 1, (100, 100), (1.0, 1.0))  # t_mid 0.5: b1 = 100
    b = rec("tier0", 1.0, 1.0, 1, (100, 0), (1.0, None))  # t_mid 1.5: tier 1 idle
    c = rec("kvstream", 2.0, 1.0, 1, (100, 300), (1.0, 1.0))  # t_mid 2.5: b1 = 300
    gap.assign_bounds([a, b, c], 2, min_bytes=1)
    assert b.tier_bps_source == ("batch", "interpolated")
    assert b.tier_bps[1] == pytest.approx(200.0)


def test_small_tier_share_is_not_trusted_as_a_rate():
    a = rec("kvstream", 0.0, 1.0, 1, (100, 50), (1.0, 1.0))
    b = rec("kvstream", 1.0, 1.0, 1, (100, 2), (1.0, 0.001))  # 2 bytes in 1 ms: a tail steal, not a rate
    gap.assign_bounds([a, b], 2, min_bytes=10)
    assert b.tier_bps_source[1] == "interpolated"
    assert b.tier_bps[1] == pytest.approx(50.0)


def test_no_measurement_at_all_leaves_the_tier_out():
    r = rec("tier0", 0.0, 1.0, 100, (100, 0), (1.0, None))
    gap.assign_bounds([r], 2, min_bytes=1)
    assert r.tier_bps_source == ("batch", "none")
    assert r.bound_s == pytest.approx(1.0)


def test_gap_sums_times_before_dividing():
    r1 = rec("p", 0, 1.0, 100, (100,), (1.0,))
    r2 = rec("p", 1, 3.0, 100, (100,), (1.0,))  # rate 100/s -> bound 1 s, took 3 s
    for r in (r1, r2):
        r.bound_s = 1.0
    assert gap.gap([r1, r2]) == pytest.approx(4.0 / 2.0 - 1.0)


def test_percentile_matches_numpy():
    xs = [0.3, 1.2, 0.7, 5.0, 2.2, 0.9]
    for q in (0, 50, 90, 100):
        assert gap.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summary_share_prefers_served_bytes():
    r = rec("kvstream", 0, 1.0, 100, (80, 30), (1.0, 1.0), served=(75, 25))
    gap.assign_bounds([r], 2, min_bytes=1)
    s = gap.summarize([r], 2)
    assert s["share"] == pytest.approx([0.75, 0.25])
    assert s["read_amplification"] == pytest.approx(0.10)
    assert s["throughput_gbps"] == pytest.approx(100 / 1e9)


# ------------------------------------------------------------------------------------------ testbed
def test_profiles_hold_the_issue_figures():
    p2 = testbed.PROFILES["testbed2-1:20"]
    assert [(t.read_bps, t.write_bps) for t in p2.tiers] == [(580 * MB, 255 * MB), (180 * MB, 140 * MB)]
    p1 = testbed.PROFILES["testbed1-1:20"]
    assert [(t.read_bps, t.write_bps) for t in p1.tiers] == [(685 * MB, 230 * MB), (310 * MB, 355 * MB)]
    assert p2.slowest_write_tier == 1 and p1.slowest_write_tier == 0
    assert p2.bound_read_bps / p2.tiers[0].read_bps == pytest.approx(1.31, abs=0.005)


def test_explicit_profile_and_sizes():
    p = testbed.parse_profile("400/200,150/100")
    assert [(t.read_bps, t.write_bps) for t in p.tiers] == [(400 * MB, 200 * MB), (150 * MB, 100 * MB)]
    with pytest.raises(testbed.TestbedError, match="testbed2-1:20"):
        testbed.parse_profile("fast")
    assert testbed.parse_size("16G") == 16 << 30
    assert testbed.parse_size("512M") == 512 << 20
    with pytest.raises(testbed.TestbedError):
        testbed.parse_size("lots")


def test_commands():
    assert testbed.losetup_attach_cmd("/img") == ["losetup", "--direct-io=on", "--find", "--show", "/img"]
    mkfs = testbed.mkfs_cmd("/dev/loop3", "t0")
    assert mkfs[0] == "mkfs.ext4" and mkfs[-1] == "/dev/loop3"
    assert "lazy_itable_init=0,lazy_journal_init=0" in mkfs
    assert testbed.mount_cmd("/dev/loop3", "/mnt/x") == ["mount", "-o", "noatime", "/dev/loop3", "/mnt/x"]
    assert testbed.umount_cmd("/mnt/x") == ["umount", "/mnt/x"]
    assert testbed.losetup_detach_cmd("/dev/loop3") == ["losetup", "--detach", "/dev/loop3"]


def test_throttle_rules_per_device():
    rules = testbed.throttle_writes("/cg", ["7:0", "7:1"], testbed.PROFILES["testbed2-1:20"])
    assert rules == [
        ("/cg/blkio.throttle.read_bps_device", "7:0 580000000"),
        ("/cg/blkio.throttle.write_bps_device", "7:0 255000000"),
        ("/cg/blkio.throttle.read_bps_device", "7:1 180000000"),
        ("/cg/blkio.throttle.write_bps_device", "7:1 140000000"),
    ]
    with pytest.raises(testbed.TestbedError, match="2 tiers"):
        testbed.throttle_writes("/cg", ["7:0"], testbed.PROFILES["testbed2-1:20"])


def test_names_of_the_default_and_a_named_testbed():
    n = testbed.names("kvstream", 2, "/var/lib/x")
    assert n["mounts"] == ["/mnt/kvstream/tier0", "/mnt/kvstream/tier1"]
    assert n["cgroup"] == "/sys/fs/cgroup/blkio/kvstream"
    assert n["images"][1] == "/var/lib/x/kvstream-tier1.img"
    assert testbed.names("ci", 2)["mounts"][0] == "/mnt/kvstream-ci/tier0"


def test_preflight_says_what_is_missing_and_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(testbed, "BLKIO_ROOT", str(tmp_path / "no-blkio"))
    problems = testbed.preflight(str(tmp_path), need_fio=False)
    text = "\n".join(problems)
    assert "not root" in text and "sudo" in text
    assert "cgroup v1 blkio" in text and "Fix:" in text
    with pytest.raises(testbed.TestbedError, match="cannot build the testbed here"):
        testbed.up(testbed.PROFILES["testbed2-1:20"], image_dir=str(tmp_path), fio_bs=None, log=lambda m: None)


def test_preflight_as_a_user_finds_the_tools_in_sbin_and_names_the_command_sudo_runs(monkeypatch, tmp_path):
    """A user's PATH (Debian) has no /usr/sbin: `kvstream testbed up` said "losetup not found. Fix: apt-get
    install util-linux" beside "not root", with util-linux installed (the fix that mattered, sudo, finds it);
    and its "Fix: sudo kvstream testbed up" names a command sudo does not find where kvstream is a venv's
    (the README's `.venv/bin/kvstream`: sudo's secure_path has no venv)."""
    if not any(os.path.exists(os.path.join(d, "losetup")) for d in ("/usr/sbin", "/sbin")):
        pytest.skip("no losetup in /usr/sbin or /sbin here")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    venv_kvstream = tmp_path / ".venv" / "bin" / "kvstream"
    venv_kvstream.parent.mkdir(parents=True)
    venv_kvstream.write_text("#!/bin/sh\n")
    monkeypatch.setattr("sys.argv", [str(venv_kvstream), "testbed", "up"])
    text = "\n".join(testbed.preflight(str(tmp_path), need_fio=False))
    assert "losetup not found" not in text, text
    assert f"sudo {venv_kvstream} testbed up" in text, text


def test_down_of_a_testbed_that_is_not_up_is_a_no_op(monkeypatch, tmp_path):
    monkeypatch.setattr(testbed, "STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(testbed, "BLKIO_ROOT", str(tmp_path / "blkio"))
    monkeypatch.setattr(testbed, "MOUNT_ROOT", str(tmp_path / "mnt"))
    lines = []
    assert testbed.down("never-built", image_dir=str(tmp_path / "img"), log=lines.append) is False
    assert "nothing to do" in lines[0]
    assert testbed.status("never-built") == {"up": False, "name": "never-built"}


# ---------------------------------------------------------------------------------------------- fio
def test_fio_jobfile_runs_jobs_concurrently_with_io_uring_direct():
    text = fio.jobfile([fio.FioJob("tier0", "/a", "randread", 8 << 20, size=(1 << 30) + 5),
                        fio.FioJob("tier1", "/b", "write", 8 << 20, runtime_s=None)])
    assert "ioengine=io_uring" in text and "direct=1" in text
    assert "[tier0]" in text and "[tier1]" in text and "stonewall" not in text
    assert f"size={1 << 30}" in text  # rounded down to a multiple of bs
    assert text.count("time_based=1") == 1


def test_fio_json_with_a_warning_first():
    out = 'fio: something odd\n{"jobs": [{"jobname": "tier0", "read": {"bw_bytes": 580000000}, ' \
          '"write": {"bw_bytes": 0}}]}'
    assert fio.parse_json(out) == {"tier0": {"read_bps": 580e6, "write_bps": 0.0}}
    assert fio.summarize(fio.parse_json(out), "read_bps") == {"tier0": 580.0}


# ------------------------------------------------------------------------------------ geometry/data
def test_llama3_8b_page_of_64_tokens_is_4_plus_4_mib():
    g = geometry.from_model("llama3-8b", 64)
    assert g.segments == (4 << 20, 4 << 20) and g.page_bytes == 8 << 20
    assert geometry.from_model("llama3-8b", 64, tp=2).segments == (2 << 20, 2 << 20)
    assert len(geometry.from_model("deepseek-v3", 64).segments) == 1
    with pytest.raises(ValueError, match="unknown model"):
        geometry.from_model("gpt-9", 64)
    assert geometry.from_bytes(65536).segments == (32768, 32768)


def test_sglang_shape_reproduces_the_chunks():
    from kvstream_hicache.tools.bench.contenders import sglang_shape

    for g in (geometry.from_model("llama3-8b", 64), geometry.from_bytes(1 << 16)):
        p, layers, heads, dim = sglang_shape(g)
        assert p * layers * heads * dim * 2 == g.segments[0]


def test_dataset_pages_differ_and_the_check_catches_stale_data():
    g = geometry.from_bytes(16384)
    ds = Dataset(g, batch_pages=4, n_batches=2, seed=3)
    assert len({k for b in ds.batches for k in b.keys}) == 8 and all(len(k) == 64 for k in ds.batches[0].keys)
    buf = np.zeros(4 * g.page_bytes, dtype=np.uint8)
    views = page_views(buf, g.page_bytes, 4)
    batch = ds.batches[1]
    for i, j in enumerate(batch.pages):
        ds.fill(j, views[i])
    assert views[0].tobytes() != views[1].tobytes()
    positions = ds.sample(batch, 2)
    assert positions == [0, 3]
    assert check(ds, batch, views, positions, [True] * 4) == []
    poison(views, positions)
    assert check(ds, batch, views, positions, [True] * 4) == [0, 3]
    assert check(ds, batch, views, positions, [False] * 4) == []  # a miss is not wrong data
    segs = page_segments(1000, g, 2)
    assert segs == [[(1000, 8192), (9192, 8192)], [(17384, 8192), (25576, 8192)]]


# ------------------------------------------------------------------------------------- instrument
class _FakeRing:
    def __init__(self):
        self.done = []
        self.closed = False

    def submit(self, ops):
        self.done += [(op[4], 100) for op in ops]
        return len(ops)

    def reap(self, min_complete=1, timeout=None):
        out, self.done = self.done, []
        return out

    def close(self):
        self.closed = True


def test_span_recorder_measures_first_submission_to_last_completion_or_return(tmp_path):
    now = [0.0]
    rec_ = SpanRecorder([str(tmp_path), str(tmp_path)], clock=lambda: now[0], tier_of_fd=lambda fd: fd)
    ring = TimedRing(_FakeRing(), rec_)
    rec_.reset()
    now[0] = 1.0
    ring.submit([(OP_READ, 0, None, 0, 1), (OP_READ, 1, None, 0, 2), (OP_WRITE, 1, None, 0, 3)])
    now[0] = 1.5
    ring.reap()
    spans, nbytes = rec_.spans()
    assert spans == (0.5, 0.5) and nbytes == (100, 100)  # the write is not counted
    ring.submit([(OP_READ, 0, None, 0, 4)])  # in flight when the batch returns ...
    now[0] = 2.0
    rec_.returned()  # ... so tier 0 was busy with the batch until it returned
    assert rec_.spans() == ((1.0, 0.5), (100, 100))
    rec_.reset()  # (and that read is an orphan of the batch from now on)
    now[0] = 3.0
    ring.reap()
    assert rec_.spans() == ((None, None), (0, 0))
    ring.close()
    assert ring.inner.closed


def test_span_recorder_refuses_tiers_on_one_file_system(tmp_path):
    assert not SpanRecorder([str(tmp_path), str(tmp_path)]).usable


# ------------------------------------------------------------------------------------------- drift
class _FakeBed:
    profile = testbed.PROFILES["testbed2-1:20"]

    def __init__(self):
        self.calls = []

    def set_read_bps(self, tier, bps):
        self.calls.append((tier, bps))


def test_periodic_halves_and_restores_the_throttle():
    bed = _FakeBed()
    sc = drift.make("periodic", testbed=bed, dirs=["/a", "/b"], bs=4096)
    for on in (True, False, True):
        sc._on = on
        sc._switch(on)
        sc._event(on=on)
    sc.stop()  # it was on: stop restores the full limit
    assert bed.calls == [(1, 90 * MB), (1, 180 * MB), (1, 90 * MB), (1, 180 * MB)]
    assert [e["read_bps"] for e in sc.events] == [90 * MB, 180 * MB, 90 * MB, 180 * MB]
    assert [e["on"] for e in sc.events] == [True, False, True, False]


class _FakeProc:
    def __init__(self):
        self.terminated = False

    def poll(self):
        return 0 if self.terminated else None

    def terminate(self):
        self.terminated = True

    def wait(self, timeout=None):
        return 0


def test_emulated_write_interference_runs_a_writer_and_lowers_tier0_reads(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(fio, "spawn", lambda jobs: started.append(jobs) or _FakeProc())
    bed = _FakeBed()
    sc = drift.make("write-interference", testbed=bed, dirs=[str(tmp_path), str(tmp_path)], bs=4096)
    sc._switch(True)
    assert started[0][0].rw == "write" and started[0][0].filename.startswith(str(tmp_path))
    proc = sc.proc
    sc._switch(False)
    assert proc.terminated and bed.calls == [(0, 290 * MB), (0, 580 * MB)]
    physical = drift.make("write-interference", testbed=bed, dirs=[str(tmp_path)], bs=4096, interference="physical")
    physical._switch(True)
    physical._switch(False)
    assert bed.calls == [(0, 290 * MB), (0, 580 * MB)]  # the writer only


def test_round_order_reads_every_policy_once_and_changes_who_goes_before_whom():
    """A rotation kept each policy behind the same one every round (a two-tier policy behind its one-tier
    twin always found a throttled tier's burst credit unspent): the shuffled order must not."""
    names = ["nixl", "kvstream-1tier", "kvstream", "sglang-adapter-1tier", "sglang-adapter"]
    orders = [drift.round_order(names, r, seed=0) for r in range(12)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders == [drift.round_order(names, r, seed=0) for r in range(12)]  # reproducible from the seed
    assert orders != [drift.round_order(names, r, seed=1) for r in range(12)]
    before = {n: {o[o.index(n) - 1] for o in orders if o.index(n) > 0} for n in names}
    assert all(len(b) >= 2 for b in before.values()), before
    assert len({o[0] for o in orders}) >= 3  # and each meets the round's start at different times


def test_exposure_is_the_share_of_time_with_the_drift_on():
    events = [{"t": 1.0, "on": True}, {"t": 3.0, "on": False}, {"t": 5.0, "on": True}]
    assert drift.exposure(events, 0.0, 4.0) == pytest.approx(0.5)
    assert drift.exposure(events, 2.0, 6.0) == pytest.approx(0.5)
    assert drift.exposure([], 0.0, 1.0) == 0.0


def test_scenarios_need_what_they_drive():
    with pytest.raises(ValueError, match="--testbed"):
        drift.make("periodic", testbed=None, dirs=["/a", "/b"], bs=4096)
    with pytest.raises(ValueError, match="unknown scenario"):
        drift.make("storm", testbed=None, dirs=["/a"], bs=4096)
    assert drift.make("competing", testbed=None, dirs=["/a", "/b"], bs=4096).tier == 1
    assert drift.make("write-interference", testbed=None, dirs=["/a", "/b"], bs=4096).tier == 0
    assert drift.make("quiet", testbed=None, dirs=["/a"], bs=4096).name == "quiet"


def test_write_baseline_tiers():
    from types import SimpleNamespace

    from kvstream_hicache.tools.bench.runner import UsageError, _baseline_tiers

    bed1 = SimpleNamespace(profile=testbed.PROFILES["testbed1-1:20"])
    assert _baseline_tiers("auto", bed1, 2) == [0]  # testbed1's tier 0 writes slowest (230 MB/s)
    assert _baseline_tiers("auto", None, 3) == [0, 1, 2]
    assert _baseline_tiers("none", bed1, 2) == [] and _baseline_tiers("1", None, 2) == [1]
    for bad in ("2", "fast"):
        with pytest.raises(UsageError):
            _baseline_tiers(bad, None, 2)


# ------------------------------------------------------------------------------ device-speed testbeds
def test_device_speed_profiles_hold_the_issue_figures():
    a = testbed.PROFILES["ram-0.7"]
    assert [(t.read_bps, t.backing) for t in a.tiers] == [(0, "ram"), (700 * MB, "ram")]
    c = testbed.PROFILES["testbed2-1:7"]  # the paper's Testbed-2 (11.6 + 3.6 GB/s) at 1:7
    assert [t.read_bps for t in c.tiers] == [1650 * MB, 515 * MB] and {t.backing for t in c.tiers} == {"ram"}
    assert c.slowest_write_tier == 1
    b = testbed.PROFILES["disk+ram-0.7"]
    assert [t.backing for t in b.tiers] == ["dir", "ram"] and b.tiers[1].read_bps == 700 * MB
    assert a.slowest_write_tier == 0  # 0 is "not throttled", not the slowest
    for p in (a, b, c):  # a device needs depth to reach its rate; the 1:20 profiles keep the engine's old depth
        assert p.fio_iodepth == testbed.DEVICE_FIO_IODEPTH
    assert testbed.PROFILES["testbed2-1:20"].fio_iodepth == fio.FIO_IODEPTH


def test_explicit_profile_with_backings():
    p = testbed.parse_profile("dir,ram:700/0")
    assert [(t.read_bps, t.write_bps, t.backing) for t in p.tiers] == [(0, 0, "dir"), (700 * MB, 0, "ram")]
    assert p.fio_iodepth == testbed.DEVICE_FIO_IODEPTH and p.fio_file_bytes == testbed.RAM_FIO_FILE_BYTES
    q = testbed.parse_profile("disk:400/200, 150/100")
    assert [t.backing for t in q.tiers] == ["disk", "disk"] and q.fio_iodepth == fio.FIO_IODEPTH
    with pytest.raises(testbed.TestbedError, match="'dir'"):
        testbed.parse_profile("ram:fast")


def test_ram_tier_commands_and_names():
    assert testbed.losetup_attach_cmd("/img", direct_io=False) == ["losetup", "--find", "--show", "/img"]
    assert testbed.mount_cmd("/dev/loop3", "/mnt/x", discard=True) == ["mount", "-o", "noatime,discard",
                                                                       "/dev/loop3", "/mnt/x"]
    n = testbed.names("b", 2, "/var/lib/x", "/ram")
    assert n["ram_images"] == ["/ram/b-tier0.img", "/ram/b-tier1.img"]
    assert n["dir_tiers"][0] == "/var/lib/x/b-tier0"
    assert testbed.names("b", 1)["ram_images"] == ["/dev/shm/b-tier0.img"]


def test_throttle_rules_remove_limits_of_unthrottled_tiers_and_skip_dir_tiers():
    assert testbed.throttle_writes("/cg", ["7:0", "7:1"], testbed.PROFILES["ram-0.7"]) == [
        ("/cg/blkio.throttle.read_bps_device", "7:0 0"),  # 0 removes a rule a previous profile left
        ("/cg/blkio.throttle.write_bps_device", "7:0 0"),
        ("/cg/blkio.throttle.read_bps_device", "7:1 700000000"),
        ("/cg/blkio.throttle.write_bps_device", "7:1 0"),
    ]
    assert testbed.throttle_writes("/cg", ["", "7:1"], testbed.PROFILES["disk+ram-0.7"]) == [
        ("/cg/blkio.throttle.read_bps_device", "7:1 700000000"),
        ("/cg/blkio.throttle.write_bps_device", "7:1 0"),
    ]


def test_fio_each_tier_alone_then_all_at_once(tmp_path):
    """Real fio on two small files (plain directories): the figures a device-speed run compares with."""
    if not fio.available():
        pytest.skip("fio not installed (scripts/system-deps.sh installs it)")
    files = [str(tmp_path / "a"), str(tmp_path / "b")]
    fio.fill(files, 1 << 20, 8 << 20, 4)
    assert [os.path.getsize(f) for f in files] == [8 << 20] * 2
    mtime = os.path.getmtime(files[0])
    fio.fill(files, 1 << 20, 8 << 20, 4)  # already full: not written again
    assert os.path.getmtime(files[0]) == mtime
    lines = []
    out = fio.alone_and_together(files, "randread", 1 << 20, size=8 << 20, iodepth=4, runtime_s=0.3, log=lines.append)
    assert set(out) == {"tier0", "tier1", "tier0+", "tier1+", "all"}
    assert all(v > 0 for v in out.values())
    assert out["all"] == pytest.approx(out["tier0+"] + out["tier1+"], abs=0.11)
    assert len(lines) == 3 and "all at once" in lines[-1]


def test_summary_has_cpu_per_gb_median_and_engine_memory():
    recs = [rec("kvstream", i, t, 10**9, (10**9,), (t,)) for i, t in enumerate((1.0, 2.0, 4.0))]
    for r, cpu in zip(recs, (0.1, 0.2, 0.3)):
        r.extra["cpu_s"] = cpu
    recs[1].extra["memory_peak_bytes"] = 8 << 20
    recs[2].extra["memory_peak_bytes"] = 4 << 20
    s = gap.summarize(recs, 1)
    assert s["cpu_s_per_gb"] == pytest.approx(0.6 / 3)
    assert s["median_gbps"] == pytest.approx(0.5)  # per batch 1, 0.5, 0.25 GB/s
    assert s["throughput_gbps"] == pytest.approx(3 / 7)
    assert s["memory_peak_bytes"] == 8 << 20
    assert gap.summarize([rec("p", 0, 1.0, 1, (1,), (1.0,))], 1)["memory_peak_bytes"] is None


def test_peers_name_what_they_need_and_where_they_write():
    from kvstream_hicache.tools.bench import peers

    assert peers.copies("hicache-nixl", 2) == [1.0, 0.0]
    assert peers.copies("hicache-nixl-sharded", 2) == [0.75, 0.75]
    assert peers.copies("lmcache-kvstream", 2) == [1.0, 1.0]
    assert peers.copies("lmcache-kvstream-1tier", 2) == [1.0, 0.0]
    assert peers.copies("kvstream", 2) == [0.0, 0.0]  # the bench engine's own copy is counted apart
    assert peers.missing(["kvstream", "tier0", "kvstream-1tier", "lmcache-adapter"]) == []  # need nothing else
    # This venv has sglang or LMCache, never both: what it lacks is named, with where to run instead.
    problems = peers.missing(["hicache-nixl", "lmcache-fs-native"])
    absent = [pkg for pkg in ("sglang", "nixl", "lmcache") if importlib.util.find_spec(pkg) is None]
    assert absent and len(problems) == len(absent) + 1
    assert problems[-1] == "sglang and LMCache contenders cannot share one run (separate venvs): run them apart"
    if "lmcache" in absent:
        assert "lmcache-fs-native needs lmcache, not importable here" in problems[-2] and ".venv-lmcache" in problems[-2]


def test_device_summary_pairs_each_round_with_the_reference():
    from kvstream_hicache.tools.bench import summary

    def run(rates: dict[str, list[float]], fio_all: float) -> dict:
        batches = [{"policy": p, "round": k, "t_ret": 1.0, "nbytes": int(r * 1e6)}
                   for p, rs in rates.items() for k, r in enumerate(rs)]
        policies = {p: {"throughput_gbps": sum(rs) / len(rs) / 1e3, "share": [1.0, 0.0], "cpu_s_per_gb": 0.05,
                        "memory_peak_bytes": None if p == "hicache-nixl" else 8 << 20,
                        "speedup_vs_hicache-nixl": sum(rs) / sum(rates["hicache-nixl"])}
                    for p, rs in rates.items()}
        return {"policies": policies, "batches": batches, "tiers": ["/a", "/b"], "geometry": {"label": "g"},
                "testbed": {"profile": "ram-0.7"}, "fio": {"read": {"all": fio_all, "tier0+": fio_all, "tier1+": 0}},
                "loadavg": {"start": [1.0], "end": [2.0]}}

    # load drifts between the runs, and within the second: each round's ratio stays 1.5x
    runs = [run({"hicache-nixl": [1000, 1000], "kvstream-1tier": [1500, 1500]}, 2000),
            run({"hicache-nixl": [400, 2000], "kvstream-1tier": [600, 3000]}, 4000)]
    assert summary.paired_ratios(runs, "kvstream-1tier", "hicache-nixl") == pytest.approx([1.5] * 4)
    row = summary.device_row(runs, "kvstream-1tier", "hicache-nixl")
    assert row["x_ref_paired"] == pytest.approx(1.5) and row["memory_mib"] == 8
    assert row["mbps"] == pytest.approx((1500 + 1800) / 2) and row["x_fio"] == pytest.approx((0.75 + 0.45) / 2)
    text = summary.device_markdown(runs)
    assert "| ram-0.7 (2 runs) | 1100, 0.050 s/GB | - | - | 1650 (1.50x), 0.050 s/GB | - |" in text


def test_a_run_with_the_lmcache_adapter_policy_stays_on_the_sglang_path():
    """`lmcache-adapter` is kvstream's own task machinery, run in .venv beside the sglang contenders
    (docs/benchmarks.md: it needs no LMCache): a run with it is an sglang-path run, in the headline and
    against hicache-nixl, not an LMCache run whose reference never ran."""
    from kvstream_hicache.tools.bench import summary

    rates = {"hicache-nixl": [1000, 2000], "sglang-adapter-1tier": [1100, 2200], "lmcache-adapter": [900, 1800]}
    doc = {"policies": {p: {"throughput_gbps": sum(rs) / len(rs) / 1e3, "share": [1.0, 0.0], "cpu_s_per_gb": 0.05,
                            "memory_peak_bytes": None} for p, rs in rates.items()},
           "batches": [{"policy": p, "round": k, "t_ret": 1.0, "nbytes": int(r * 1e6)}
                       for p, rs in rates.items() for k, r in enumerate(rs)],
           "tiers": ["/a", "/b"], "testbed": {"profile": "ram-0.7"}, "fio": {"read": {"all": 4000}},
           "geometry": {"label": "llama3-8b P=64", "page_bytes": 8 << 20}, "loadavg": {"start": [1.0], "end": [1.0]}}
    assert "| llama3-8b P=64 (2 rounds) | 1500 (1000..2000)" in summary.headline_markdown([doc])
    text = summary.device_markdown([doc])
    assert "sglang path" in text and "x hicache-nixl" in text, text


def test_headline_leads_with_the_adapter_and_gives_per_round_spreads():
    from kvstream_hicache.tools.bench import summary

    rates = {"hicache-nixl": [1000, 2000, 1000], "sglang-adapter-1tier": [1100, 2400, 900],
             "sglang-adapter": [1210, 2400, 1080], "kvstream-1tier": [1500, 3000, 1500], "kvstream": [1500, 2700, 1650]}
    batches = [{"policy": p, "round": k, "t_ret": 1.0, "nbytes": int(r * 1e6)} for p, rs in rates.items()
               for k, r in enumerate(rs)]
    policies = {p: {"throughput_gbps": sum(rs) / len(rs) / 1e3, "share": [1.0, 0.0], "cpu_s_per_gb": 0.05,
                    "memory_peak_bytes": None} for p, rs in rates.items()}
    doc = {"policies": policies, "batches": batches, "tiers": ["/a", "/b"], "testbed": {"profile": "ram-0.7"},
           "geometry": {"label": "llama3-8b P=64", "page_bytes": 8 << 20}, "fio": {"read": {"all": 4000}},
           "loadavg": {"start": [1.0], "end": [2.0]}}
    mla = {**doc, "geometry": {"label": "deepseek-v3 P=64 (MLA)", "page_bytes": 4497408}}
    text = summary.headline_markdown([mla, doc])
    lines = [x for x in text.splitlines() if x.startswith("| ")]
    assert lines[0].split(" | ")[2].startswith("adapter 1 tier")  # the adapter before the engine
    row = lines[1]  # page sizes largest first: the 8 MiB row, then MLA's
    assert row.startswith("| llama3-8b P=64 (3 rounds) | 1000 (1000..2000); 0.050 | 1100 (900..2400); 1.10 (0.90..1.20); 0.050 |")
    # two tiers per round against nixl and against their own one tier (1.10, 1.00, 1.20)
    assert "| 1210 (1080..2400); 1.20 (1.08..1.21); 1.10 (1.00..1.20); 0.050 |" in row
    assert lines[2].startswith("| deepseek-v3 P=64 (MLA) (3 rounds) |")
    assert summary.spread([]) == "-"


def test_a_ram_tier_s_image_is_never_made_through_a_link_another_user_planted(monkeypatch, tmp_path):
    """A ram tier's image is ``/dev/shm/<name>-tier<i>.img``: a name in a directory every user writes, known in
    advance (``kvstream serve-cpu`` and the demo build ``demo``'s as root). Another user's link there to a file
    only root may write had that file truncated to the image's size by up()'s open (and then a loop device
    formatted over it: mkfs.ext4 -F); a file of theirs became the image of root's mounted tier, theirs to read
    and rewrite under the kernel. The image is made new, following no link (O_EXCL|O_NOFOLLOW); another
    owner's file there is refused, naming it. Found by an attacker's trial."""
    ram = tmp_path / "shm"
    ram.mkdir()
    ram.chmod(0o1777)
    precious = tmp_path / "precious"
    precious.write_bytes(b"root's own file\n")
    monkeypatch.setattr(testbed, "STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(testbed, "preflight", lambda *a, **k: [])
    monkeypatch.setattr(testbed, "down", lambda *a, **k: False)
    ran = []

    def run(cmd):  # (nothing real: the first command, losetup, is where the image was already made)
        ran.append(cmd)
        raise testbed.TestbedError("stop here")

    monkeypatch.setattr(testbed, "_run", run)
    link = ram / "attack-tier0.img"
    os.symlink(precious, link)
    profile = testbed.parse_profile("ram:700/0")
    with pytest.raises(testbed.TestbedError) as exc:
        testbed.up(profile, name="attack", sizes=[1 << 20], image_dir=str(tmp_path / "img"), ram_image_dir=str(ram),
                   fio_bs=None, log=lambda _: None)
    assert precious.read_bytes() == b"root's own file\n"
    assert ran == [] and str(link) in str(exc.value), exc.value
    os.unlink(link)
    ours = ram / "attack-tier0.img"  # (a leftover of this user's own, as a crash leaves it: reused)
    ours.write_bytes(b"x")
    with pytest.raises(testbed.TestbedError, match="stop here"):
        testbed.up(profile, name="attack", sizes=[1 << 20], image_dir=str(tmp_path / "img"), ram_image_dir=str(ram),
                   fio_bs=None, log=lambda _: None)
    assert ours.stat().st_size == 1 << 20 and ran[0][-1] == str(ours)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")
@pytest.mark.parametrize("planted", ["link", "file"])
def test_the_glusterfs_lock_follows_no_link_and_takes_no_file_of_another_user(monkeypatch, tmp_path, planted):
    """GlusterFS's one-per-machine lock is /var/tmp/kvstream-glusterd.lock, a name known in advance in a directory
    every user writes, opened O_CREAT as root. Another user's link there had root create (or open) its target,
    anywhere (/etc/nologin: no one else logs in); a file of theirs there, flocked, held root's tests waiting
    15 minutes, then blamed "another GlusterFS of this machine". Either is refused at once, naming the path
    and the fix. Found by an attacker's trial."""
    from kvstream_hicache.tools.bench import glusterfs

    shared = tmp_path / "vartmp"
    shared.mkdir()
    shared.chmod(0o1777)
    lock, target = shared / "kvstream-glusterd.lock", tmp_path / "nologin"
    monkeypatch.setattr(glusterfs, "LOCK_PATH", str(lock))
    monkeypatch.setattr(glusterfs, "LOCK_WAIT_S", 0.0)
    if planted == "link":
        os.symlink(target, lock)
    else:
        lock.write_bytes(b"")
        os.chown(lock, 54321, 54321)
    fs = glusterfs.GlusterFS(str(tmp_path / "gluster"))
    with pytest.raises(glusterfs.GlusterError, match=str(lock)) as exc:
        fs._lock()
    assert not target.exists() and fs._lock_fd is None
    assert "another GlusterFS" not in str(exc.value)


def test_down_detaches_no_loop_device_through_a_link_another_user_planted(monkeypatch, tmp_path):
    """down() looks for this name's images at their default places too (a half-built testbed's): a link another
    user put at ``/dev/shm/<name>-tier0.img`` to an image some loop device reads (another testbed's, a VM's)
    had that device detached as root (``losetup -j`` follows the link). Only a file of this user's there is the
    testbed's image. Found by an attacker's trial."""
    ram = tmp_path / "shm"
    ram.mkdir()
    ram.chmod(0o1777)
    other = tmp_path / "other.img"  # (an image a loop device of someone else's reads)
    other.write_bytes(b"")
    os.symlink(other, ram / "attack-tier0.img")
    for where in ("STATE_DIR", "BLKIO_ROOT", "MOUNT_ROOT"):
        monkeypatch.setattr(testbed, where, str(tmp_path / where.lower()))
    ran = []
    monkeypatch.setattr(testbed, "_run", lambda cmd: ran.append(cmd) or "/dev/loop99: []: (%s)\n" % other)
    testbed.down("attack", image_dir=str(tmp_path / "img"), ram_image_dir=str(ram), log=lambda _: None)
    assert [cmd for cmd in ran if cmd[0] == "losetup"] == []
    assert other.exists()
