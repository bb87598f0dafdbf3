"""`denpexd` command line: parses arguments, maps errors to exit codes. Nothing below calls sys.exit."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from denpex_agent.redact import Redactor, configure_logging
from denpexd import __version__
from denpexd.nodehistory import DEFAULT_JOBS as HISTORY_JOBS

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_SIGPIPE = 128 + signal.SIGPIPE  # what a shell reports for `cat big | head`

_DESCRIPTION = """\
Denpex names the rank that broke a distributed training job first, why, what to do,
and which of the other errors are only collateral.

  denpexd diagnose LOGDIR              post-mortem diagnosis of a directory of rank logs
  denpexd diagnose LOGDIR --format json
  denpexd diagnose LOGDIR --format markdown --html report.html
                                       an issue's Markdown, and a self-contained HTML picture
  denpexd rules test                   self-test the signature library
  denpexd serve                        live correlator: embedded MQTT broker, HTTP API, /metrics
  denpexd query --job ID               the live diagnosis of a job from a running `serve`
  denpexd query --nodes                nodes that keep starting hardware/communication failures
  denpexd verify NEWDIR --against-dir OLDDIR
                                       is OLDDIR's failure gone from the run repeated in NEWDIR?
  denpexd validate --config FILE       check a serve configuration and its rules
  denpexd credential --agent ID        an agent's password for the embedded broker

