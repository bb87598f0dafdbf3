"""`denpex-agent` command line: arguments, configuration precedence, signals, exit codes.

Nothing below this module calls sys.exit. Exit codes: 0 clean stop, 1 runtime failure (or a
stop that overran its bound), 2 configuration or usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry, start_http_server

from denpex_agent import __version__
from denpex_agent.config import _FIELD_TYPES, AgentConfig, load_config, parse_listen
from denpex_agent.errors import ConfigError, LayoutError, RuleError
from denpex_agent.redact import Redactor, configure_logging, redact_url
from denpex_agent.watchdog import stop_watchdog

log = logging.getLogger("denpex_agent")

# What a stop may take beyond `shutdown_timeout` (reader, unsent events and the last receipts
# share that): `Publisher.close`'s three bounded waits (the `offline` status, the connection task's
# disconnect, and that task's own disconnect once cancelled, CLOSE_TIMEOUT_S each), then the
# checkpoint write and the event loop's lag on a loaded machine. A stop that only waits out its
# bounds must finish before the watchdog ends it.
STOP_MARGIN_S = 5.0  # >= 3 x publisher.CLOSE_TIMEOUT_S + 2 s (test_watchdog.py holds it there)

_HELP = {
    "job": "job id (required): events go to denpex/v1/jobs/<job>/from/<agent>[/<node>]/events",
    "node": "node name (default: the host name)",
    "logs": "glob of rank log files; repeatable; '**' recurses (required)",
    "agent_id": "agent id on the wire (default: the node name)",
    "broker": "mqtt://[user:pass@]host:port or mqtts://… (default mqtt://127.0.0.1:1883)",
    "state_dir": "where checkpoints live (default ./denpex-agent-state)",
    "layout": "path template naming rank/local_rank, relative to the glob's folder, e.g. 'rank{rank}.log'",
    "rules": "rule library folder (default: the bundled library)",
    "metrics_listen": "HOST:PORT for a Prometheus endpoint with the agent's own metrics",
    "mqtt_version": "auto (5, falling back to 3.1.1), 5 or 3.1.1",
    "poll_interval": "seconds between looks at the followed files when they are idle; the main "
    "term of the write-to-broker latency (default: 0.15)",
    "batch_max_delay": "seconds the sender waits for more reads before publishing; 0 publishes "
    "each read's events at once (one read of every file is already one batch) (default: 0)",
    "progress_interval": "seconds between live 'tips' (the newest step line of a file that grew), "
    "which tell how far each rank got; the clock samples do not depend on it (default: 0.25)",
    "fold_timeout": "seconds a multi-line record (a traceback without its exception line yet, "
    "torchrun's summary) or an unfinished last line waits for its end before it is taken as it "
    "is (default: 5)",
    "username": "broker user name (default, when a password is set: the agent's principal, its "
    "agent id followed by /NODE when the two differ, which is what the brokers' ACLs expect)",
    "password": "broker password; prefer DENPEX_PASSWORD (a flag shows in ps). For denpexd's embedded "
    "broker, `denpexd credential --agent ID` prints it",
    "password_file": "a file holding the broker password, read again at every connection: on "
    "Kubernetes, the pod's projected service-account token, which the kubelet renews (denpexd's "
    "agent_token_keys; deploy/k8s/training-job-example.yaml)",
    "topic_style": "sender (default): every topic names this agent, so a broker can hold it to its "
    "own; job: one events topic per job, for daemon replicas behind a broker's shared "
    "subscription that hashes topics to replicas (EMQX hash_topic, deploy/broker/emqx.conf)",
    "receipt_timeout": "seconds to wait for the daemon's receipt of a batch (a daemon that says it "
    "sends them) before sending the batch again; read positions are checkpointed only once the "
    "daemon has confirmed storing what is before them (default: 10)",
    "follow_mode": "auto (default): learn of writes from inotify, polling every poll_interval "
    "only the files on network filesystems (NFS, CIFS/SMB, Lustre, GPFS, BeeGFS, FUSE...) where it "
    "is silent; poll: poll every followed file every poll_interval",
    "slow_scan_warning": "a scan of new bytes that runs longer than this many seconds is logged and "
    "counted (denpex_agent_slow_scans_total); heartbeats go on meanwhile (default: 2)",
}

_EPILOG = """\
Configuration precedence: flags > DENPEX_* environment variables > --config TOML file > defaults.
Every key has one name: batch_max_bytes in the file, DENPEX_BATCH_MAX_BYTES, --batch-max-bytes.
DENPEX_CONFIG, DENPEX_SERVER and DENPEX_API_TOKEN (denpexd query's) are tolerated; any other
DENPEX_* variable that is not a key is an error naming it.

example:
  denpex-agent --job job-4711 --node "$(hostname)" --logs '/var/log/train/rank*.log' \\
               --broker mqtt://denpexd.example:1883 --state-dir /var/lib/denpex-agent
"""


class _Parser(argparse.ArgumentParser):
    """argparse whose error messages never show a URL's password (``--brokr mqtt://u:pw@h``)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {redact_url(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="denpex-agent",
        description="Follow this node's rank logs, match failure signatures, ship events to denpexd over MQTT.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"denpex-agent {__version__}")
    p.add_argument(
        "--config", metavar="FILE", help="TOML configuration file (keys as below; or under [agent])"
    )
    p.add_argument("--check", action="store_true", help="validate configuration and rules, print them, exit")
    for key, typ in _FIELD_TYPES.items():
        flag = "--" + key.replace("_", "-")
        if typ is tuple:
            p.add_argument(flag, action="append", metavar="GLOB", help=_HELP.get(key))
        else:
            p.add_argument(flag, metavar=key.upper(), help=_HELP.get(key, f"(default: {_default(key)})"))
    return p


def _default(key: str) -> Any:
    field = AgentConfig.__dataclass_fields__[key]
    return field.default


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    redact = Redactor.for_invocation(args_list, os.environ)
    parser = build_parser()
    args = parser.parse_args(args_list)
    config_file = args.config or os.environ.get("DENPEX_CONFIG")
    redact = redact.with_config_file(config_file)
    try:
        return _main(args, config_file, redact)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the last line of defence: a clear message, exit 1, no secret
        print(redact(f"denpex-agent: internal error: {type(exc).__name__}: {exc}"), file=sys.stderr)
        print(redact(traceback.format_exc()), end="", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace, config_file: str | None, redact: Redactor) -> int:
    flags = {k: getattr(args, k) for k in _FIELD_TYPES}
    try:
        cfg = load_config(flags, config_file=config_file)
    except ConfigError as exc:
        print(redact(f"denpex-agent: configuration error: {exc}"), file=sys.stderr)
        return 2
    redact = redact.adding((cfg.password, cfg.broker))
    configure_logging(cfg.log_level.upper(), redact)
    try:
        from denpex_agent.agent import Agent

        registry = CollectorRegistry()
        agent = Agent(cfg, registry)
    except (RuleError, LayoutError) as exc:
        print(redact(f"denpex-agent: {exc}"), file=sys.stderr)
        return 2
    if args.check:
        accel = "hyperscan" if agent.matcher.accelerated else "python re (slow)"
        print(
            redact(
                f"denpex-agent: ok: job={cfg.job} node={cfg.node} agent={cfg.agent} "
                f"broker={cfg.broker_url.redacted()} logs={list(cfg.logs)} rules={len(agent.matcher.ruleset)} "
                f"({accel}) state_dir={cfg.state_dir}"
            )
        )
        return 0
    if cfg.metrics_listen:
        host, port = parse_listen(cfg.metrics_listen)
        try:
            start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            print(f"denpex-agent: cannot listen on {cfg.metrics_listen}: {exc.strerror}", file=sys.stderr)
            return 2
    try:
        asyncio.run(_run(agent))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        log.exception("agent failed error=%s", exc)
        return 1
    return 0


async def _run(agent: Any) -> None:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    signals = {"count": 0}

    def on_stop(signame: str) -> None:
        signals["count"] += 1
        if signals["count"] == 1:
            log.info("stopping; flushing what was read signal=%s", signame)
            agent.request_stop()
            stop_watchdog(agent.cfg.shutdown_timeout + STOP_MARGIN_S, log)
        else:
            log.warning("second signal; stopping now signal=%s", signame)
            if main_task is not None:
                main_task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig.name)
    loop.add_signal_handler(signal.SIGHUP, agent.reload_rules)
    log.info(
        "agent starting job=%s node=%s agent=%s broker=%s logs=%s",
        agent.cfg.job,
        agent.cfg.node,
        agent.cfg.agent,
        agent.cfg.broker_url.redacted(),
        ",".join(agent.cfg.logs),
    )
    await agent.run()
