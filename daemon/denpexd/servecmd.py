"""`denpexd serve` and `denpexd validate`: turn arguments into a `ServeConfig` loader and run."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from denpex_agent.redact import Redactor
from denpexd.config import ServeConfig, load_config
from denpexd.errors import DenpexdError
from denpexd.serve import load, run_serve

FLAG_KEYS = (
    "mqtt_listen", "broker", "http_listen", "data_dir", "rules", "client_id", "shared_group", "job_idle_close_s",
    "max_open_jobs", "alertmanager", "api_token", "log_level", "event_loop",
)  # fmt: skip


def _loader(args: argparse.Namespace) -> Any:
    path = args.config or os.environ.get("DENPEX_CONFIG") or None
    flags = {k: getattr(args, k, None) for k in FLAG_KEYS}

    def loader() -> ServeConfig:
        return load_config(path, env=os.environ, flags=flags)

    return loader


def run(args: argparse.Namespace, redact: Redactor | None = None) -> int:
    """Exit codes: 0 ok, 2 invalid configuration, 1 a failure while serving. Messages go through
    ``redact`` (the broker password and the API token never appear)."""
    redact = redact if redact is not None else Redactor()
    loader = _loader(args)
    if args.command == "validate":
        try:
            loaded = load(loader)
        except DenpexdError as exc:
            print(redact(f"denpexd validate: {exc}"), file=sys.stderr)
            return 2
        cfg = loaded.cfg
        broker = cfg.redacted()["broker"] or f"embedded on {cfg.mqtt_listen}"
        print(redact(f"configuration ok: {len(loaded.rules)} rules, store {cfg.store_path}, broker {broker}"))
        return 0
    try:
        cfg = loader()
    except DenpexdError as exc:
        print(redact(f"denpexd serve: {exc}"), file=sys.stderr)
        return 2
    logging.getLogger().setLevel(cfg.log_level.upper())
    try:
        run_serve(loader, set_aside_damaged_store=bool(getattr(args, "set_aside_damaged_store", False)))
    except DenpexdError as exc:
        print(redact(f"denpexd serve: {exc}"), file=sys.stderr)
        return 1
    return 0
