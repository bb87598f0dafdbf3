"""Failure-signature rules: the TOML file model, validation and the runtime `Rule`.

A rule file (``rules/<category>.toml``) looks like::

    schema = 1
    category = "communication"          # default for the rules below

    [[rule]]
    id = "gloo-connection-closed"
    title = "gloo: connection closed by peer"
    severity = "error"                  # info | warning | error | critical
    role = "collateral"                 # root-cause | symptom | collateral | progress | marker | notice
    patterns = ['Connection closed by peer \\[']
    root_cause = "..."
    fix = "..."
    verify = "..."
    references = ["https://..."]
    examples = [
      "RuntimeError: [../third_party/gloo/...] Connection closed by peer [127.0.0.1]:5678",
      { text = "... Connection closed by peer [10.0.0.3]:41234", source = "https://..." },
    ]
    counterexamples = ["Connection closed by peer: retrying (1/3)"]
    # scope = "job"                     # optional: the message is about the job's set-up
    # fold = "stalled-ranks"            # optional: read the record's following lines (FOLDS)
    # fallback = true                   # optional: a vocabulary, not a signature (see LEVEL_MARKER)
    # scan = ['...']                    # optional: a cheaper superset the multi-pattern scan uses
    #                                     (two ranks on one GPU), so no rank is its initiator

An example is a line the rule must match, as a string or a table ``{ text, fields, source }``:
``fields`` are the values its named groups must extract, ``source`` the http(s) address of the
public thread or page the line was copied from (lines written for the project, such as the
fixtures recorded from its own runs, have none).

Patterns are Python regular expressions applied to one line (without its newline), searched
anywhere in it; ``^``/``$`` are the line's ends; a pattern never sees more than its line, so
``\\s*$`` cannot reach past the newline. They run on the ``regex`` engine in its
``re``-compatible mode (VERSION0), each search bounded by `PATTERN_TIMEOUT_S` and without
holding the interpreter lock, so a pattern that backtracks badly on some line costs that line
a bounded time (`PatternTimeout`), never the reader its liveness.

A *notice* (``role = "notice"``, ``rules/notices.toml``) is a message that looks alarming and is
known not to be a failure (an NCCL WARN about a library it does not need, a warning that speaks of
a hang that cannot happen): info severity, no fold; ``root_cause`` says why it is harmless and
``fix`` how to be rid of it. The diagnosis lists notices (``notices``) and nothing else reads them.

A file may also hold ``[[diagnosis]]`` tables: conclusions the engine draws without a matching
line (a rank that stopped making progress, a worker killed by a signal, a straggler), each with
``id``, ``title``, ``category``, ``root_cause``, ``fix``, ``verify`` and optional ``references``,
so every diagnosis carries why, what to do and how to check it. Named groups extract fields; only the names in
`FIELD_NAMES` are allowed. Everything is checked when the file is loaded: unknown keys, bad
enum values, regexes that do not compile, unknown group names, dangling `related` ids.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from denpex_agent.diskcache import cache_dir, write_atomic
from denpex_agent.errors import PatternTimeout, RuleError

if TYPE_CHECKING:
    import regex

log = logging.getLogger(__name__)

SCHEMA = 1
SEVERITIES = ("info", "warning", "error", "critical")
# A notice is a known message that looks alarming and is not a failure (a harmless warning people
# ask about): listed as such, never part of a failure's story. Roles are only ever added (wire).
ROLES = ("root-cause", "symptom", "collateral", "progress", "marker", "notice")
# What a marker line announces: a pause in the step lines that is expected (an evaluation; a
# checkpoint being written, which is also a pause), the end of training, or the global rank a
# process took at start-up.
MARKERS = ("pause", "checkpoint", "end", "identity")
CATEGORIES = (
    "numerical-instability",
    "out-of-memory",
    "hardware",
    "communication",
    "hang",
    "process-killed",
    "user-code-exception",
    "dataloader",
    "checkpoint-io",
    "configuration",
)
PROGRESS_CATEGORY = "progress"
FOLDS = ("python-traceback", "elastic-failure", "stalled-ranks", "mpi-exit-notice")

# Named groups a pattern may use. Numbers are parsed by the reader (int or float).
INT_FIELDS = frozenset(
    {
        "rank",
        "local_rank",
        "culprit_rank",
        "step",
        "total",
        "exitcode",
        "signal",
        "pid",
        "worker_pid",  # a worker process its launcher lists, in local-rank order (analysis.workers)
        "task",  # srun's task number (SLURM_PROCID): a rank unless a per-node launcher runs under srun
        "seq",
        "announced_rank",
        "world_size",
        "timeout_ms",
    }
)
FLOAT_FIELDS = frozenset({"loss", "grad_norm", "scale", "data_time", "step_time"})
STR_FIELDS = frozenset({"node", "exception", "op"})
FIELD_NAMES = INT_FIELDS | FLOAT_FIELDS | STR_FIELDS

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{1,63}$")
PATTERN_TIMEOUT_S = 0.1  # one search of one line
_FILE_KEYS = frozenset({"schema", "category", "rule", "diagnosis"})
_DIAGNOSIS_KEYS = frozenset({"id", "title", "category", "root_cause", "fix", "verify", "references"})
_RULE_KEYS = frozenset(
    {
        "id",
        "title",
        "category",
        "severity",
        "role",
        "patterns",
        "ignore_case",
        "fingerprint",
        "fold",
        "root_cause",
        "fix",
        "verify",
        "related",
        "references",
        "examples",
        "counterexamples",
        "scope",
        "fallback",
        "scan",
        "marker",
    }
)
# Every pattern of a fallback (vocabulary) rule is this level marker, then the vocabulary within
# the rest of the line: an upper-case level word, "Warning:"/"Error:" (also a Python warning class
# such as "UserWarning:"). The matcher scans for the level words and the vocabulary later on the
# line, and verifies the whole pattern on those lines.
LEVEL_WORDS = r"(?:\b(?:WARN(?:ING)?|ERROR|CRITICAL|FATAL)\b|Warning:|\bError:)"
LEVEL_MARKER = LEVEL_WORDS + ".{0,300}?"
SCOPES = ("rank", "job")  # job: the message is about the job's set-up, not one rank's failure
_REQUIRED_TEXT = ("root_cause", "fix", "verify")


@dataclass(frozen=True, slots=True)
class Example:
    """A line a rule must match, optionally with the fields it must extract and the address of
    the public thread or page it was copied from (None: written for the project)."""

    text: str
    fields: Mapping[str, int | float | str] = field(default_factory=dict)
    source: str | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One validated failure signature."""

    id: str
    title: str
    category: str
    severity: str
    role: str
    patterns: tuple[str, ...]
    regexes: tuple[LazyPattern, ...]
    ignore_case: bool
    fingerprint: str | None
    fold: str | None
    root_cause: str
    fix: str
    verify: str
    related: tuple[str, ...]
    references: tuple[str, ...]
    examples: tuple[Example, ...]
    counterexamples: tuple[str, ...]
    source: str
    scope: str = "rank"
    # a vocabulary rule: it classifies a WARN/ERROR line no other rule matches (any other rule
    # that matches the line wins), and the engine takes its events as weak evidence
    fallback: bool = False
    # what the multi-pattern scan looks for instead of `patterns` (a cheaper superset: every
    # example matches one of them; `patterns` then verify the line); empty: the patterns
    scan: tuple[str, ...] = ()
    # a marker rule's announcement (`MARKERS`): its lines tell the stall watch what a pause means
    marker: str | None = None

    def search(self, line: str, release_gil: bool = True) -> dict[str, int | float | str] | None:
        """Match one line; return the extracted fields ({} when none) or None. Raises
        `PatternTimeout` when a pattern runs longer than PATTERN_TIMEOUT_S on it. The search
        releases the interpreter lock unless ``release_gil`` is false (a process with no other
        thread to run: giving the lock up and taking it back costs more than most searches)."""
        for rx in self.regexes:
            try:  # positional: (string, pos, endpos, concurrent, partial, timeout) parse fastest
                m = rx.search(line, 0, None, release_gil, False, PATTERN_TIMEOUT_S)
            except TimeoutError as exc:
                raise PatternTimeout(self.id, rx.pattern) from exc
            if m is not None:
                # by position: the `regex` engine builds a dict of the groups ten times slower
                return convert_fields(zip(rx.names(), m.groups(), strict=True))
        return None

    @property
    def severity_level(self) -> int:
        return SEVERITIES.index(self.severity)


