"""Prometheus export of kvstream's stats, for sglang servers started with ``--enable-metrics``.

sglang runs prometheus_client in multiprocess mode: the launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before it
spawns the scheduler processes, every process writes its samples there, and ``/metrics`` aggregates them.
So this module imports prometheus_client lazily (in the scheduler, after the variable is inherited), creates
its metric families once per process (a second registration of a name raises in prometheus_client), and
labels every series with the scheduler's ranks so processes never collide.

Families (``tier`` is the tier's position, 0 = fastest; ``kvstream:tier_info`` maps it to the directory):

==========================================  =========  ==================================================
``kvstream:tier_read_bytes_total``          counter    bytes read from the tier (duplicate reads included)
``kvstream:tier_served_bytes_total``        counter    bytes the tier delivered first (its share of the data)
``kvstream:tier_read_in_place_bytes_total`` counter    bytes read from the tier straight into the host pool (no copy)
``kvstream:tier_write_bytes_total``         counter    bytes written to the tier
``kvstream:tier_read_share``                gauge      fraction of all served bytes served by the tier
``kvstream:tier_fallbacks_total``           counter    reads of pages this tier failed, retried on a replica
``kvstream:tier_corrupted_pages_total``     counter    copies on the tier that failed verification
``kvstream:tier_errors_total``              counter    I/O errors on the tier
``kvstream:tier_failures_total``            counter    times the tier was taken out of service (failed)
``kvstream:tier_write_timeouts_total``      counter    tier writes (or writer's calls) left write_timeout unanswered
``kvstream:tier_evictions_total``           counter    pages evicted from the tier (capacity)
``kvstream:tier_skipped_writes_total``      counter    new pages the tier's capacity could not take (not written there)
``kvstream:tier_write_failures_total``      counter    page writes that failed on the tier (other tiers only)
``kvstream:tier_replica_skips_total``       counter    new pages whose replica the tier skipped (replicate=budget)
``kvstream:tier_replica_skip_bytes_total``  counter    bytes of those replicas
``kvstream:tier_replication_done_total``    counter    replicas background replication wrote to the tier (catch-up)
``kvstream:tier_replication_bytes_total``   counter    bytes of those replicas
``kvstream:tier_replication_dropped_total`` counter    owed replicas given up (no valid copy left, a page too big for the tier)
``kvstream:tier_replication_pending``       gauge      pages the tier lacks that background replication owes it
``kvstream:tier_healthy``                   gauge      1 while the tier is in service, 0 while failed
``kvstream:pages_total{result}``            counter    pages requested by reads: found / missing
``kvstream:under_replicated_pages_total``   counter    pages stored on fewer tiers than configured
``kvstream:read_timeouts_total``            counter    gets read_timeout ended with reads in flight (their pages missed)
``kvstream:read_calls_total{rule}``         counter    read calls that chose how to use a slower tier: open / held
``kvstream:retrieval_seconds``              histogram  time of one read batch
``kvstream:retrieval_bound_seconds_total``  counter    sum of the batches' aggregate-bandwidth bound D/sum(b_k)
``kvstream:retrieval_gap``                  histogram  time / bound - 1 per batch (0 = at the bound)
``kvstream:adapter_errors_total{op}``       counter    exceptions turned into misses by the sglang adapter
==========================================  =========  ==================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..flow import RULE_NAMES
from ..locks import ranked_lock

PREFIX = "kvstream:"
RETRIEVAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds
GAP_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)  # time / bound - 1

# engine per-tier counter -> exported counter family
TIER_COUNTERS = {
    "bytes_read": "tier_read_bytes",
    "bytes_served": "tier_served_bytes",
    "bytes_in_place": "tier_read_in_place_bytes",
    "bytes_written": "tier_write_bytes",
    "replica_retries": "tier_fallbacks",
    "corrupted": "tier_corrupted_pages",
    "errors": "tier_errors",
    "failures": "tier_failures",
    "write_timeouts": "tier_write_timeouts",
    "evictions": "tier_evictions",
    "skipped_writes": "tier_skipped_writes",
    "write_failures": "tier_write_failures",
    "replica_skipped_pages": "tier_replica_skips",
    "replica_skipped_bytes": "tier_replica_skip_bytes",
    "replication_done": "tier_replication_done",
    "replication_bytes": "tier_replication_bytes",
    "replication_dropped": "tier_replication_dropped",
}
TIER_DOCS = {
    "tier_read_bytes": "Bytes read from the tier (duplicate reads near the routing meeting point included).",
    "tier_served_bytes": "Bytes the tier delivered first: its share of the data returned to sglang.",
    "tier_read_in_place_bytes": "Bytes read from the tier straight into sglang's host pool (registered with the "
                                "read ring, or on huge pages): no staging copy. The rest of its served bytes "
                                "were staged and copied.",
    "tier_write_bytes": "Bytes written to the tier.",
    "tier_fallbacks": "Page reads this tier failed that were retried on another replica.",
    "tier_corrupted_pages": "Copies on the tier that failed header or checksum verification.",
    "tier_errors": "I/O errors on the tier.",
    "tier_failures": "Times the tier was taken out of service (an I/O error of the tier, its directory gone, a "
                     "call it did not answer): a failure that healed between two scrapes shows here.",
    "tier_write_timeouts": "Times the tier's writes in flight, or a writer's call on it (create, commit, directory "
                           "sync) on a tier that may hang, went write_timeout without an answer (the tier then "
                           "failed; other calls that time out show in tier_failures).",
    "tier_evictions": "Pages evicted from the tier to stay within its capacity.",
    "tier_skipped_writes": "New pages the tier's capacity could not take (no eviction could make room: a backup "
                           "larger than the capacity, pages pinned by reads): not written there; stored nowhere "
                           "when every tier skipped them.",
    "tier_write_failures": "Page writes the tier failed (an I/O error, no room, no file descriptor left): the "
                           "page went to the other tiers only.",
    "tier_replica_skips": "New pages whose replica this tier skipped: its writes would have drained after the "
                          "home copy's and the slack (replicate=budget); not a failure.",
    "tier_replica_skip_bytes": "Bytes of the replicas this tier skipped (replicate=budget).",
    "tier_replication_done": "Replicas background replication wrote to the tier later (skipped, lost or promoted "
                             "pages), from a copy on another tier or a read's memory.",
    "tier_replication_bytes": "Bytes of the replicas background replication wrote to the tier.",
    "tier_replication_dropped": "Replicas owed to the tier that were given up: no valid copy could be read, or "
                                "the page can never fit on the tier's file system (a full tier keeps them "
                                "owed: replication_pending).",
}

# The storage calls sglang's threads make (adapter_errors_total{op}: a series each from the start).
DATA_OPS = ("batch_exists", "batch_get_v1", "batch_set_v1")

_families: dict | None = None
_families_lock = ranked_lock("metrics")


def families(rank_labels: Sequence[str] = ("tp_rank", "dp_rank", "pp_rank", "attn_cp_rank")) -> dict:
    """The process-wide metric families (created on first use)."""
    global _families
    with _families_lock:
        if _families is not None:
            return _families
        # Imported here, not at module import: sglang sets PROMETHEUS_MULTIPROC_DIR before its processes start,
        # and prometheus_client decides its value storage (files vs memory) when first imported.
        from prometheus_client import Counter, Gauge, Histogram

        ranks = list(rank_labels)
        tier = ranks + ["tier"]
        fam: dict = {}
        for name in TIER_COUNTERS.values():
            fam[name] = Counter(PREFIX + name, TIER_DOCS[name], tier)
        fam["tier_read_share"] = Gauge(PREFIX + "tier_read_share",
                                       "Fraction of all bytes served to sglang that this tier served (since start).",
                                       tier, multiprocess_mode="mostrecent")
        fam["tier_replication_pending"] = Gauge(PREFIX + "tier_replication_pending",
                                                "Pages the tier lacks that background replication owes it.",
                                                tier, multiprocess_mode="mostrecent")
        fam["tier_healthy"] = Gauge(PREFIX + "tier_healthy", "1 while the tier is in service, 0 while failed.",
                                    tier, multiprocess_mode="mostrecent")
        fam["tier_info"] = Gauge(PREFIX + "tier_info", "Tier position -> directory (value 1).", tier + ["path"],
                                 multiprocess_mode="mostrecent")
        fam["pages"] = Counter(PREFIX + "pages", "Pages requested by reads, by result (found / missing).",
                               ranks + ["result"])
        fam["under_replicated"] = Counter(PREFIX + "under_replicated_pages",
                                          "Pages stored on fewer tiers than configured.", ranks)
        fam["read_timeouts"] = Counter(PREFIX + "read_timeouts",
                                       "Gets that read_timeout ended with reads still in flight (their pages "
                                       "reported missing): a tier that stalls reads.", ranks)
        fam["read_calls"] = Counter(PREFIX + "read_calls",
                                    "Read calls more than one tier could serve that chose a rule: open (every tier at "
                                    "its window) or held (slower tiers at one item: they share the reader's CPUs).",
                                    ranks + ["rule"])
        fam["retrieval_seconds"] = Histogram(PREFIX + "retrieval_seconds", "Time of one read batch, seconds.",
                                             ranks, buckets=RETRIEVAL_BUCKETS)
        fam["retrieval_bound"] = Counter(PREFIX + "retrieval_bound_seconds",
                                         "Sum over read batches of the aggregate-bandwidth bound D / sum(b_k).",
                                         ranks)
        fam["retrieval_gap"] = Histogram(PREFIX + "retrieval_gap",
                                         "Per read batch: retrieval time / bound - 1 (0 = at the bound).",
                                         ranks, buckets=GAP_BUCKETS)
        fam["adapter_errors"] = Counter(PREFIX + "adapter_errors",
                                        "Exceptions the sglang adapter turned into misses, by method.",
                                        ranks + ["op"])
        _families = fam
        return fam


class Exporter:
    """One backend's view of the families: its rank labels, and the last engine stats it exported.

    ``sync(stats)`` turns cumulative engine counters into counter increments (deltas since the previous sync),
    so several backends in one process (detach / re-attach) add up instead of double counting.
    """

    def __init__(self, labels: Mapping[str, str], tier_paths: Sequence[str]):
        self.labels = {k: str(v) for k, v in labels.items()}
        self.fam = families(tuple(self.labels))
        self.tier_paths = list(tier_paths)
        self._last_tiers: list[dict] = [{} for _ in tier_paths]
        self._last_totals: dict = {}
        self._lock = ranked_lock("metrics")
        for k, path in enumerate(self.tier_paths):
            self.fam["tier_info"].labels(**self.labels, tier=str(k), path=path).set(1)
            self.fam["tier_healthy"].labels(**self.labels, tier=str(k)).set(1)
            for name in TIER_COUNTERS.values():  # a series from the start: 0 is an answer (nothing in place)
                self.fam[name].labels(**self.labels, tier=str(k))
        for rule in RULE_NAMES:  # (0 too: no read call has chosen a rule yet, or one tier alone)
            self.fam["read_calls"].labels(**self.labels, rule=rule)
        # The series docs/sglang.md tells a user to watch, at 0 until something happens: a counter that
        # appears only at its first event shows nothing at /metrics (under_replicated, adapter_errors "should
        # stay 0" were absent on a real server), and rate()/increase() lose that first event.
        for result in ("found", "missing"):
            self.fam["pages"].labels(**self.labels, result=result)
        self.fam["under_replicated"].labels(**self.labels)
        self.fam["read_timeouts"].labels(**self.labels)
        self.fam["retrieval_bound"].labels(**self.labels)
        for op in DATA_OPS:
            self.fam["adapter_errors"].labels(**self.labels, op=op)

    def sync(self, stats: Mapping, adapter_counters: Mapping | None = None) -> None:
        """Export the engine's cumulative ``stats()`` dict."""
        with self._lock:
            for k, tier in enumerate(stats.get("tiers", ())[: len(self.tier_paths)]):
                last = self._last_tiers[k]
                lbl = dict(self.labels, tier=str(k))
                for src, dst in TIER_COUNTERS.items():
                    delta = tier.get(src, 0) - last.get(src, 0)
                    if delta > 0:
                        self.fam[dst].labels(**lbl).inc(delta)
                self.fam["tier_read_share"].labels(**lbl).set(float(tier.get("read_share", 0.0)))
                if "replication_pending" in tier:
                    self.fam["tier_replication_pending"].labels(**lbl).set(tier["replication_pending"])
                if "healthy" in tier:
                    self.fam["tier_healthy"].labels(**lbl).set(1 if tier["healthy"] else 0)
                self._last_tiers[k] = dict(tier)
            last = self._last_totals
            for src, result in (("pages_found", "found"), ("pages_missing", "missing")):
                delta = stats.get(src, 0) - last.get(src, 0)
                if delta > 0:
                    self.fam["pages"].labels(**self.labels, result=result).inc(delta)
            for src in ("under_replicated", "read_timeouts"):
                delta = stats.get(src, 0) - last.get(src, 0)
                if delta > 0:
                    self.fam[src].labels(**self.labels).inc(delta)
            for rule, count in (("held", lambda t: t.get("held_calls", 0)),  # (flow.SlowerTiers)
                                ("open", lambda t: t.get("routed_calls", 0) - t.get("held_calls", 0))):
                delta = count(stats) - count(last)
                if delta > 0:
                    self.fam["read_calls"].labels(**self.labels, rule=rule).inc(delta)
            self._last_totals = {k: v for k, v in stats.items() if isinstance(v, (int, float))}

    def observe_read(self, batch: Mapping, elapsed: float) -> None:
        """One read batch: its time, and its bound when the engine computed one."""
        self.fam["retrieval_seconds"].labels(**self.labels).observe(batch.get("time_s", elapsed) if batch else elapsed)
        bound = batch.get("bound_s") if batch else None
        if bound:
            self.fam["retrieval_bound"].labels(**self.labels).inc(bound)
            gap = batch.get("gap")
            if gap is not None:
                self.fam["retrieval_gap"].labels(**self.labels).observe(max(0.0, gap))

    def count_error(self, op: str) -> None:
        self.fam["adapter_errors"].labels(**self.labels, op=op).inc()
