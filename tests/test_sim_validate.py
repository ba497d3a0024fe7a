"""kvsim --validate-bench: the model's gaps against a (synthetic) kvstream bench run."""

from __future__ import annotations

import json

import pytest

from kvstream_hicache.tools.sim import model
from kvstream_hicache.tools.sim.cli import main
from kvstream_hicache.tools.sim.validate import predict_batch, summary, table, validate_files, validate_run

GB = 1e9
PAGE = 8 * 2**20
PAGES = 128
D = PAGE * PAGES


def _batch(policy: str, t0: float, t_ret: float, bps, source=("batch", "batch")) -> dict:
    return {"policy": policy, "round": 0, "t0": t0, "t_ret": t_ret, "nbytes": D, "pages": PAGES, "found": PAGES,
            "tier_bps": list(bps), "tier_bps_source": list(source), "bound_s": model.bound(D, bps)}


def _bench(overhead: float = 0.01, bps=(3 * GB, 1 * GB)) -> dict:
    """A bench-like run: every policy's batch takes the model's time plus ``overhead`` seconds."""
    ideal = {
        "static-0.75": model.static_time(D, 0.75, bps),
        "static-0.5": model.static_time(D, 0.5, bps),
        "tier0": D / bps[0],
        "kvstream": model.bound(D, bps),
        "mystery": 1.0,  # a policy the model does not cover: left out
    }
    batches, t = [], 0.0
    for rnd in range(3):
        for pol, ti in ideal.items():
            src = ("batch", "interpolated") if pol == "tier0" else ("batch", "batch")
            batches.append(_batch(pol, t, ti + overhead, bps, src))
            t += ti + overhead + 0.1
    pols = {}
    for pol in ideal:
        bs = [b for b in batches if b["policy"] == pol]
        pols[pol] = {"gap": sum(b["t_ret"] for b in bs) / sum(b["bound_s"] for b in bs) - 1}
    return {"scenario": "quiet", "testbed": {"profile": "synthetic"}, "tiers": ["t0", "t1"],
            "geometry": {"page_bytes": PAGE}, "policies": pols, "batches": batches}


def test_static_predictions_follow_eq6_and_measured_gap_is_the_bench_gap():
    run = validate_run(_bench(overhead=0.0))
    p = run["policies"]
    assert "mystery" not in p
    assert p["static-0.75"]["predicted_gap"]["own"] == pytest.approx(0.0, abs=1e-12)  # g = phi meets the bound
    assert p["static-0.5"]["predicted_gap"]["own"] == pytest.approx(model.static_penalty(0.5, 0.75) - 1)  # +100%
    assert p["tier0"]["predicted_gap"]["own"] == pytest.approx(4 / 3 - 1)
    for pol, r in p.items():
        assert r["measured_gap"] == pytest.approx(r["reported_gap"])
        assert r["mean_phi"] == pytest.approx(0.75)
        if pol != "kvstream":
            assert r["predicted_gap"]["own"] == pytest.approx(r["measured_gap"], abs=1e-9)
        # constant bandwidths: the neighbours' recording is the batch's own
        assert r["predicted_gap"]["others"] == pytest.approx(r["predicted_gap"]["own"])


def test_kvstream_prediction_stays_within_one_claim_of_the_bound():
    t = predict_batch("kvstream", D, PAGES, [3 * GB, 1 * GB], m=2)
    bound = model.bound(D, [3 * GB, 1 * GB])
    assert bound * (1 - 1e-9) <= t <= bound + 2 * PAGE / (1 * GB)
    t_odd = predict_batch("kvstream", D, PAGES, [2.9 * GB, 1.1 * GB], m=2)
    bound_odd = model.bound(D, [2.9 * GB, 1.1 * GB])
    assert bound_odd < t_odd <= bound_odd + 2 * PAGE / (1.1 * GB)
    assert predict_batch("sglang-adapter", D, PAGES, [3 * GB, 1 * GB], m=2) == pytest.approx(t)
    assert predict_batch("hicache-file", D, PAGES, [3 * GB, 1 * GB]) == pytest.approx(D / (3 * GB))
    assert predict_batch("static-0.5/0.5", D, PAGES, [3 * GB, 1 * GB]) == pytest.approx(0.5 * D / GB)
    assert predict_batch("unknown-policy", D, PAGES, [3 * GB, 1 * GB]) is None


def test_overhead_shows_as_a_negative_difference():
    run = validate_run(_bench(overhead=0.05))
    for pol in ("static-0.75", "static-0.5", "tier0"):
        r = run["policies"][pol]
        assert r["predicted_gap"]["own"] < r["measured_gap"]
        assert r["measured_gap"] - r["predicted_gap"]["own"] == pytest.approx(0.05 / model.bound(D, [3 * GB, 1 * GB]))


def test_leave_one_out_uses_the_other_batches():
    doc = _bench(overhead=0.0)
    # one static-0.5 batch saw tier 1 at half speed; its neighbours did not
    b = next(b for b in doc["batches"] if b["policy"] == "static-0.5")
    slow = [3 * GB, 0.5 * GB]
    b.update(tier_bps=slow, bound_s=model.bound(D, slow), t_ret=model.static_time(D, 0.5, slow))
    r = validate_run(doc)["policies"]["static-0.5"]
    assert r["predicted_gap"]["own"] == pytest.approx(r["measured_gap"])
    assert r["predicted_gap"]["others"] < r["measured_gap"]  # the recording missed the slow batch


def test_cli_validate_bench(tmp_path, capsys):
    path = tmp_path / "testbed-quiet-1.json"
    path.write_text(json.dumps(_bench()))
    out = tmp_path / "val.json"
    assert main(["--validate-bench", str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "testbed-quiet-1" in text and "static-0.5" in text and "pred others" in text
    doc = json.loads(out.read_text())
    assert set(doc["runs"][0]["policies"]) == {"static-0.75", "static-0.5", "tier0", "kvstream"}
    assert set(doc["summary"]) == {"static", "single tier", "completion-driven"}
    series = tmp_path / "run-series.json"
    series.write_text(json.dumps({"tiers": [{"t": [0.0], "bps": [1e9]}]}))
    assert main(["--validate-bench", str(series)]) == 2
    runs = validate_files([path])
    assert table(runs).splitlines()[0].startswith("run")
    assert summary(runs)["static"]["own"]["n"] == 2