MAX_INT_FIELD = 1 << 53
MAX_FLOAT_FIELD = 1e300
MAX_TEXT_FIELD = 1024


# Linux's signal numbers, for a `signal` group that captured a name (`terminated with signal SIGKILL`):
# the logs come from Linux nodes whatever the platform that reads them
SIGNAL_NUMBERS = {
    "SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGTRAP": 5, "SIGABRT": 6, "SIGBUS": 7, "SIGFPE": 8,
    "SIGKILL": 9, "SIGUSR1": 10, "SIGSEGV": 11, "SIGUSR2": 12, "SIGPIPE": 13, "SIGALRM": 14, "SIGTERM": 15,
    "SIGXCPU": 24, "SIGXFSZ": 25, "SIGSYS": 31,
}  # fmt: skip


def convert_fields(
    raw: Mapping[str, str | None] | Iterable[tuple[str | None, str | None]],
) -> dict[str, int | float | str]:
    """Turn regex group strings into typed fields; numbers that do not parse or are beyond any
    real value (the receiver's bounds) are left out, text is cut to its bound. A ``signal`` may
    be captured by its name (`SIGNAL_NUMBERS`). ``raw``: the named groups, or (name, value) pairs
    where an unnamed group's name is None."""
    out: dict[str, int | float | str] = {}
    for name, value in raw.items() if isinstance(raw, Mapping) else raw:
        if value is None or name is None:
            continue
        if name in INT_FIELDS:
            try:
                n = int(value)
            except ValueError:
                if name != "signal" or value not in SIGNAL_NUMBERS:
                    continue
                n = SIGNAL_NUMBERS[value]
            if -MAX_INT_FIELD <= n <= MAX_INT_FIELD:
                out[name] = n
        elif name in FLOAT_FIELDS:
            try:
                x = float(value)
            except ValueError:
                continue
            if not -MAX_FLOAT_FIELD <= x <= MAX_FLOAT_FIELD and x == x:  # NaN stays (a NaN loss is news)
                continue
            out[name] = x
        else:
            out[name] = value[:MAX_TEXT_FIELD]
    return out


