"""Per-job series of a closed job disappear, whatever the job's verdict was."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from denpexd.metrics import Metrics


def test_closing_a_failed_job_removes_its_series() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    failed = ("job-1", "3", "node2", "numerical-instability")
    m.job_failed.labels(*failed).set(1)
    m.nan_stage.labels("job-1", "error").set(1)
    m.remove_job("job-1", {"failed": failed, "nodes": ["node2"]})
    assert registry.get_sample_value("denpex_job_failed", dict(zip(
        ("job", "initiator_rank", "initiator_node", "category"), failed, strict=True))) is None  # fmt: skip
    assert (
        registry.get_sample_value("denpex_nan_fingerprint_stage", {"job": "job-1", "stage": "error"}) is None
    )