environment: `serve` and `validate` take DENPEX_<KEY> for each configuration key (DENPEX_BROKER,
DENPEX_HTTP_LISTEN, ...) and DENPEX_CONFIG; DENPEX_SERVER is tolerated (it is `query`'s), any other
DENPEX_* variable is an error (exit 2). `query` and `verify` read DENPEX_SERVER and
DENPEX_API_TOKEN only.
"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() owns the exit code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{self.prog}: error: {message}")


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="denpexd", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=f"denpexd {__version__}")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log reader warnings and progress at DEBUG level"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    d = sub.add_parser(
        "diagnose",
        help="diagnose a finished (or dead) job from its log files",
        description=(
            "Read every log file under PATH (recursively: *.log *.txt *.out *.err, stdout/stderr files, "
            "rotated .1 .2 files), attribute node and rank, match the rule library, align node clocks "
            "from step lines, and name the initiating rank, the root cause, the fix and the collateral."
        ),
    )
    d.add_argument("paths", nargs="+", metavar="PATH", help="log directories or files of one job")
    d.add_argument("--job", help="job id to report (default: the name of the first PATH)")
    d.add_argument(
        "--format",
        choices=("text", "json", "markdown"),
        default="text",
        help="output format: text (default), json (docs/diagnosis-json.md) or markdown (GitHub-flavoured, "
        "to paste into an issue: summary table, chain, root cause, collateral, clocks, evidence folded)",
    )
    d.add_argument(
        "--html",
        metavar="FILE",
        help="also write the picture of the failure to FILE: one self-contained HTML page (no network) "
        "with a swimlane per rank on the aligned time axis, the root cause, fix, verify and evidence",
    )
    d.add_argument(
        "--rules", metavar="DIR", help="rule library folder or file (default: the bundled library)"
    )
    d.add_argument(
        "--layout",
        metavar="TEMPLATE",
        help="path template relative to PATH naming node and rank, e.g. '{node}/rank{rank}.log' "
        "(fields: {node} {rank} {local_rank} {any}); default: built-in layouts",
    )
    d.add_argument(
        "--context-lines",
        type=int,
        default=100,
        metavar="N",
        help="lines kept before the first failure (default 100)",
    )
    d.add_argument(
        "--progress", choices=("auto", "always", "never"), default="auto", help="progress bar on stderr"
    )
    d.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="read the files in N worker processes (default: every CPU this process may use; 1: in this "
        "process only). Large files are one task each, small ones batched into tasks of about 16 MiB; "
        "the diagnosis is the same for every N",
    )
    d.add_argument(
        "--control",
        action="append",
        metavar="HEALTHY_PATH",
        help="a healthy run of the same job (a directory or file; repeat for several): every line of "
        "both runs is reduced to a template (numbers, ids, paths, times, hosts masked; rank prefixes "
        "and leading timestamps removed), and for each rank the first line whose template the healthy "
        "run never logged is reported, the earliest in aligned time first ('divergence' in the JSON, "
        "FIRST DIVERGENCE FROM THE HEALTHY RUN in the report). Ranks, nodes and world size may differ",
    )

    s = sub.add_parser(
        "serve",
        help="run the live correlator (MQTT ingest, engine per job, store, HTTP API, alerts)",
        description="Run the live correlator. Settings come from flags > DENPEX_* environment > "
        "--config TOML file > defaults. DENPEX_<KEY> sets a key (DENPEX_BROKER, DENPEX_MAX_OPEN_JOBS, ...); "
        "DENPEX_CONFIG names the file; DENPEX_SERVER (query's) is tolerated; any other DENPEX_* variable "
        "is an error naming it.",
    )
    s.add_argument("--config", metavar="FILE", help="TOML configuration file (env DENPEX_CONFIG)")
    s.add_argument(
        "--mqtt-listen", metavar="HOST:PORT", help="embedded broker address (default 127.0.0.1:1883)"
    )
    s.add_argument(
        "--broker", metavar="URL", help="external broker mqtt[s]://user:pass@host:port (no embedded one)"
    )
    s.add_argument("--http-listen", metavar="HOST:PORT", help="HTTP API address (default 127.0.0.1:8080)")
    s.add_argument("--data-dir", metavar="DIR", help="store folder (default ./denpex-data)")
    s.add_argument(
        "--rules", metavar="DIR", help="rule library folder or file (default: the bundled library)"
    )
    s.add_argument(
        "--client-id", metavar="ID", help="MQTT client id of the persistent session (default denpexd)"
    )
    s.add_argument(
        "--shared-group",
        metavar="NAME",
        help="run as one of several replicas: subscribe as $share/NAME/... on an external broker "
        "(EMQX's hash_topic strategy keeps each job on one replica)",
    )
    s.add_argument("--job-idle-close", metavar="SECONDS", type=float, dest="job_idle_close_s",
                   help="close a job after this long without events (default 900)")  # fmt: skip
    s.add_argument("--max-open-jobs", metavar="N", type=int, help="open jobs kept in memory (default 10000)")
    s.add_argument("--alertmanager", metavar="URL", help="Alertmanager base URL (v2 API)")
    s.add_argument(
        "--api-token", metavar="TOKEN", help="bearer token required by the API (env DENPEX_API_TOKEN)"
    )
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="default info")
    s.add_argument(
        "--event-loop",
        choices=("auto", "uvloop", "asyncio"),
        help="uvloop when installed (auto, the default), uvloop or the standard asyncio loop",
    )
    s.add_argument(
        "--set-aside-damaged-store",
        action="store_true",
        help="when the store file is empty, truncated or damaged, move it aside (renamed "
        "*.damaged-<time>, kept for inspection) and start with an empty one; without this flag "
        "such a store stops serve with a message naming the file",
    )

    q = sub.add_parser(
        "query",
        help="ask a running `denpexd serve` about a job, the recent jobs or the nodes",
        description="Ask a running `denpexd serve` over its HTTP API: one job's diagnosis (--job), the "
        "recent jobs (--jobs), or the nodes that initiated the recent hardware and communication "
        "failures (--nodes, over the last --last jobs).",
    )
    q.add_argument("--job", metavar="ID", help="print this job's diagnosis (the report `diagnose` prints)")
    q.add_argument("--jobs", action="store_true", help="list recent jobs, their verdicts and initiators")
    q.add_argument(
        "--nodes",
        action="store_true",
        help="rank the nodes by how many of the recent hardware/communication failures they initiated "
        "(a node that keeps starting them is suspect), with the rules of each",
    )
    q.add_argument(
        "--last",
        metavar="N",
        type=int,
        default=HISTORY_JOBS,
        help=f"with --nodes: count the failures of the last N jobs (default {HISTORY_JOBS})",
    )
    q.add_argument(
        "--json", action="store_true", help="print JSON (for --job the diagnosis, docs/diagnosis-json.md)"
    )
    q.add_argument(
        "--format",
        choices=("text", "json", "markdown"),
        default=None,
        help="output format: text (default), json (as --json) or, with --job, markdown (GitHub-flavoured)",
    )
    q.add_argument(
        "--server",
        metavar="URL",
        help="daemon URL or HOST:PORT (http:// assumed; default http://127.0.0.1:8080, env DENPEX_SERVER)",
    )
    q.add_argument(
        "--control",
        metavar="HEALTHY_JOB",
        help="with --job: add the job's first divergence from this healthy job, as `diagnose --control` "
        "does, compared over the lines the daemon stored for both (their events and the context lines "
        "before them, not every line of their logs)",
    )
    q.add_argument("--api-token", metavar="TOKEN", help="bearer token (env DENPEX_API_TOKEN)")
    q.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=10.0,
        help="give up when the daemon has not answered in this long (default 10)",
    )

    _add_verify(sub.add_parser)

    v = sub.add_parser(
        "validate",
        help="check a serve configuration and its rules (exit 0 or 2)",
        description="Check a serve configuration (flags, DENPEX_* environment, TOML file, as `serve` "
        "reads them) and its rules; exit 0 or 2.",
    )
    v.add_argument("--config", metavar="FILE", help="TOML configuration file")

    c = sub.add_parser(
        "credential",
        help="print the embedded broker's user name and password for an agent or a reader",
        description="The embedded broker (serve without --broker) authenticates every client with a "
        "password derived from the daemon's agent_secret (DENPEX_AGENT_SECRET or the --config "
        "file) and the client's name: an agent's password is good for that agent on that node only, "
        "and lets it publish its own events, clock requests and status and nothing else; a reader's "
        "lets it read everything under denpex/v1 and publish nothing. Prints lines for the agent's "
        "environment file (DENPEX_USERNAME=..., DENPEX_PASSWORD=...).",
    )
    c.add_argument("--config", metavar="FILE", help="serve's TOML configuration file (env DENPEX_CONFIG)")
    who = c.add_mutually_exclusive_group(required=True)
    who.add_argument("--agent", metavar="ID", help="the agent id (DENPEX_AGENT_ID; by default its node name)")
    who.add_argument("--reader", metavar="NAME", help="a read-only subscriber (dashboards, chat bots)")
    c.add_argument("--node", metavar="NODE", help="the agent's node, when it differs from the agent id")

    r = sub.add_parser("rules", help="inspect or self-test the signature library")
    rsub = r.add_subparsers(dest="rules_command", metavar="ACTION", parser_class=_Parser)
    for name, text in (("test", "run every example and counterexample"), ("list", "list the rules")):
        rp = rsub.add_parser(name, help=text, description=text)
        rp.add_argument(
            "--rules", metavar="DIR", help="rule library folder or file (default: the bundled library)"
        )
    return p