@dataclass(frozen=True, slots=True)
class Explanation:
    """A conclusion without a pattern (``[[diagnosis]]``): what the engine infers, explained."""

    id: str
    title: str
    category: str
    root_cause: str
    fix: str
    verify: str
    references: tuple[str, ...]
    source: str


class RuleSet:
    """All rules of a library, in load order, with lookup by id, and its `Explanation`s."""

    __slots__ = ("_by_id", "_explained", "explanations", "files", "rules")

    def __init__(
        self, rules: tuple[Rule, ...], files: tuple[str, ...], explanations: tuple[Explanation, ...] = ()
    ) -> None:
        self.rules = rules
        self.files = files
        self.explanations = explanations
        self._by_id = {r.id: r for r in rules}
        self._explained = {e.id: e for e in explanations}

    def get(self, rule_id: str) -> Rule | None:
        return self._by_id.get(rule_id)

    def explanation(self, rule_id: str) -> Rule | Explanation | None:
        """The rule, or the inferred diagnosis, with this id."""
        return self._by_id.get(rule_id) or self._explained.get(rule_id)

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)


def default_rules_dir() -> Path:
    """The library shipped with the package (wheel), else the repository's rules/ folder."""
    here = Path(__file__).resolve().parent
    packaged = here / "_rules"
    if packaged.is_dir():
        return packaged
    return here.parent.parent / "rules"


def load_rules(path: str | Path | None = None) -> RuleSet:
    """Load and validate every ``*.toml`` under ``path`` (a folder or one file)."""
    root = Path(path) if path is not None else default_rules_dir()
    if root.is_dir():
        files = sorted(root.glob("*.toml"))
    elif root.is_file():
        files = [root]
    else:
        raise RuleError(str(root), None, "no such rules file or folder")
    if not files:
        raise RuleError(str(root), None, "no *.toml rule files found")
    rules: list[Rule] = []
    explanations: list[Explanation] = []
    for f in files:
        got, explained = _load_file(f)
        rules.extend(got)
        explanations.extend(explained)
    seen: dict[str, str] = {}
    for rid, source in [(r.id, r.source) for r in rules] + [(e.id, e.source) for e in explanations]:
        if rid in seen:
            raise RuleError(source, rid, f"duplicate rule id (first defined in {seen[rid]})")
        seen[rid] = source
    for r in rules:
        for rel in r.related:
            if rel not in seen:
                raise RuleError(r.source, r.id, f"related id {rel!r} is not a known rule")
    return RuleSet(rules=tuple(rules), files=tuple(str(f) for f in files), explanations=tuple(explanations))


