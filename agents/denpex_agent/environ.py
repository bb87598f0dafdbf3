"""`DENPEX_*` environment variables: the one rule `denpex-agent` and `denpexd serve` apply.

``DENPEX_<KEY>`` sets the configuration key ``<key>`` of the program reading it. The variables in
`SHARED` are tolerated by every program that reads its configuration from the environment, so one
shell or unit file may hold them: ``DENPEX_CONFIG`` names the TOML file, ``DENPEX_SERVER`` and
``DENPEX_API_TOKEN`` are `denpexd query`'s (``DENPEX_API_TOKEN`` is also a key of `serve`). Any
other ``DENPEX_*`` variable is an error naming it: a typo never falls back to a default silently,
and an agent key given to the daemon (or the reverse) is caught.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

ENV_PREFIX = "DENPEX_"
SHARED = frozenset({"DENPEX_CONFIG", "DENPEX_SERVER", "DENPEX_API_TOKEN"})


def config_variables(
    env: Mapping[str, str], keys: Collection[str]
) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """``({key: (variable, value)}, [unknown variables, sorted])`` of the ``DENPEX_*`` in ``env``."""
    found: dict[str, tuple[str, str]] = {}
    unknown: list[str] = []
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in keys:
            found[key] = (name, value)
        elif name not in SHARED:
            unknown.append(name)
    return found, sorted(unknown)
