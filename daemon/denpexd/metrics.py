"""Every metric `denpexd serve` exports, in one place, registered on an injected registry.

Names follow `denpex_<subsystem>_<what>_<unit>` with `_total` on counters. Labels are bounded:
`kind` and `reason` come from short fixed lists, `job` and `node` exist only while their job is
open (at most `max_open_jobs`) and are removed when it closes.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

KINDS = ("match", "progress", "heartbeat")
INVALID_REASONS = (
    "too_large", "not_json", "version", "bad_id", "topic_mismatch", "schema", "topic", "range", "nesting", "field",
)  # fmt: skip
STAGES = ("none", "info", "warn", "error")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)


def invalid_reason(message: str, code: str | None = None) -> str:
    """Map a `WireError` (its code, else its message) to one of INVALID_REASONS (a bounded label)."""
    if code in INVALID_REASONS:
        return code
    m = message.lower()
    if "exceeds" in m and "bytes" in m:
        return "too_large"
    if m.startswith("not json") or "not a json object" in m:
        return "not_json"
    if "version" in m:
        return "version"
    if "does not match the topic" in m:
        return "topic_mismatch"
    if m.startswith("invalid ") and " id " in m:
        return "bad_id"
    if m.startswith("unexpected topic"):
        return "topic"
    return "schema"


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.registry = registry
        self.events_ingested = Counter(
            "denpex_ingest_events_total", "Events accepted into a job's engine", ["kind"], registry=r
        )
        self.events_dropped = Counter(
            "denpex_ingest_events_dropped_total",
            "Events dropped (their job was evicted before they were processed)",
            ["kind"],
            registry=r,
        )
        self.events_duplicate = Counter(
            "denpex_ingest_events_duplicate_total", "Events dropped as duplicates by id", ["kind"], registry=r
        )
        self.batches = Counter("denpex_ingest_batches_total", "Valid event batches received", registry=r)
        self.messages_shed = Counter(
            "denpex_ingest_messages_shed_total",
            "Agent event batches the embedded broker refused while ingest was full (their agents send them again)",
            registry=r,
        )
        self.backlog = Gauge(
            "denpex_ingest_backlog_messages",
            "Received messages waiting for validation (at most ingest_backlog)",
            registry=r,
        )
        self.read_pauses = Counter(
            "denpex_ingest_read_pauses_total",
            "Times ingest stopped reading from the broker because its backlog was full",
            registry=r,
        )
        self.batches_invalid = Counter(
            "denpex_ingest_batches_invalid_total", "Rejected MQTT payloads", ["reason"], registry=r
        )
        self.backpressure = Counter(
            "denpex_ingest_backpressure_waits_total",
            "Times ingest waited because a job's queue or the store's buffer was full",
            registry=r,
        )
        self.ingest_lag = Histogram(
            "denpex_ingest_lag_seconds",
            "Time from an event's timestamp to its processing (newest event of each batch)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.clock_requests = Counter(
            "denpex_clock_requests_total", "Clock-sync requests answered", registry=r
        )
        self.receipts = Counter(
            "denpex_ingest_receipts_total",
            "Receipts sent to agents for batches stored (or otherwise settled)",
            registry=r,
        )
        self.clock_offset = Gauge(
            "denpex_clock_offset_seconds", "Node clock offset (local minus reference)", ["node"], registry=r
        )
        self.clock_uncertainty = Gauge(
            "denpex_clock_uncertainty_seconds", "Uncertainty of the node clock offset", ["node"], registry=r
        )
        self.agents_connected = Gauge(
            "denpex_agents_connected", "Agents whose last status is online", registry=r
        )
        self.agents_offline = Counter(
            "denpex_agents_offline_total", "Agent offline statuses (last wills included)", registry=r
        )
        self.jobs_open = Gauge("denpex_jobs_open", "Jobs with an engine in memory", registry=r)
        self.jobs_closed = Counter("denpex_jobs_closed_total", "Jobs closed after idling", registry=r)
        self.jobs_evicted = Counter(
            "denpex_jobs_evicted_total", "Open jobs evicted because max_open_jobs was reached", registry=r
        )
        self.diagnoses = Counter("denpex_diagnosis_runs_total", "Diagnoses computed", registry=r)
        self.diagnosis_seconds = Histogram(
            "denpex_diagnosis_duration_seconds", "Time to compute one diagnosis", buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.warning_to_diagnosis = Histogram(
            "denpex_diagnosis_first_warning_to_diagnosis_seconds",
            "From the arrival of a failure's first related warning to its published diagnosis",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.job_failed = Gauge(
            "denpex_job_failed",
            "1 while an open job is diagnosed failed, labelled with its initiator",
            ["job", "initiator_rank", "initiator_node", "category"],
            registry=r,
        )
        self.nan_stage = Gauge(
            "denpex_nan_fingerprint_stage", "1 for the job's current NaN fingerprint stage", ["job", "stage"],
            registry=r,
        )  # fmt: skip
        self.nan_ranks = Gauge(
            "denpex_nan_fingerprint_ranks", "Ranks of the job at each NaN fingerprint stage", ["job", "stage"],
            registry=r,
        )  # fmt: skip
        self.job_stalled_seconds = Gauge(
            "denpex_job_stalled_seconds",
            "How long no rank of an open job has advanced, while the stall watch holds it stalled (0 otherwise)",
            ["job"],
            registry=r,
        )
        self.rank_slowness = Gauge(
            "denpex_rank_slowness_ratio",
            "A slow rank's own step time over its peers' median (only ranks found slow, see stragglers)",
            ["job", "node", "rank"],
            registry=r,
        )
        self.nan_first_rank = Gauge(
            "denpex_nan_fingerprint_first_rank",
            "The rank that left the info stage first (its number); absent until one did",
            ["job"],
            registry=r,
        )
        self.nan_events = Counter(
            "denpex_nan_fingerprint_events", "NaN-fingerprint events by stage", ["job", "stage"], registry=r
        )
        self.collateral_suppressed = Counter(
            "denpex_collateral_suppressed", "Collateral events suppressed (not alerted)", ["job"], registry=r
        )
        self.alerts_sent = Counter(
            "denpex_alerts_sent_total", "Alerts delivered", ["sink", "state"], registry=r
        )
        self.alerts_failed = Counter(
            "denpex_alerts_failed_total", "Alert deliveries that failed after retries", ["sink"], registry=r
        )
        self.store_writes = Counter("denpex_store_rows_written_total", "Rows written to SQLite", registry=r)
        self.store_flush_seconds = Histogram(
            "denpex_store_flush_duration_seconds", "Time of one SQLite write transaction",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.reloads = Counter("denpex_reloads_total", "SIGHUP reloads", ["result"], registry=r)
        self.job_errors = Counter(
            "denpex_job_errors_total",
            "Errors raised inside one job's processing (the job is marked broken, the daemon goes on)",
            ["stage"],
            registry=r,
        )
        self.dead_letters = Counter(
            "denpex_ingest_dead_letters_total",
            "Messages whose processing raised: kept in the store's dead_letters table and acknowledged",
            ["stage"],
            registry=r,
        )
        self.store_full = Gauge(
            "denpex_store_full",
            "1 while the disk under the store is full (acknowledgements wait)",
            registry=r,
        )
        self.broker_client_failures = Counter(
            "denpex_broker_client_failures_total",
            "Client connections the embedded broker lost to an error of its own (the client reconnects)",
            registry=r,
        )
        self.broker_deliveries_failed = Counter(
            "denpex_broker_deliveries_failed_total",
            "Messages the embedded broker could not send to a client whose connection had just "
            "closed (agents send again what the daemon has not receipted)",
            registry=r,
        )
        self._kind = {k: self.events_ingested.labels(k) for k in KINDS}
        self._dup = {k: self.events_duplicate.labels(k) for k in KINDS}
        self._drop = {k: self.events_dropped.labels(k) for k in KINDS}

    def ingested(self, counts: dict[str, int]) -> None:
        for k, n in counts.items():
            if n:
                self._kind[k].inc(n)

    def duplicates(self, counts: dict[str, int]) -> None:
        for k, n in counts.items():
            if n:
                self._dup[k].inc(n)

    def dropped(self, counts: dict[str, int]) -> None:
        for k, n in counts.items():
            if n:
                self._drop[k].inc(n)

    def remove_job(self, job: str, labels: dict[str, Any]) -> None:
        """Forget every per-job series of a closed job (`labels` remembers the failed gauge's)."""
        failed = labels.get("failed")  # the gauge's whole labelset, job first
        if failed is not None:
            _remove(self.job_failed, *failed)
        for stage in STAGES:
            _remove(self.nan_stage, job, stage)
            _remove(self.nan_ranks, job, stage)
            _remove(self.nan_events, job, stage)
        _remove(self.nan_first_rank, job)
        _remove(self.job_stalled_seconds, job)
        for node, rank in labels.get("slow", ()):
            _remove(self.rank_slowness, job, node, rank)
        _remove(self.collateral_suppressed, job)
        for node in labels.get("nodes", ()):
            _remove(self.clock_offset, node)
            _remove(self.clock_uncertainty, node)


def _remove(metric: Gauge | Counter, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)
