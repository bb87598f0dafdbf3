"""The agent's self-metrics, all in one place, registered on an injected registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = Counter("denpex_agent_lines_read_total", "Log lines read", registry=registry)
        self.bytes = Counter("denpex_agent_bytes_read_total", "Log bytes read", registry=registry)
        self.events = Counter("denpex_agent_events_total", "Events produced", ["kind"], registry=registry)
        self.batches = Counter(
            "denpex_agent_batches_published_total", "Batches acknowledged by the broker", registry=registry
        )
        self.publish_latency = Histogram(
            "denpex_agent_publish_latency_seconds",
            "Time from a batch's first event being read to the broker's PUBACK",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
            registry=registry,
        )
        self.checkpoint_lag = Gauge(
            "denpex_agent_checkpoint_lag_bytes",
            "Bytes read but not yet acknowledged and checkpointed",
            registry=registry,
        )
        self.read_lag = Gauge(
            "denpex_agent_read_lag_bytes",
            "Bytes written to followed files but not read yet",
            registry=registry,
        )
        self.truncated = Counter(
            "denpex_agent_lines_truncated_total", "Lines longer than max_line_bytes", registry=registry
        )
        self.warnings = Counter(
            "denpex_agent_warnings_total", "File problems, by reason", ["reason"], registry=registry
        )
        self.files = Gauge("denpex_agent_files_followed", "Files being followed", registry=registry)
        self.slow_scans = Counter(
            "denpex_agent_slow_scans_total",
            "Scans of new bytes that ran longer than slow_scan_warning",
            registry=registry,
        )
        self.connected = Gauge(
            "denpex_agent_broker_connected", "1 while connected to the broker", registry=registry
        )
        self.unconfirmed = Gauge(
            "denpex_agent_unconfirmed_batches",
            "Batches the broker acknowledged and the daemon has not confirmed storing yet",
            registry=registry,
        )
        self.resent = Counter(
            "denpex_agent_batches_resent_total",
            "Batches sent again because no receipt came within receipt_timeout",
            registry=registry,
        )
        self.refused = Counter(
            "denpex_agent_batches_refused_total",
            "Batches the daemon refused for good (its receipt said why; logged)",
            registry=registry,
        )
        self.clock_offset = Gauge(
            "denpex_agent_clock_offset_seconds",
            "Daemon clock minus agent clock (best recent sample)",
            registry=registry,
        )
