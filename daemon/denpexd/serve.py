"""`denpexd serve`: the live correlator's lifecycle.

Start in order — store, broker (embedded unless `--broker`), alert sinks, jobs restored from the
store, ingest, HTTP API — and stop in reverse. SIGTERM/SIGINT stop ingest, drain what was
received (processed, stored, acknowledged, final diagnoses published) within
`shutdown_timeout_s`; a second signal cancels at once, and a stop that is still held up
`STOP_MARGIN_S` after that (closing the store and the broker) ends the process with exit 1 and
every thread's stack on stderr. SIGHUP reloads configuration and rules through `load()`, the
same path as startup; a bad reload keeps the running ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from denpex_agent.errors import RuleError
from denpex_agent.rules import RuleSet, load_rules
from denpex_agent.watchdog import stop_watchdog
from denpexd.alerts import Alerter, AlertmanagerSink, AlertSink, MqttSink
from denpexd.api import Api
from denpexd.broker import EmbeddedBroker
from denpexd.brokeraccess import Intake
from denpexd.config import ServeConfig, pod_tokens
from denpexd.errors import ConfigError, DenpexdError
from denpexd.ingest import Ingest
from denpexd.jobs import JobTable
from denpexd.metrics import Metrics
from denpexd.store import Store

log = logging.getLogger(__name__)

# beyond shutdown_timeout_s (the drain), for closing the store, the broker and the API
STOP_MARGIN_S = 5.0

RETENTION_EVERY_S = 3600.0
GC_THRESHOLD = 20_000  # allocations between young-generation collections (default 700)


@dataclass(frozen=True, slots=True)
class Loaded:
    cfg: ServeConfig
    rules: RuleSet


Loader = Callable[[], ServeConfig]


def load(loader: Loader) -> Loaded:
    """Configuration and rules, as at startup and on every SIGHUP."""
    cfg = loader()
    try:
        rules = load_rules(cfg.rules) if cfg.rules else load_rules()
    except RuleError as exc:
        raise ConfigError("rules", str(exc)) from exc
    return Loaded(cfg, rules)


class App:
    def __init__(
        self,
        loader: Loader,
        *,
        registry: CollectorRegistry | None = None,
        set_aside_damaged_store: bool = False,
    ) -> None:
        self.loader = loader
        self.set_aside_damaged_store = set_aside_damaged_store
        self.loaded = load(loader)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self._stop = asyncio.Event()
        self._signals = 0
        self.table: JobTable | None = None
        self._main: asyncio.Task[None] | None = None
        self.http_port = 0
        self.on_stop: Callable[[], None] | None = None  # run at the first stop signal (a watchdog)

    def request_stop(self, signame: str = "stop") -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("stopping: draining in-flight batches signal=%s", signame)
            self._stop.set()
            if self.on_stop is not None:
                self.on_stop()
        else:
            log.warning("second signal: stopping now signal=%s", signame)
            if self._main is not None:
                self._main.cancel()

    def reload(self) -> None:
        try:
            new = load(self.loader)
        except (DenpexdError, OSError) as exc:
            self.metrics.reloads.labels("error").inc()
            log.error("reload failed; keeping the running configuration and rules error=%s", exc)
            return
        old = self.loaded.cfg
        for key in ("mqtt_listen", "broker", "http_listen", "data_dir", "client_id"):
            if getattr(old, key) != getattr(new.cfg, key):
                log.warning("reload: %s changes only on restart key=%s", key, key)
        self.loaded = new
        if self.table is not None:
            self.table.rules = new.rules
            self.table.cfg = new.cfg
            for state in self.table.jobs.values():
                state.engine.rules = new.rules
            self.table.alerter.repeat_s = new.cfg.alert_repeat_s
            self.table.alerter.generator = _generator(new.cfg)
        self.metrics.reloads.labels("ok").inc()
        log.info("reloaded configuration and rules rules=%d", len(new.rules))

    async def run(self) -> None:
        self._main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
            loop.add_signal_handler(sig, self.request_stop, name)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            await self._run()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def _run(self) -> None:
        cfg = self.loaded.cfg
        log.info("starting denpexd serve config=%s", cfg.redacted())
        async with contextlib.AsyncExitStack() as stack:
            store = await stack.enter_async_context(
                Store(cfg.store_path, set_aside_damaged=self.set_aside_damaged_store)
            )
            embedded_password = None
            intake = None
            if cfg.broker is None:
                intake = Intake(on_refused=self.metrics.messages_shed.inc)
                embedded = await stack.enter_async_context(
                    EmbeddedBroker(
                        cfg.mqtt_listen,
                        on_client_failure=self.metrics.broker_client_failures.inc,
                        on_delivery_failure=self.metrics.broker_deliveries_failed.inc,
                        secret=cfg.agent_secret,
                        shared_password=cfg.agent_password,
                        intake=intake,
                        tokens=pod_tokens(cfg),
                    )
                )
                embedded_password = embedded.daemon_password
            sinks: list[AlertSink] = []
            if cfg.alertmanager:
                sinks.append(await stack.enter_async_context(AlertmanagerSink(cfg.alertmanager)))
            alerter = Alerter(
                store, self.metrics, sinks, generator=_generator(cfg), repeat_s=cfg.alert_repeat_s
            )
            table = self.table = JobTable(cfg, self.loaded.rules, store, self.metrics, alerter)
            alerter.gate = table.alert_wait
            await table.restore()
            ingest = await stack.enter_async_context(
                Ingest(cfg, table, self.metrics, embedded_password=embedded_password, intake=intake)
            )
            table.bus = ingest
            sinks.append(MqttSink(ingest))
            api = await stack.enter_async_context(
                Api(
                    cfg.http_listen,
                    table,
                    store,
                    self.registry,
                    token=cfg.api_token,
                    ready=lambda: ingest.ready,
                )
            )
            self.http_port = api.port
            log.info("denpexd serve ready http=%s mqtt=%s", cfg.http_listen, ingest.address)
            async with asyncio.TaskGroup() as tg:
                consumer = tg.create_task(ingest.run(), name="ingest")
                workers = [
                    tg.create_task(table.run_worker(), name="job-worker"),
                    tg.create_task(table.writer.run(), name="store-writer"),
                    tg.create_task(table.run_diagnoser(), name="diagnoser"),
                    tg.create_task(table.run_closer(), name="job-closer"),
                    tg.create_task(table.run_stall_watch(), name="stall-watch"),
                    tg.create_task(alerter.run(), name="alerter"),
                    tg.create_task(self._retention(store), name="retention"),
                ]
                await self._stop.wait()
                t0, stage = time.monotonic(), "ingest"
                try:
                    async with asyncio.timeout(self.loaded.cfg.shutdown_timeout_s):
                        await ingest.drain()  # stops reading; hands over what was received
                        stage = "jobs"
                        await table.drain()
                        stage = "alerts"
                        await alerter.drain()
                except TimeoutError:
                    log.warning(
                        "shutdown timeout: some batches were not drained (they stay unacknowledged) "
                        "stage=%s seconds=%.1f", stage, time.monotonic() - t0,
                    )  # fmt: skip
                else:
                    log.info("drained seconds=%.1f", time.monotonic() - t0)
                consumer.cancel()
                for task in workers:
                    task.cancel()
        log.info("denpexd serve stopped")

    async def _retention(self, store: Store) -> None:
        while True:
            cutoff = time.time() - self.loaded.cfg.retention_days * 86_400
            removed = await store.apply_retention(cutoff)
            if removed:
                log.info("retention removed closed jobs jobs=%d", removed)
            await asyncio.sleep(RETENTION_EVERY_S)


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The event loop `serve` runs on (`event_loop`): uvloop's when it is wanted and can be
    imported, else the standard one (None); and its name for the log."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError as exc:
            if choice == "uvloop":
                raise ConfigError("event_loop", f"uvloop cannot be imported: {exc}") from None
        else:
            return uvloop.new_event_loop, f"uvloop {importlib.metadata.version('uvloop')}"
    return None, "asyncio"


def run_serve(loader: Loader, *, set_aside_damaged_store: bool = False) -> None:
    """Load, then serve until stopped; raises `DenpexdError` subclasses for the CLI to report."""
    app = App(loader, set_aside_damaged_store=set_aside_damaged_store)
    factory, loop_name = loop_factory(app.loaded.cfg.event_loop)
    log.info("event loop loop=%s", loop_name)
    bound = app.loaded.cfg.shutdown_timeout_s + STOP_MARGIN_S

    def watch_the_stop() -> None:
        stop_watchdog(bound, log)

    app.on_stop = watch_the_stop
    # The daemon holds hundreds of thousands of long-lived objects (events kept by the engines,
    # diagnoses, queued batches); the collector's default of a young-generation pass every 700
    # allocations makes it re-examine them often. Start-up objects (modules, rules) are frozen.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 20, 20)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(app.run())
    except asyncio.CancelledError:
        log.warning("stopped by a second signal without draining")


def _generator(cfg: ServeConfig) -> str:
    """Where alerts point people (their generatorURL's base): `external_url`, else the HTTP API."""
    return (cfg.external_url or f"http://{cfg.http_listen}").rstrip("/")
