"""Shared test configuration.

* ``KVSTREAM_STRICT=1`` (set by scripts/test.sh in CI) turns every skip into a failure: in CI the
  io_uring, sglang and LMCache tests must run, and a skip there means a missing install.
* ``tier_root``: a scratch directory on a file system that supports O_DIRECT (tmpfs on older
  kernels does not), removed afterwards.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

STRICT = os.environ.get("KVSTREAM_STRICT") == "1"
# A disk-backed scratch root: /var/tmp is on disk on Debian/Ubuntu even where /tmp is tmpfs.
SCRATCH = os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under KVSTREAM_STRICT=1 (CI must run this test): {reason}"


@pytest.fixture
def tier_root():
    path = tempfile.mkdtemp(prefix="kvstream-test-", dir=SCRATCH)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tier_dirs(tier_root):
    """Three empty tier directories on an O_DIRECT-capable file system."""
    dirs = [os.path.join(tier_root, f"tier{i}") for i in range(3)]
    for d in dirs:
        os.makedirs(d)
    return dirs