def _load_file(path: Path) -> tuple[list[Rule], list[Explanation]]:
    src = str(path)
    try:
        raw_bytes = path.read_bytes()
        doc = _parse_toml(raw_bytes)
    except tomllib.TOMLDecodeError as exc:
        raise RuleError(src, None, f"invalid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise RuleError(src, None, f"cannot read: {reason}") from exc
    unknown = set(doc) - _FILE_KEYS
    if unknown:
        raise RuleError(src, None, f"unknown top-level key(s): {', '.join(sorted(unknown))}")
    if doc.get("schema") != SCHEMA:
        raise RuleError(src, None, f"'schema = {SCHEMA}' is required (found {doc.get('schema')!r})")
    default_category = doc.get("category")
    raw_rules = doc.get("rule", [])
    raw_diagnoses = doc.get("diagnosis", [])
    if not isinstance(raw_rules, list) or not isinstance(raw_diagnoses, list):
        raise RuleError(
            src, None, "'rule' and 'diagnosis' must be arrays of tables ([[rule]], [[diagnosis]])"
        )
    if not raw_rules and not raw_diagnoses:
        raise RuleError(src, None, "no [[rule]] tables")
    rules = [_build_rule(src, raw, default_category) for raw in raw_rules]
    return rules, [_build_explanation(src, raw, default_category) for raw in raw_diagnoses]


def _parse_toml(data: bytes) -> Any:
    """The TOML document in ``data``. Parsing is most of the cost of loading the library (the
    parser is pure Python; every `diagnose` pays it before it reads a byte), so the parsed
    document is cached on disk as JSON, keyed by the file's bytes; a document JSON cannot
    carry exactly (a date) is not cached, and a missing or damaged cache only costs the parse.
    Validation runs on the result either way."""
    key = hashlib.sha256(b"toml-json-1\0" + data).hexdigest()
    path = cache_dir() / f"rules-{key}.json"
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        pass
    doc = tomllib.loads(data.decode("utf-8"))
    try:
        blob = orjson.dumps(doc)
        if orjson.loads(blob) == doc and _same_types(orjson.loads(blob), doc):
            write_atomic(path, blob)
    except (OSError, TypeError, orjson.JSONEncodeError) as exc:
        log.debug("rules cache not written error=%s", exc)
    return doc


def _same_types(a: Any, b: Any) -> bool:
    """Whether two equal documents also agree on every value's type (1 == 1.0 == True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return all(_same_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return all(_same_types(x, y) for x, y in zip(a, b, strict=True))
    return True


def _build_explanation(src: str, raw: Any, default_category: Any) -> Explanation:
    if not isinstance(raw, dict):
        raise RuleError(src, None, "a [[diagnosis]] entry must be a table")
    rid = _checked_id(src, raw, _DIAGNOSIS_KEYS)
    texts: dict[str, str] = {}
    for key in ("title", "root_cause", "fix", "verify"):
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            raise RuleError(src, rid, f"{key!r} must be a non-empty string")
        texts[key] = value.strip()
    category = raw.get("category", default_category)
    if category not in CATEGORIES:
        raise RuleError(src, rid, f"category {category!r} is not one of {', '.join(CATEGORIES)}")
    refs = raw.get("references", [])
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise RuleError(src, rid, "'references' must be a list of strings")
    return Explanation(id=rid, category=str(category), references=tuple(refs), source=src, **texts)


def _checked_id(src: str, raw: Mapping[str, Any], allowed: frozenset[str]) -> str:
    """The table's id, once it and the table's keys are valid."""
    rid = raw.get("id")
    if not isinstance(rid, str) or not _ID_RE.match(rid):
        raise RuleError(src, str(rid), "id must be 2-64 chars of [a-z0-9-], starting alphanumeric")
    unknown = set(raw) - allowed
    if unknown:
        raise RuleError(src, rid, f"unknown key(s): {', '.join(sorted(unknown))}")
    return rid


def _build_rule(src: str, raw: Mapping[str, Any], default_category: Any) -> Rule:
    rid = _checked_id(src, raw, _RULE_KEYS)

    def text(key: str, required: bool = True) -> str:
        value = raw.get(key, "")
        if not isinstance(value, str) or (required and not value.strip()):
            raise RuleError(src, rid, f"{key!r} must be a non-empty string")
        return value.strip()

    def strings(key: str) -> tuple[str, ...]:
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RuleError(src, rid, f"{key!r} must be a list of strings")
        return tuple(value)

    role = text("role")
    if role not in ROLES:
        raise RuleError(src, rid, f"role {role!r} is not one of {', '.join(ROLES)}")
    severity = text("severity")
    if severity not in SEVERITIES:
        raise RuleError(src, rid, f"severity {severity!r} is not one of {', '.join(SEVERITIES)}")
    category = raw.get("category", default_category)
    allowed = (PROGRESS_CATEGORY,) if role in ("progress", "marker") else CATEGORIES
    if category not in allowed:
        raise RuleError(src, rid, f"category {category!r} is not one of {', '.join(allowed)}")
    ignore_case = raw.get("ignore_case", False)
    if not isinstance(ignore_case, bool):
        raise RuleError(src, rid, "'ignore_case' must be true or false")
    fingerprint = raw.get("fingerprint")
    if fingerprint is not None and (not isinstance(fingerprint, str) or not _ID_RE.match(fingerprint)):
        raise RuleError(src, rid, "'fingerprint' must be a short lowercase name such as \"nan\"")
    fold = raw.get("fold")
    if fold is not None and fold not in FOLDS:
        raise RuleError(src, rid, f"'fold' must be one of {', '.join(FOLDS)}")
    scope = raw.get("scope", "rank")
    if scope not in SCOPES:
        raise RuleError(src, rid, f"'scope' must be one of {', '.join(SCOPES)}")
    scan = strings("scan")
    for sp in scan:
        try:
            re.compile(sp)
        except re.error as exc:
            raise RuleError(src, rid, f"scan pattern {sp!r} does not compile: {exc}") from exc
    fallback = raw.get("fallback", False)
    if not isinstance(fallback, bool):
        raise RuleError(src, rid, "'fallback' must be true or false")
    if fallback and (role != "symptom" or severity != "warning"):
        raise RuleError(src, rid, "a fallback rule is a warning-severity symptom")

    patterns = strings("patterns")
    if not patterns:
        raise RuleError(src, rid, "'patterns' must hold at least one regex")
    regexes = tuple(_compile(src, rid, p, ignore_case) for p in patterns)
    if fallback and not all(p.startswith(LEVEL_MARKER) for p in patterns):
        raise RuleError(src, rid, f"a fallback rule's patterns start with the level marker {LEVEL_MARKER}")

    examples = tuple(_example(src, rid, e) for e in raw.get("examples", []))
    counterexamples = strings("counterexamples")
    if not examples:
        raise RuleError(src, rid, "at least one example (real text) is required")
    marker = raw.get("marker")
    if (marker is not None) != (role == "marker"):
        raise RuleError(src, rid, "a marker rule (role \"marker\") names its 'marker', and only it does")
    if marker is not None and (marker not in MARKERS or severity != "info"):
        raise RuleError(src, rid, f"'marker' must be one of {', '.join(MARKERS)}, on an info-severity rule")
    if role == "notice" and (severity != "info" or fallback or fold is not None or fingerprint is not None):
        raise RuleError(
            src, rid, 'a notice (role "notice") is an info-severity rule with no fold or fingerprint'
        )
    needs_text = role not in ("progress", "marker")
    return Rule(
        id=rid,
        title=text("title"),
        category=str(category),
        severity=severity,
        role=role,
        patterns=patterns,
        regexes=regexes,
        ignore_case=ignore_case,
        fingerprint=fingerprint,
        fold=fold,
        root_cause=text("root_cause", needs_text),
        fix=text("fix", needs_text),
        verify=text("verify", needs_text),
        related=strings("related"),
        references=strings("references"),
        examples=examples,
        counterexamples=counterexamples,
        source=src,
        scope=scope,
        fallback=fallback,
        scan=scan,
        marker=marker,
    )


class LazyPattern:
    """A rule pattern on the ``regex`` engine, compiled on its first search: most rules never
    see a candidate line in a given run, and compiling them all is most of the cost of loading
    the library once the TOML is parsed. Loading has checked the pattern with ``re`` already."""

    __slots__ = ("_names", "_rx", "ignore_case", "pattern")

    def __init__(self, pattern: str, ignore_case: bool) -> None:
        self.pattern = pattern
        self.ignore_case = ignore_case
        self._rx: regex.Pattern[str] | None = None
        self._names: tuple[str | None, ...] | None = None

    def names(self) -> tuple[str | None, ...]:
        """Each group's name in group order (None for an unnamed group): ``Match.groups()``
        paired with these is the named groups' dict."""
        names = self._names
        if names is None:
            rx = self.compiled()
            by_index = {i: name for name, i in rx.groupindex.items()}
            names = self._names = tuple(by_index.get(i) for i in range(1, rx.groups + 1))
        return names

    def compiled(self) -> regex.Pattern[str]:
        rx = self._rx
        if rx is None:
            import regex  # here: the parent of `diagnose -j N` never searches; its start is serial

            flags = regex.VERSION0 | (regex.IGNORECASE if self.ignore_case else 0)
            rx = self._rx = regex.compile(self.pattern, flags)
        return rx

    def search(self, *args: Any) -> regex.Match[str] | None:
        rx = self._rx if self._rx is not None else self.compiled()
        return rx.search(*args)


def _compile(src: str, rid: str, pattern: str, ignore_case: bool) -> LazyPattern:
    try:  # the syntax rules say `re`; `regex` in its VERSION0 mode takes what `re` takes
        rx = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise RuleError(src, rid, f"pattern {pattern!r} does not compile: {exc}") from exc
    bad = set(rx.groupindex) - FIELD_NAMES
    if bad:
        raise RuleError(
            src,
            rid,
            f"pattern {pattern!r} uses unknown group name(s) {sorted(bad)}; allowed: {sorted(FIELD_NAMES)}",
        )
    if rx.search("") is not None:
        raise RuleError(src, rid, f"pattern {pattern!r} matches the empty line")
    return LazyPattern(pattern, ignore_case)


_EXAMPLE_KEYS = frozenset({"text", "fields", "source"})
_SOURCE_RE = re.compile(r"^https?://\S+$")


def _example(src: str, rid: str, raw: Any) -> Example:
    if isinstance(raw, str):
        return Example(text=raw)
    if isinstance(raw, dict) and set(raw) <= _EXAMPLE_KEYS and isinstance(raw.get("text"), str):
        fields = raw.get("fields", {})
        if not isinstance(fields, dict):
            raise RuleError(src, rid, "example 'fields' must be a table")
        source = raw.get("source")
        if source is not None and (not isinstance(source, str) or not _SOURCE_RE.match(source)):
            raise RuleError(src, rid, f"example 'source' must be an http(s) address, got {source!r}")
        return Example(text=raw["text"], fields=dict(fields), source=source)
    raise RuleError(
        src, rid, 'an example is a string or {text = ..., fields = {...}, source = "https://..."}'
    )


@dataclass(frozen=True, slots=True)
class SelfTestFailure:
    source: str
    rule_id: str
    reason: str


def self_test(rules: Iterable[Rule]) -> list[SelfTestFailure]:
    """Run every example and counterexample of every rule; return what failed."""
    failures: list[SelfTestFailure] = []
    for rule in rules:
        for ex in rule.examples:
            try:
                got = rule.search(ex.text)
            except PatternTimeout as exc:
                failures.append(SelfTestFailure(rule.source, rule.id, f"example {ex.text!r}: {exc}"))
                continue
            if got is None:
                failures.append(SelfTestFailure(rule.source, rule.id, f"example does not match: {ex.text!r}"))
                continue
            if rule.scan and not any(
                re.search(sp, ex.text, re.IGNORECASE if rule.ignore_case else 0) for sp in rule.scan
            ):
                failures.append(
                    SelfTestFailure(rule.source, rule.id, f"no scan pattern finds example {ex.text!r}")
                )
            for key, want in ex.fields.items():
                if got.get(key) != want:
                    failures.append(
                        SelfTestFailure(
                            rule.source,
                            rule.id,
                            f"example {ex.text!r}: field {key}={got.get(key)!r}, expected {want!r}",
                        )
                    )
        for cx in rule.counterexamples:
            try:
                matched = rule.search(cx) is not None
            except PatternTimeout as exc:
                failures.append(SelfTestFailure(rule.source, rule.id, f"counterexample {cx!r}: {exc}"))
                continue
            if matched:
                failures.append(SelfTestFailure(rule.source, rule.id, f"counterexample matches: {cx!r}"))
    return failures
