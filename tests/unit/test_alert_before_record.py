"""A new incident's alert goes out before its record in the store: a store that cannot write
(here SQLite refusing every write, `PRAGMA query_only`) fails the record, not the alert."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from denpexd.alerts import Alerter
from denpexd.errors import StoreError
from denpexd.metrics import Metrics
from denpexd.store import Store
from tests.unit.test_serve_stall import Sink

DOC = {
    "job": "j1",
    "verdict": "failed",
    "initiator": {"node": "n1", "rank": 3, "rule": "cuda-oom", "category": "out-of-memory"},
    "root_cause": {
        "rule": "cuda-oom",
        "title": "CUDA out of memory",
        "root_cause": "",
        "fix": "",
        "verify": "",
    },
}


@pytest.mark.asyncio
async def test_a_store_that_cannot_write_does_not_hold_the_alert_back(tmp_path: Path) -> None:
    metrics = Metrics(CollectorRegistry())
    sink = Sink()
    async with Store(tmp_path / "denpex.sqlite") as store:
        await store._run(lambda: store.db.execute("PRAGMA query_only=1"))
        alerter = Alerter(store, metrics, [sink], generator="http://t")
        runner = asyncio.create_task(alerter.run())
        try:
            with pytest.raises(StoreError):
                await alerter.on_diagnosis("j1", DOC)
            await asyncio.wait_for(alerter.drain(), 5)
        finally:
            runner.cancel()
        assert [a["labels"]["rank"] for a in sink.alerts] == ["3"]
        assert "j1" in alerter.active  # one incident: a later diagnosis does not fire it again
        await alerter.on_diagnosis("j1", DOC)
        assert len(sink.alerts) == 1
        await store._run(lambda: store.db.execute("PRAGMA query_only=0"))