_VERIFY_DESCRIPTION = """\
Repeat the failed run's input after a targeted change, then ask whether the failure is gone.
OLD (the run that failed) and NEW (the run repeated) are each diagnosed: from log files read as
`diagnose` reads them, or from a job stored by a running `denpexd serve`. NEW is verified when

  signature  OLD's decisive rule (its initiator's, or the job-wide root cause) appears nowhere in
             NEW: no line of it at any severity, no candidate or collateral naming it;
  category   NEW's own failure, if it failed, is not of that rule's category (the same failure
             under another rule); other rules of the category elsewhere in NEW are listed only;
  progress   NEW's furthest step exceeds OLD's failure step (the furthest step any OLD rank
             logged); when OLD logged no step line this is not checkable and said so.

A NEW that failed differently past OLD's failure step is verified; the output names its failure.

exit codes: 0 verified, 1 not verified, 2 nothing to verify (OLD is healthy) or nothing to
compare (a missing path or job, no log files, an unreachable daemon, bad arguments).

  denpexd verify runs/job-4712 --against-dir runs/job-4711
  denpexd verify --job job-4712 --against job-4711 --format json
"""


def _add_verify(add_parser: Callable[..., _Parser]) -> None:
    w = add_parser(
        "verify",
        help="is a failure's signature gone from the run repeated after a change? (exit 0/1/2)",
        description=_VERIFY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w.add_argument("paths", nargs="*", metavar="NEW_PATH", help="log directories or files of the NEW run")
    w.add_argument("--against-dir", action="append", metavar="OLD_PATH",
                   help="log directory or file of the OLD (failed) run; repeat for several")  # fmt: skip
    w.add_argument("--job", metavar="NEW", help="the NEW run as a job stored by `denpexd serve`")
    w.add_argument("--against", metavar="OLD", help="the OLD run as a job stored by `denpexd serve`")
    w.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    w.add_argument("--rules", metavar="DIR", help="rule library for log files (default: the bundled library)")
    w.add_argument(
        "--layout", metavar="TEMPLATE", help="path template for log files of both runs, as for diagnose"
    )
    w.add_argument(
        "--server",
        metavar="URL",
        help="daemon for --job/--against (default http://127.0.0.1:8080, env DENPEX_SERVER)",
    )
    w.add_argument("--api-token", metavar="TOKEN", help="bearer token (env DENPEX_API_TOKEN)")
    w.add_argument(
        "--timeout", metavar="SECONDS", type=float, default=10.0, help="daemon answer timeout (default 10)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    redact = Redactor.for_invocation(argv, os.environ)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(redact(str(exc)), file=sys.stderr)
        return EXIT_USAGE
    redact = redact.with_config_file(getattr(args, "config", None) or os.environ.get("DENPEX_CONFIG"))
    configure_logging(logging.DEBUG if args.verbose else logging.WARNING, redact)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        code = _dispatch(args, redact)
        sys.stdout.flush()  # a reader that went away is noticed here, not at interpreter exit
        return code
    except BrokenPipeError:
        # `denpexd rules list | head`: the reader has all it wanted. End quietly, as other CLIs do
        # on SIGPIPE; what is still buffered goes nowhere instead of failing again at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_SIGPIPE
    except KeyboardInterrupt:
        print("denpexd: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the last line of defence: a clear message, exit 1
        logging.getLogger("denpexd").debug("internal failure", exc_info=True)
        print(redact(f"denpexd: internal error: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return EXIT_FAILURE


def _dispatch(args: argparse.Namespace, redact: Redactor) -> int:
    if args.command == "rules":
        from denpexd import rulescmd

        if args.rules_command == "test":
            return rulescmd.run_test(args.rules)
        if args.rules_command == "list":
            return rulescmd.run_list(args.rules)
        print("denpexd rules: choose an action: test or list", file=sys.stderr)
        return EXIT_USAGE
    if args.command in ("serve", "validate"):
        from denpexd import servecmd

        return servecmd.run(args, redact)
    if args.command == "query":
        from denpexd import querycmd

        return querycmd.run(args, redact)
    if args.command == "verify":
        from denpexd import verifycmd

        return verifycmd.run(args, redact)
    if args.command == "diagnose":
        from denpexd import diagnosecmd

        return diagnosecmd.run(args)
    if args.command == "credential":
        return _credential(args)
    return EXIT_USAGE


def _credential(args: argparse.Namespace) -> int:
    from denpex_agent import wire
    from denpexd import brokeraccess
    from denpexd.config import load_config
    from denpexd.errors import DenpexdError

    try:
        cfg = load_config(args.config or os.environ.get("DENPEX_CONFIG") or None, env=os.environ, flags={})
    except DenpexdError as exc:
        print(f"denpexd credential: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if cfg.agent_secret is None:
        print(
            "denpexd credential: no agent_secret configured (set DENPEX_AGENT_SECRET, or agent_secret "
            "in the file given with --config, as for serve)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        if args.reader is not None:
            if args.node is not None:
                raise wire.WireError("--node is for agents")
            name = wire.check_id("reader", args.reader)
            role = brokeraccess.READER
        else:
            name = wire.principal(args.agent, args.node if args.node is not None else args.agent)
            role = brokeraccess.AGENT
    except wire.WireError as exc:
        print(f"denpexd credential: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"DENPEX_USERNAME={name}")
    print(f"DENPEX_PASSWORD={brokeraccess.credential(cfg.agent_secret, role, name)}")
    return EXIT_OK
