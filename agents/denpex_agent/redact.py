"""Secrets out of the programs' own output: log lines, error messages, tracebacks.

`masking.py` cleans the *training logs* the reader ships; this module keeps what `denpex-agent`
and `denpexd` themselves print free of the broker password and the API token, wherever they came
from: a flag (``--password``, ``--api-token``, a URL's ``user:password@``), a ``DENPEX_*``
variable, or the TOML file. The CLIs build one `Redactor` from their invocation before they parse
anything, so even a usage error or a traceback of an unexpected failure goes through it.

Every occurrence of a known secret of at least `MIN_SECRET_CHARS` characters is replaced (as
typed, percent-decoded, and as ``repr`` would escape it), and the password part of any
``scheme://user:password@`` in the text is masked whatever its length.
"""

from __future__ import annotations

import logging
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit

MASK = "***"
MIN_SECRET_CHARS = 4  # shorter ones would blank out ordinary words; URL passwords are masked anyway

SECRET_FLAGS = ("--password", "--api-token")
SECRET_ENV = ("DENPEX_PASSWORD", "DENPEX_API_TOKEN", "DENPEX_AGENT_SECRET", "DENPEX_AGENT_PASSWORD")
SECRET_KEYS = frozenset({"password", "api_token", "agent_secret", "agent_password"})

_URL_PASSWORD = re.compile(r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)[^@\s/]+(?=@)")


def url_password(url: str) -> str | None:
    """The password in ``scheme://user:password@host``, as written (not decoded), or None."""
    try:
        return urlsplit(url).password if "://" in url else None
    except ValueError:
        return None


def redact_url(url: str) -> str:
    """``mqtt://user:***@host:port``: the URL with its password masked."""
    return _URL_PASSWORD.sub(rf"\g<pre>{MASK}", url)


def _variants(secret: str) -> Iterator[str]:
    for s in {secret, unquote(secret)}:
        yield s
        yield repr(s)[1:-1]  # as it appears inside a quoted repr in an error message


@dataclass(frozen=True, slots=True)
class Redactor:
    """``redact(text)``: the text with every known secret and every URL password masked."""

    secrets: tuple[str, ...] = ()

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        if "://" in text:
            text = _URL_PASSWORD.sub(rf"\g<pre>{MASK}", text)
        return text

    def adding(self, values: Iterable[str | None]) -> Redactor:
        """A redactor that also masks these values (passwords, tokens, or URLs holding one)."""
        found = set(self.secrets)
        for value in values:
            if not value:
                continue
            secret = url_password(value) if "://" in value else value
            if secret:
                found.update(v for v in _variants(secret) if len(v) >= MIN_SECRET_CHARS)
        return Redactor(tuple(sorted(found, key=len, reverse=True)))  # longest first

    @classmethod
    def for_invocation(cls, argv: Sequence[str], env: Mapping[str, str]) -> Redactor:
        """Secrets the command line and the environment hold: the values of `SECRET_FLAGS`,
        URL passwords in any argument, `SECRET_ENV` and URL passwords in any ``DENPEX_*``."""
        values: list[str] = []
        for i, arg in enumerate(argv):
            flag, eq, inline = arg.partition("=")
            if flag in SECRET_FLAGS:
                values.append(inline if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
            elif "://" in arg:
                values.append(arg.partition("=")[2] if arg.startswith("--") else arg)
        for name, value in env.items():
            if name in SECRET_ENV or (name.startswith("DENPEX_") and "://" in value):
                values.append(value)
        return cls().adding(values)

    def with_config_file(self, path: str | None) -> Redactor:
        """Also the secrets of a TOML configuration file: `SECRET_KEYS` values and URL passwords
        at any depth. A file that cannot be read adds nothing (loading it reports the problem)."""
        if not path:
            return self
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError, ValueError):
            return self
        return self.adding(_toml_secrets(doc))


def _toml_secrets(node: Any, key: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _toml_secrets(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _toml_secrets(v, key)
    elif key in SECRET_KEYS and not isinstance(node, (dict, list)):
        yield str(node)
    elif isinstance(node, str) and "://" in node:
        yield node


class RedactingFormatter(logging.Formatter):
    """A formatter whose whole output (message, arguments, traceback) passes through a `Redactor`."""

    def __init__(self, fmt: str, redact: Redactor) -> None:
        super().__init__(fmt)
        self.redact = redact

    def format(self, record: logging.LogRecord) -> str:
        return self.redact(super().format(record))


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int | str, redact: Redactor, stream: TextIO | None = None) -> None:
    """The root logger writes "time LEVEL logger: text key=value" lines through `redact`."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(RedactingFormatter(LOG_FORMAT, redact))
    logging.basicConfig(level=level, handlers=[handler], force=True)
