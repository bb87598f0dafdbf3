"""`denpex-agent` command line.

This version validates the rule library (`--check`); tailing and shipping to the correlator
arrive with the live agent. Nothing below this module calls sys.exit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from denpex_agent import __version__
from denpex_agent.errors import RuleError
from denpex_agent.matcher import Matcher
from denpex_agent.rules import load_rules


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="denpex-agent",
        description="Per-node Denpex agent. This version only validates its configuration (--check); "
        "for post-mortem diagnosis use `denpexd diagnose LOGDIR`.",
    )
    p.add_argument("--version", action="version", version=f"denpex-agent {__version__}")
    p.add_argument("--check", action="store_true", help="load and compile the rules, then exit")
    p.add_argument("--rules", metavar="DIR", help="rule library folder (default: the bundled library)")
    args = p.parse_args(argv)
    if not args.check:
        print("denpex-agent: live tailing is not available in this version; use --check", file=sys.stderr)
        return 2
    try:
        rules = load_rules(args.rules)
        matcher = Matcher(rules)
    except RuleError as exc:
        print(f"denpex-agent: invalid rules: {exc}", file=sys.stderr)
        return 1
    accel = "hyperscan" if matcher.accelerated else "python re (slow)"
    print(f"denpex-agent: ok: {len(rules)} rules compiled ({accel})")
    return 0
