"""The peers' own suites (tests/peers/suites.py) against kvstream's classes, each in its own process.

A suite passes when every one of its tests passes except those listed as not applicable, and each of
those still runs and fails (one that starts passing must leave the list). A crash of the suite's
process (a signal, no results) fails it with its output.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

import suites


def _params():
    for suite in suites.SUITES:
        marks = [pytest.mark.lmcache] if suite.lmcache else []
        yield pytest.param(suite, id=suite.name, marks=marks)


@pytest.mark.parametrize("suite", list(_params()))
def test_peer_suite(suite):
    if suite.lmcache:
        pytest.importorskip("lmcache", reason="the LMCache suites run in .venv-lmcache (scripts/test.sh)")
    work = Path(tempfile.mkdtemp(prefix=f"kvstream-peer-{suite.name}-", dir="/var/tmp"))
    try:
        proc = suites.run(suite, work)
        tail = (proc.stdout + proc.stderr)[-8000:]
        xml = work / "results.xml"
        assert proc.returncode >= 0 and xml.exists(), f"{suite.name}: the suite's process died " \
                                                      f"(rc {proc.returncode}):\n{tail}"
        results = suites.outcomes(xml)
        assert results, f"{suite.name}: no test ran:\n{tail}"
        unexpected = {t: r for t, r in results.items() if r != "passed" and t not in suite.not_applicable}
        assert not unexpected, f"{suite.name}: {unexpected}\n{tail}"
        missing = set(suite.not_applicable) - set(results)
        assert not missing, f"{suite.name}: tests listed as not applicable are gone upstream: {missing}"
        now_pass = [t for t in suite.not_applicable if results[t] == "passed"]
        assert not now_pass, f"{suite.name}: listed as not applicable but passing now: {now_pass}"
    finally:
        suites.clean(work)
