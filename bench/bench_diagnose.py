#!/usr/bin/env python3
"""Throughput and memory benchmark of `denpexd diagnose` against `grep -E` on the same input.

Builds a synthetic multi-rank job (``node<N>/rank<R>.log``, one generator seed per file) with
``bench/gen_training_log.py``, then measures, in one run and on the same warm page cache:

* ``grep -E -c -f PATTERNS`` (GNU grep, ``LC_ALL=C``) with every failure pattern of the rule
  library translated to POSIX ERE: the baseline ("how fast can one pass over the bytes be");
* ``rg -c -f PATTERNS`` with the same file, when ripgrep is installed;
* ``denpexd diagnose DIR --format json --progress never -j 1`` as a subprocess, on a small and on the
  full job directory (CPU seconds, wall seconds, peak RSS of that one process);
* ``denpexd diagnose -j 1`` against ``-j N`` (``--jobs``, default 2), interleaved, best wall
  time of 3, on the full directory and on the same size cut into ``--small-files`` (4,096) small
  files; the two outputs must be byte-identical; and the start cost of the worker pool with the
  "fork" and the "forkserver" start methods;
* in-process stages on the full directory: ``Matcher.scan`` over 1 MiB chunks (multi-pattern
  scan plus per-line verification) and ``reader.read_files`` (that plus folding, timestamps,
  context, progress sampling), to separate matching from correlation.

CPU seconds (user + system of the measured process, from ``wait4``) are the figure of merit,
not wall time: the machine is shared. Throughput is input MB (10^6 bytes) per CPU second.

Usage: python bench/bench_diagnose.py [--total 1G] [--files 64] [--seed 42] [--workdir bench/out]
                                      [--keep] [--regen] [--jobs N] [--small-files N] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from re import _constants as sre
from re import _parser as sre_parse
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
GENERATOR = BENCH_DIR / "gen_training_log.py"
NODES = 8
SIZE_SLACK = 64 * 1024  # the generator overshoots its target by at most a few lines
TARGET_MB_PER_CPU_S = 250.0
RSS_RATIO_LIMIT = 1.25  # "peak RSS must not grow with input": 4x the input, at most +25 % memory
MB = 1_000_000


# --------------------------------------------------------------------------- the generator

_gen_module: Any = None


def generator() -> Any:
    """bench/gen_training_log.py, imported by path (bench/ is not a package)."""
    global _gen_module
    if _gen_module is None:
        spec = importlib.util.spec_from_file_location("gen_training_log", GENERATOR)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _gen_module = mod
    return _gen_module


def fmt_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def job_layout(files: int) -> list[str]:
    """``node<N>/rank<R>.log`` for R = 0..files-1, ranks spread over up to 8 nodes."""
    nodes = min(NODES, files)
    per_node = math.ceil(files / nodes)
    return [f"node{r // per_node}/rank{r}.log" for r in range(files)]


def _reusable(path: Path, size: int, seed: int, failure_rate: float) -> dict[str, Any] | None:
    meta_path = Path(str(path) + ".meta.json")
    try:
        meta = json.loads(meta_path.read_text())
        actual = path.stat().st_size
    except (OSError, ValueError):
        return None
    if (
        meta.get("seed") == seed
        and meta.get("failure_rate_per_line") == failure_rate
        and meta.get("bytes") == actual
        and size <= actual <= size + SIZE_SLACK
    ):
        return meta
    return None


def _generate_one(task: tuple[str, int, int, float]) -> dict[str, Any]:
    out, size, seed, failure_rate = task
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = generator().generate(out, size, seed, failure_rate)
    return meta


def build_job(
    root: Path, total: int, files: int, seed: int, failure_rate: float, regen: bool
) -> dict[str, Any]:
    """Create (or reuse) the job directory; return its files' metadata and totals."""
    size = total // files
    tasks = []
    metas: dict[str, dict[str, Any]] = {}
    for i, rel in enumerate(job_layout(files)):
        path = root / rel
        file_seed = seed * 1000 + i  # one seed per file: every rank's log differs
        meta = None if regen else _reusable(path, size, file_seed, failure_rate)
        if meta is None:
            tasks.append((str(path), size, file_seed, failure_rate))
        else:
            metas[rel] = meta
    gen_s = 0.0
    if tasks:
        print(f"  generating {len(tasks)} file(s) of {fmt_size(size)} under {root} ...", flush=True)
        t0 = time.perf_counter()
        workers = max(1, min(len(tasks), os.cpu_count() or 1))
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(workers) as pool:
            for task, meta in zip(tasks, pool.map(_generate_one, tasks, chunksize=1), strict=True):
                metas[str(Path(task[0]).relative_to(root))] = meta
        gen_s = time.perf_counter() - t0
        print(f"  generated in {gen_s:.1f} s", flush=True)
    else:
        print(f"  reusing {files} file(s) under {root}", flush=True)
    ordered = [metas[rel] for rel in job_layout(files)]
    return {
        "dir": str(root),
        "files": files,
        "paths": [str(root / rel) for rel in job_layout(files)],
        "bytes": sum(m["bytes"] for m in ordered),
        "lines": sum(m["lines"] for m in ordered),
        "failure_events": sum(m["failure_events"] for m in ordered),
        "expected_matching_lines": sum(m["expected_matching_lines"] for m in ordered),
        "events_by_type": dict(sum((Counter(m["events_by_type"]) for m in ordered), Counter())),
        "generated_files": len(tasks),
        "generation_s": round(gen_s, 1),
    }


def warm_cache(paths: list[str]) -> None:
    """Read every file once so that every engine sees the same (warm) page cache."""
    buf = bytearray(1 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# --------------------------------------------------------------------------- rules


def snapshot_rules(source: Path, dest: Path, wait_s: float) -> Any:
    """Copy the rule library to ``dest`` and load it from there, retrying while it does not load.

    The library may be edited while the benchmark runs; a snapshot gives grep and Denpex the very
    same rules, and a half-edited library (a dangling ``related`` id, say) is waited out.
    """
    from denpex_agent.errors import RuleError
    from denpex_agent.rules import load_rules

    deadline = time.monotonic() + wait_s
    while True:
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        sources = [source] if source.is_file() else sorted(source.glob("*.toml"))
        for f in sources:
            shutil.copy2(f, dest / f.name)
        try:
            return load_rules(dest)
        except RuleError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: the rule library under {source} does not load: {exc}") from exc
            print(f"  rule library does not load yet ({exc}); retrying in 5 s", flush=True)
            time.sleep(5)


def rules_digest(ruleset_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(ruleset_dir.glob("*.toml")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- Python regex -> POSIX ERE


class Untranslatable(Exception):
    pass


_ERE_SPECIAL = set(".[]()*+?{}|^$\\")
_CATEGORY_IN_BRACKET = {
    sre.CATEGORY_DIGIT: "0-9",
    sre.CATEGORY_SPACE: "[:space:]",
    sre.CATEGORY_WORD: "[:alnum:]_",
}
_NEGATED_CATEGORY = {
    sre.CATEGORY_NOT_DIGIT: "[^0-9]",
    sre.CATEGORY_NOT_SPACE: "[^[:space:]]",
    sre.CATEGORY_NOT_WORD: "[^[:alnum:]_]",
}


def _char(code: int) -> str:
    if code == 10:
        raise Untranslatable("newline")
    if code > 127:
        raise Untranslatable("non-ASCII character")
    return chr(code)


def _literal(code: int, icase: bool) -> str:
    ch = _char(code)
    if icase and ch.isalpha():
        return f"[{ch.lower()}{ch.upper()}]"
    return "\\" + ch if ch in _ERE_SPECIAL else ch


def _bracket(items: list[tuple[Any, Any]], icase: bool) -> str:
    negate = bool(items) and items[0][0] is sre.NEGATE
    if negate:
        items = items[1:]
    if len(items) == 1 and items[0][0] is sre.CATEGORY and items[0][1] in _NEGATED_CATEGORY:
        if negate:  # [^\S] and the like: rare, not worth the trouble
            raise Untranslatable("negated negative class")
        return _NEGATED_CATEGORY[items[0][1]]
    chars: set[str] = set()
    parts: list[str] = []
    for op, av in items:
        if op is sre.LITERAL:
            ch = _char(av)
            chars.add(ch)
            if icase and ch.isalpha():
                chars.add(ch.swapcase())
        elif op is sre.RANGE:
            lo, hi = _char(av[0]), _char(av[1])
            ranges = [(lo, hi)]
            if icase:
                if "a" <= lo <= hi <= "z" or "A" <= lo <= hi <= "Z":
                    ranges.append((lo.swapcase(), hi.swapcase()))
                elif any(c.isalpha() for c in map(chr, range(ord(lo), ord(hi) + 1))):
                    raise Untranslatable("case-insensitive range mixing letters and other characters")
            for a, b in ranges:
                if a in "]^-" or b in "]^-":
                    raise Untranslatable("range bound that is a bracket metacharacter")
                parts.append(f"{a}-{b}")
        elif op is sre.CATEGORY and av in _CATEGORY_IN_BRACKET:
            parts.append(_CATEGORY_IN_BRACKET[av])
        else:
            raise Untranslatable(f"class member {op}")
    # POSIX placement rules: ']' first, '-' last, '^' anywhere but first
    head = "]" if "]" in chars else ""
    tail = "-" if "-" in chars else ""
    caret = "^" if "^" in chars else ""
    middle = "".join(sorted(chars - {"]", "-", "^"}))
    body = head + middle + "".join(parts) + caret + tail
    if body == "^":  # a lone '^' must not come first
        return "\\^"
    if not body:
        raise Untranslatable("empty class")
    if body.startswith("^"):
        body = body[1:] + "^"
    return ("[^" if negate else "[") + body + "]"


def _is_atom(seq: list[tuple[Any, Any]]) -> bool:
    if len(seq) != 1:
        return False
    op, _ = seq[0]
    return op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN, sre.SUBPATTERN, sre.BRANCH)


def _quantifier(lo: int, hi: int) -> str:
    if hi == sre.MAXREPEAT:
        return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    if lo == 0 and hi == 1:
        return "?"
    if lo == hi:
        return f"{{{lo}}}"
    if hi > 255:  # RE_DUP_MAX
        raise Untranslatable("repeat count above 255")
    return f"{{{lo},{hi}}}"


def _seq(seq: Any, icase: bool) -> str:
    out = []
    for op, av in seq:
        if op is sre.LITERAL:
            out.append(_literal(av, icase))
        elif op is sre.NOT_LITERAL:
            ch = _char(av)
            if icase and ch.isalpha():
                out.append(f"[^{ch.lower()}{ch.upper()}]")
            else:
                out.append(_bracket([(sre.NEGATE, None), (sre.LITERAL, av)], False))
        elif op is sre.ANY:
            out.append(".")
        elif op is sre.IN:
            out.append(_bracket(list(av), icase))
        elif op is sre.BRANCH:
            out.append("(" + "|".join(_seq(b, icase) for b in av[1]) + ")")
        elif op is sre.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            inner = icase
            if add_flags & sre.SRE_FLAG_IGNORECASE:
                inner = True
            if del_flags & sre.SRE_FLAG_IGNORECASE:
                inner = False
            if (add_flags | del_flags) & ~(sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_UNICODE):
                raise Untranslatable("inline flags other than (?i)")
            out.append("(" + _seq(sub, inner) + ")")
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            # a lazy quantifier finds a match exactly when the greedy one does: same line count
            lo, hi, item = av
            body = _seq(item, icase)
            if not _is_atom(list(item)):
                body = "(" + body + ")"
            out.append(body + _quantifier(lo, hi))
        elif op is sre.AT:
            if av in (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING):
                out.append("^")
            elif av in (sre.AT_END, sre.AT_END_STRING):
                out.append("$")
            elif av is sre.AT_BOUNDARY:
                out.append("\\b")
            elif av is sre.AT_NON_BOUNDARY:
                out.append("\\B")
            else:
                raise Untranslatable(f"anchor {av}")
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            raise Untranslatable("look-around")
        elif op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
            raise Untranslatable("back-reference")
        else:
            raise Untranslatable(str(op))
    return "".join(out)


def to_ere(pattern: str, ignore_case: bool) -> str:
    """A POSIX ERE (GNU grep dialect: ``\\b`` allowed) matching the same lines as ``pattern``.

    Case-insensitive rules and ``(?i)`` are spelled out as ``[aA]`` brackets, so that one
    case-sensitive grep pass covers every pattern and counts each line once.
    """
    try:
        parsed = sre_parse.parse(pattern)
    except Exception as exc:
        raise Untranslatable(f"does not parse: {exc}") from exc
    flags = parsed.state.flags
    if flags & ~(sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_UNICODE):
        raise Untranslatable("global flags other than (?i)")
    icase = ignore_case or bool(flags & sre.SRE_FLAG_IGNORECASE)
    return _seq(_required_part(list(parsed)), icase)


def _required_part(seq: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The pattern without the optional items at its ends: unanchored, ``(X)?Y(Z)?`` matches a
    line exactly when ``Y`` does (the rules capture fields with such groups, e.g. NCCL's
    ``host:pid:tid [dev] .{0,80}`` prefix, whose bounded repeat grep's DFA pays for on every
    line: one such prefix made the whole grep run 8x slower)."""

    def optional(item: tuple[Any, Any]) -> bool:
        op, av = item
        return op in (sre.MAX_REPEAT, sre.MIN_REPEAT) and av[0] == 0

    lo, hi = 0, len(seq)
    while lo < hi and optional(seq[lo]):
        lo += 1
    while hi > lo and optional(seq[hi - 1]):
        hi -= 1
    return seq[lo:hi] if lo < hi else seq


def translate_rules(ruleset: Any, workdir: Path) -> dict[str, Any]:
    """Write every failure pattern as ERE to ``patterns.ere``; check each on its rule's examples."""
    kept: list[tuple[Any, str, str]] = []
    dropped: list[dict[str, str]] = []
    total = 0
    for rule in ruleset:
        if rule.role == "progress":
            continue
        for p in rule.patterns:
            total += 1
            try:
                kept.append((rule, p, to_ere(p, rule.ignore_case)))
            except Untranslatable as exc:
                dropped.append({"rule": rule.id, "pattern": p, "reason": str(exc)})
    # Check: on the rule's own examples and counterexamples, grep must agree with Python's re.
    check_dir = workdir / "ere-check"
    check_dir.mkdir(parents=True, exist_ok=True)
    final: list[tuple[Any, str, str]] = []
    for n, (rule, p, ere) in enumerate(kept):
        rx = re.compile(p, re.IGNORECASE if rule.ignore_case else 0)
        lines = [e.text for e in rule.examples] + list(rule.counterexamples)
        lines = [x for x in lines if "\n" not in x]
        sample = check_dir / f"{n}.txt"
        sample.write_bytes("".join(x + "\n" for x in lines).encode())
        res = subprocess.run(
            ["grep", "-E", "-n", "-e", ere, str(sample)],
            env={**os.environ, "LC_ALL": "C"},
            capture_output=True,
        )
        if res.returncode > 1 or res.stderr:
            dropped.append(
                {
                    "rule": rule.id,
                    "pattern": p,
                    "reason": f"grep rejects {ere!r}: {res.stderr.decode()[:200]}",
                }
            )
            continue
        got = {int(x.split(b":", 1)[0]) - 1 for x in res.stdout.splitlines()}
        want = {i for i, x in enumerate(lines) if rx.search(x)}
        # ASCII-only classes under LC_ALL=C may miss non-ASCII examples; everything else must agree
        mismatch = [lines[i] for i in got ^ want if lines[i].isascii()]
        if mismatch:
            dropped.append(
                {"rule": rule.id, "pattern": p, "reason": f"ERE {ere!r} disagrees on {mismatch[0]!r}"}
            )
            continue
        final.append((rule, p, ere))
    shutil.rmtree(check_dir, ignore_errors=True)
    path = workdir / "patterns.ere"
    path.write_text("".join(ere + "\n" for _r, _p, ere in final))
    return {
        "file": str(path),
        "failure_patterns": total,
        "translated": len(final),
        "dropped": len(dropped),
        "dropped_detail": dropped,
        "ignore_case_patterns": sum(1 for r, _p, _e in final if r.ignore_case),
    }


# --------------------------------------------------------------------------- measuring


def measure(cmd: list[str], stdout_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` alone; CPU, wall and peak RSS of exactly that process (``os.wait4``)."""
    with open(stdout_path, "wb") as out, open(str(stdout_path) + ".stderr", "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _pid, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "cmd": cmd[:3] + (["..."] if len(cmd) > 3 else []),
        "rc": proc.returncode,
        "cpu_user_s": ru.ru_utime,
        "cpu_sys_s": ru.ru_stime,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "wall_s": wall,
        "peak_rss_mb": ru.ru_maxrss * 1024 / MB,  # Linux: KiB
        "stderr": Path(str(stdout_path) + ".stderr").read_text(errors="replace")[-2000:],
    }


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the least CPU; peak RSS is the worst seen over all runs."""
    best = dict(min(runs, key=lambda r: r["cpu_s"]))
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    best["repeats"] = len(runs)
    best["cpu_s_all"] = [round(r["cpu_s"], 3) for r in runs]
    return best


def run_grep_like(tool: str, patterns: Path, job: dict[str, Any], out: Path, repeat: int) -> dict[str, Any]:
    env = {**os.environ, "LC_ALL": "C"}
    if tool == "grep":
        cmd = ["grep", "-E", "-c", "-h", "-f", str(patterns), *job["paths"]]
    else:
        cmd = ["rg", "--no-config", "-c", "--no-filename", "-f", str(patterns), *job["paths"]]
    runs = []
    for _ in range(repeat):
        r = measure(cmd, out, env)
        if r["rc"] not in (0, 1):
            raise SystemExit(f"bench: {tool} failed (exit {r['rc']}): {r['stderr']}")
        r["matched_lines"] = sum(int(x) for x in out.read_text().split())
        runs.append(r)
    res = best_of(runs)
    res.update(engine=tool, input_bytes=job["bytes"], label=f"{tool} {fmt_mb(job['bytes'])}")
    return res


def denpexd_cmd() -> list[str]:
    """``python -m denpexd`` with this interpreter: the ``denpexd`` this interpreter imports (a
    ``PYTHONPATH`` pointing at a worktree is honoured), no version-manager shim in between, whose
    own processes would be counted."""
    return [sys.executable, "-m", "denpexd"]


def denpexd_once(job: dict[str, Any], rules_dir: Path, out: Path, jobs: int = 1) -> dict[str, Any]:
    """One ``denpexd diagnose DIR --format json -j JOBS`` run, measured, its JSON checked."""
    cmd = [
        *denpexd_cmd(),
        "diagnose",
        job["dir"],
        "--format",
        "json",
        "--progress",
        "never",
        "--rules",
        str(rules_dir),
        "-j",
        str(jobs),
    ]
    r = measure(cmd, out)
    if r["rc"] != 0:
        raise SystemExit(f"bench: denpexd diagnose -j {jobs} failed (exit {r['rc']}): {r['stderr']}")
    try:
        doc = json.loads(out.read_bytes())
    except ValueError as exc:
        raise SystemExit(f"bench: denpexd diagnose printed invalid JSON ({exc}); see {out}") from exc
    if not isinstance(doc, dict) or "verdict" not in doc:
        raise SystemExit(f"bench: denpexd diagnose JSON has no 'verdict'; see {out}")
    read = doc.get("read", {})
    r.update(
        jobs=jobs,
        verdict=doc["verdict"],
        initiator=(doc.get("initiator") or {}).get("rank"),
        root_cause=(doc.get("root_cause") or {}).get("rule"),
        events=read.get("events"),
        read_bytes=read.get("bytes"),
        read_lines=read.get("lines"),
        progress_samples=read.get("progress_samples"),
        warnings=len(read.get("warnings", [])),
        digest=hashlib.sha256(out.read_bytes()).hexdigest()[:16],
    )
    return r


def run_denpexd(
    job: dict[str, Any], rules_dir: Path, out: Path, repeat: int, jobs: int = 1
) -> dict[str, Any]:
    runs = [denpexd_once(job, rules_dir, out, jobs) for _ in range(repeat)]
    res = best_of(runs)
    res.update(
        engine=f"denpexd diagnose -j {jobs}",
        input_bytes=job["bytes"],
        label=f"denpexd diagnose -j {jobs} {fmt_mb(job['bytes'])}",
    )
    return res


def jobs_comparison(
    named: list[tuple[str, dict[str, Any]]], rules_dir: Path, workdir: Path, jobs: int, repeat: int
) -> list[dict[str, Any]]:
    """``-j 1`` and ``-j JOBS`` on each job directory, interleaved (1, N, 1, N, ...) so that both see
    the same neighbours; the best wall time of each is kept (CPU seconds are reported too). The
    JSON output must be byte-identical between the two."""
    rows = []
    for name, job in named:
        runs: dict[int, list[dict[str, Any]]] = {1: [], jobs: []}
        for _ in range(repeat):
            for j in (1, jobs):
                runs[j].append(denpexd_once(job, rules_dir, workdir / f"diagnose-{name}-j{j}.json", j))
        digests = {r["digest"] for rs in runs.values() for r in rs}
        if len(digests) != 1:
            raise SystemExit(
                f"bench: -j 1 and -j {jobs} disagree on {name}; see {workdir}/diagnose-{name}-j*.json"
            )
        for j, rs in runs.items():
            best = dict(min(rs, key=lambda r: r["wall_s"]))
            best.update(
                engine=f"denpexd -j {j}, {name}",
                input_bytes=job["bytes"],
                files=job["files"],
                wall_s_all=[round(r["wall_s"], 2) for r in rs],
                cpu_s_all=[round(r["cpu_s"], 2) for r in rs],
                peak_rss_mb=max(r["peak_rss_mb"] for r in rs),
                repeats=len(rs),
            )
            rows.append(best)
    return rows


SPIN = "x = 0\nfor i in range(20_000_000):\n    x += i\n"


def cpu_ceiling(jobs: int, repeat: int) -> dict[str, float]:
    """What ``jobs`` cores give right now: wall of one CPU-bound Python loop alone and of ``jobs``
    copies at once, interleaved, best of ``repeat``; ``speedup`` = jobs x alone / together (``jobs``
    on idle, dedicated cores; less when neighbours use them)."""
    alone, together = math.inf, math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", SPIN], check=True)
        alone = min(alone, time.perf_counter() - t0)
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(jobs)]
        for p in procs:
            p.wait()
        together = min(together, time.perf_counter() - t0)
    return {"alone_s": alone, "together_s": together, "speedup": jobs * alone / together}


def start_method_cost(job: dict[str, Any], rules_dir: Path, jobs: int, repeat: int) -> dict[str, float]:
    """Wall seconds of `parallelread.read_parallel` over two of the job's files (pool start, rules
    handed to the workers, two tasks) with each start method, best of ``repeat``."""
    from denpex_agent.reader import ReadReport, discover
    from denpex_agent.rules import load_rules
    from denpexd import parallelread

    rules = load_rules(rules_dir)
    files = discover(job["paths"][:2], None, ReadReport())
    best: dict[str, float] = {}
    for _ in range(repeat):
        for method in ("fork", "forkserver"):
            t0 = time.perf_counter()
            for _ev in parallelread.read_parallel(
                files, rules, "bench", ReadReport(), {}, jobs=jobs, start_method=method
            ):
                pass
            best[method] = min(best.get(method, math.inf), time.perf_counter() - t0)
    return best


def in_process_stages(job: dict[str, Any], rules_dir: Path) -> list[dict[str, Any]]:
    """Matcher.scan alone, then reader.read_files (scan + scanner), in this process."""
    from denpex_agent.matcher import Matcher
    from denpex_agent.reader import CHUNK, ReadReport, discover, read_files
    from denpex_agent.rules import load_rules

    rules = load_rules(rules_dir)
    matcher = Matcher(rules)
    results = []

    # 1) multi-pattern scan + per-line verification over complete lines, 1 MiB at a time
    hits_by_rule: Counter[str] = Counter()
    fold_openers = {r.id for r in rules if r.fold is not None}
    c0, w0 = time.process_time(), time.perf_counter()
    for p in job["paths"]:
        carry = b""
        with open(p, "rb") as fh:
            while True:
                chunk = fh.read(CHUNK)
                if not chunk:
                    break
                buf = carry + chunk if carry else chunk
                cut = buf.rfind(b"\n") + 1
                for h in matcher.scan(buf, cut):
                    hits_by_rule[h.rule.id] += 1
                carry = buf[cut:]
        if carry:
            for h in matcher.scan(carry + b"\n"):
                hits_by_rule[h.rule.id] += 1
    results.append(
        {
            "engine": "Matcher.scan (in-process)",
            "label": f"Matcher.scan {fmt_mb(job['bytes'])}",
            "input_bytes": job["bytes"],
            "cpu_s": time.process_time() - c0,
            "wall_s": time.perf_counter() - w0,
            "peak_rss_mb": None,
            "matched_lines": sum(hits_by_rule.values()),
            "fold_openers": sum(n for rid, n in hits_by_rule.items() if rid in fold_openers),
            "hits_by_rule": dict(sorted(hits_by_rule.items())),
        }
    )

    # 2) the reader: discovery, scan, folds, timestamps, context, progress sampling
    report = ReadReport()
    events_by_rule: Counter[str] = Counter()
    progress = 0
    c0, w0 = time.process_time(), time.perf_counter()
    files = discover([job["dir"]], None, report)
    for ev in read_files(files, matcher, "bench", report):
        if ev.kind == "match":
            events_by_rule[ev.rule or "?"] += 1
        else:
            progress += 1
    results.append(
        {
            "engine": "read_files (in-process)",
            "label": f"read_files {fmt_mb(job['bytes'])}",
            "input_bytes": job["bytes"],
            "cpu_s": time.process_time() - c0,
            "wall_s": time.perf_counter() - w0,
            "peak_rss_mb": None,
            "events": sum(events_by_rule.values()),
            "progress_samples": progress,
            "events_by_rule": dict(sorted(events_by_rule.items())),
        }
    )
    return results


# --------------------------------------------------------------------------- reporting


def fmt_mb(n: int) -> str:
    return f"{n / MB:.0f} MB"


def throughput(r: dict[str, Any]) -> float | None:
    return r["input_bytes"] / MB / r["cpu_s"] if r["cpu_s"] > 0 else None


def print_jobs_table(rows: list[dict[str, Any]]) -> None:
    head = ("run", "MB", "wall s", "walls", "CPU s", "MB/wall-s", "MB/CPU-s", "peak RSS MB")
    body = [
        (
            r["engine"],
            f"{r['input_bytes'] / MB:.0f}",
            f"{r['wall_s']:.2f}",
            " ".join(f"{w:.2f}" for w in r["wall_s_all"]),
            f"{r['cpu_s']:.2f}",
            f"{r['input_bytes'] / MB / r['wall_s']:.1f}",
            f"{throughput(r) or 0:.1f}",
            f"{r['peak_rss_mb']:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    for cells in (head, *body):
        print(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
        )


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("engine", "input MB", "CPU s", "wall s", "MB/CPU-s", "peak RSS MB")
    body = []
    for r in rows:
        tp = throughput(r)
        body.append(
            (
                r["engine"],
                f"{r['input_bytes'] / MB:.0f}",
                f"{r['cpu_s']:.2f}",
                f"{r['wall_s']:.2f}",
                "-" if tp is None else f"{tp:.1f}",
                "-" if r.get("peak_rss_mb") is None else f"{r['peak_rss_mb']:.1f}",
            )
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True))
    )
    print(line)
    print("-" * len(line))
    for b in body:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths, strict=True))
            )
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", default="1G", help="size of the main job directory (default 1G)")
    ap.add_argument(
        "--small", default=None, help="size of the comparison directory (default min(256M, total/4))"
    )
    ap.add_argument("--files", type=int, default=64, help="rank log files per directory (default 64)")
    ap.add_argument("--seed", type=int, default=42, help="base seed; file i uses seed*1000+i (default 42)")
    ap.add_argument(
        "--failure-rate", type=float, default=None, help="failure events per line (generator default)"
    )
    ap.add_argument(
        "--workdir", default=str(BENCH_DIR / "out"), help="where data and outputs go (default bench/out)"
    )
    ap.add_argument("--rules", default=None, help="rule library to snapshot (default: the bundled library)")
    ap.add_argument(
        "--rules-wait", type=float, default=300, help="seconds to wait for a loadable library (default 300)"
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per measurement; the least CPU is kept (default 1)"
    )
    ap.add_argument("--regen", action="store_true", help="regenerate the logs even if matching ones exist")
    ap.add_argument(
        "--keep", action="store_true", help="keep the generated logs (default: delete them at the end)"
    )
    ap.add_argument("--skip-in-process", action="store_true", help="skip the in-process stage measurements")
    ap.add_argument(
        "--jobs",
        type=int,
        default=2,
        metavar="N",
        help="compare diagnose -j 1 with -j N, interleaved, best wall of max(3, --repeat) (default 2; 1 skips)",
    )
    ap.add_argument(
        "--small-files",
        type=int,
        default=4096,
        metavar="N",
        help="the -j comparison also on the main size cut into N small files (default 4096; 0 skips)",
    )
    ap.add_argument("--json", metavar="OUT", help="also write every figure as JSON to OUT")
    a = ap.parse_args(argv)

    gen = generator()
    total = gen.parse_size(a.total)
    small = gen.parse_size(a.small) if a.small else min(256 << 20, total // 4)
    failure_rate = a.failure_rate
    if failure_rate is None:
        failure_rate = gen.generate.__defaults__[0]
    if a.files < 1 or total < a.files or small < a.files:
        ap.error("--total and --small must give every file at least one byte")
    workdir = Path(a.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    print(
        f"Denpex diagnose benchmark: {fmt_size(total)} and {fmt_size(small)} in {a.files} files, seed {a.seed}"
    )

    # ---- rules
    from denpex_agent.rules import default_rules_dir

    rules_src = Path(a.rules) if a.rules else default_rules_dir()
    rules_dir = workdir / "rules-snapshot"
    print(f"[1/6] rules: snapshot of {rules_src}")
    ruleset = snapshot_rules(rules_src, rules_dir, a.rules_wait)
    n_rules = sum(1 for r in ruleset if r.role != "progress")
    ere = translate_rules(ruleset, workdir)
    print(
        f"  {len(ruleset)} rules ({n_rules} failure rules) from {len(ruleset.files)} file(s), digest {rules_digest(rules_dir)}; "
        f"{ere['failure_patterns']} failure patterns, {ere['translated']} translated to ERE, {ere['dropped']} dropped"
    )
    for d in ere["dropped_detail"]:
        print(f"    dropped {d['rule']}: {d['reason']}")

    # ---- data
    print("[2/6] data")
    jobs = {}
    for name, size in (("main", total), ("small", small)):
        root = workdir / f"job-{fmt_size(size)}-{a.files}f-s{a.seed}"
        jobs[name] = build_job(root, size, a.files, a.seed, failure_rate, a.regen)
    if a.jobs > 1 and a.small_files > 0:
        root = workdir / f"job-{fmt_size(total)}-{a.small_files}f-s{a.seed}"
        jobs["many"] = build_job(root, total, a.small_files, a.seed, failure_rate, a.regen)
    print("  warming the page cache ...", flush=True)
    warm_cache([p for j in jobs.values() for p in j["paths"]])

    rows: list[dict[str, Any]] = []
    # ---- baselines
    print("[3/6] baselines: grep -E -c -f (LC_ALL=C)" + (", rg" if shutil.which("rg") else ""), flush=True)
    grep_main = run_grep_like("grep", Path(ere["file"]), jobs["main"], workdir / "grep-main.out", a.repeat)
    grep_small = run_grep_like("grep", Path(ere["file"]), jobs["small"], workdir / "grep-small.out", a.repeat)
    rows += [grep_small, grep_main]
    rg_status = "not installed"
    rg_main = None
    if shutil.which("rg"):
        rg_main = run_grep_like("rg", Path(ere["file"]), jobs["main"], workdir / "rg-main.out", a.repeat)
        rows.append(rg_main)
        rg_status = subprocess.run(["rg", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    else:
        print("  rg: not installed")

    # ---- Denpex end to end
    print("[4/6] denpexd diagnose -j 1 (subprocess)", flush=True)
    dx_small = run_denpexd(jobs["small"], rules_dir, workdir / "diagnose-small.json", a.repeat)
    dx_main = run_denpexd(jobs["main"], rules_dir, workdir / "diagnose-main.json", a.repeat)
    rows += [dx_small, dx_main]
    # fixed cost: interpreter start, imports, rule loading, hyperscan compilation (one 64 KiB file)
    tiny = build_job(workdir / f"job-64K-1f-s{a.seed}", 64 << 10, 1, a.seed, failure_rate, a.regen)
    dx_fixed = run_denpexd(tiny, rules_dir, workdir / "diagnose-tiny.json", max(a.repeat, 3))
    print(
        f"  fixed cost (one 64 KiB file): {dx_fixed['cpu_s']:.2f} CPU s, {dx_fixed['peak_rss_mb']:.1f} MB RSS"
    )

    # ---- -j 1 against -j N
    jobs_rows: list[dict[str, Any]] = []
    methods: dict[str, float] = {}
    ceiling: dict[str, float] = {}
    if a.jobs > 1:
        named = [(f"{a.files} files", jobs["main"])]
        if "many" in jobs:
            named.append((f"{a.small_files} files", jobs["many"]))
        reps = max(3, a.repeat)
        print(f"[4b] denpexd diagnose -j 1 against -j {a.jobs}, interleaved, best of {reps}", flush=True)
        jobs_rows = jobs_comparison(named, rules_dir, workdir, a.jobs, reps)
        methods = start_method_cost(jobs["main"], rules_dir, a.jobs, reps)
        ceiling = cpu_ceiling(a.jobs, reps)

    # ---- Denpex stages
    stages: list[dict[str, Any]] = []
    if not a.skip_in_process:
        print("[5/6] in-process stages on the main directory", flush=True)
        stages = in_process_stages(jobs["main"], rules_dir)
        rows += stages
    else:
        print("[5/6] in-process stages: skipped")

    # ---- report
    print("[6/6] results\n")
    print_table(rows)
    tp_grep = throughput(grep_main) or 0.0
    tp_dx = throughput(dx_main) or 0.0
    rss_ratio = dx_main["peak_rss_mb"] / dx_small["peak_rss_mb"]
    ratio = tp_dx / tp_grep if tp_grep else None
    e2e_ok = tp_dx >= TARGET_MB_PER_CPU_S
    rss_ok = rss_ratio <= RSS_RATIO_LIMIT
    print()
    print(
        f"Denpex / grep (MB per CPU-s, {fmt_mb(jobs['main']['bytes'])}): {ratio:.3f}"
        if ratio
        else "Denpex / grep: n/a"
    )
    if rg_main is not None:
        print(f"Denpex / rg   (MB per CPU-s): {tp_dx / (throughput(rg_main) or 1):.3f}")
    print(f"rg: {rg_status}")
    print(
        f"target end-to-end >= {TARGET_MB_PER_CPU_S:.0f} MB/CPU-s: {tp_dx:.1f} -> {'PASS' if e2e_ok else 'FAIL'}"
    )
    print(
        f"target peak RSS flat in input size: {dx_main['peak_rss_mb']:.1f} MB at {fmt_mb(jobs['main']['bytes'])} / "
        f"{dx_small['peak_rss_mb']:.1f} MB at {fmt_mb(jobs['small']['bytes'])} = {rss_ratio:.2f} "
        f"(limit {RSS_RATIO_LIMIT}) -> {'PASS' if rss_ok else 'FAIL'}"
    )
    print(
        f"fixed cost per denpexd run (start, imports, rules, hyperscan compile): {dx_fixed['cpu_s']:.2f} CPU s; "
        f"without it, {fmt_mb(jobs['main']['bytes'])} -> "
        f"{jobs['main']['bytes'] / MB / max(dx_main['cpu_s'] - dx_fixed['cpu_s'], 1e-9):.1f} MB/CPU-s"
    )
    if jobs_rows:
        print(
            f"\n-j 1 against -j {a.jobs} (wall: best of {jobs_rows[0]['repeats']}, interleaved; same JSON):"
        )
        print_jobs_table(jobs_rows)
        for i in range(0, len(jobs_rows), 2):
            one, many = jobs_rows[i], jobs_rows[i + 1]
            print(
                f"  {one['files']} files: -j {a.jobs} wall speed-up {one['wall_s'] / many['wall_s']:.2f}x "
                f"(target >= 1.8x on 2 cores for the {a.files}-file job), CPU cost "
                f"{many['cpu_s'] / one['cpu_s']:.2f}x"
            )
        if len(jobs_rows) == 4:
            big, many = jobs_rows[0], jobs_rows[2]
            print(
                f"  {jobs['many']['files']} small files against {a.files} large, -j 1, MB per CPU-s: "
                f"{throughput(many) or 0:.1f} / {throughput(big) or 0:.1f} = "
                f"{(throughput(many) or 0) / (throughput(big) or 1):.2f}"
            )
        print(
            f"  the machine's ceiling now: {a.jobs} CPU-bound loops at once vs one alone: "
            f"{ceiling['speedup']:.2f}x ({ceiling['alone_s']:.2f} s alone, {ceiling['together_s']:.2f} s together)"
        )
        if methods:
            print(
                "  pool start + 2 files, wall: "
                + ", ".join(f"{m} {t * 1000:.0f} ms" for m, t in methods.items())
            )
    main_job = jobs["main"]
    print()
    print(f"Correctness ({fmt_mb(main_job['bytes'])}, {main_job['lines']} lines):")
    print(
        f"  generator: {main_job['failure_events']} failure events, {main_job['expected_matching_lines']} expected matching lines"
    )
    print(
        f"  grep:      {grep_main['matched_lines']} matching lines ({ere['translated']} of {ere['failure_patterns']} patterns)"
    )
    print(
        f"  denpexd:   {dx_main['events']} events (tracebacks and torchrun failure blocks are folded into one), "
        f"verdict {dx_main['verdict']!r}, root cause {dx_main['root_cause']!r}, initiator rank {dx_main['initiator']}"
    )
    if stages:
        print(
            f"  Matcher.scan: {stages[0]['matched_lines']} verified lines, {stages[0]['fold_openers']} of them "
            f"opening a fold (traceback header, torchrun failure block); read_files: {stages[1]['events']} events"
        )
    if dx_main["warnings"]:
        print(
            f"  denpexd reported {dx_main['warnings']} read warning(s); see {workdir / 'diagnose-main.json'}"
        )
    elapsed = time.perf_counter() - t_start
    print(
        f"\nbenchmark wall time {elapsed:.0f} s (generation {sum(j['generation_s'] for j in jobs.values()):.0f} s)"
    )

    if a.json:
        doc = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "grep": subprocess.run(
                    ["grep", "--version"], capture_output=True, text=True
                ).stdout.splitlines()[0],
                "rg": rg_status,
            },
            "args": vars(a),
            "rules": {
                "source": str(rules_src),
                "rules": len(ruleset),
                "failure_rules": n_rules,
                "digest": rules_digest(rules_dir),
                **{k: v for k, v in ere.items() if k != "file"},
            },
            "data": {k: {kk: vv for kk, vv in j.items() if kk != "paths"} for k, j in jobs.items()},
            "results": [{**r, "mb_per_cpu_s": throughput(r)} for r in rows],
            "jobs_comparison": [
                {**r, "mb_per_cpu_s": throughput(r), "mb_per_wall_s": r["input_bytes"] / MB / r["wall_s"]}
                for r in jobs_rows
            ],
            "start_method_wall_s": methods,
            "cpu_ceiling": ceiling,
            "summary": {
                "denpex_mb_per_cpu_s": tp_dx,
                "grep_mb_per_cpu_s": tp_grep,
                "denpex_over_grep": ratio,
                "target_mb_per_cpu_s": TARGET_MB_PER_CPU_S,
                "target_met": e2e_ok,
                "fixed_cost_cpu_s": dx_fixed["cpu_s"],
                "fixed_cost_rss_mb": dx_fixed["peak_rss_mb"],
                "rss_small_mb": dx_small["peak_rss_mb"],
                "rss_main_mb": dx_main["peak_rss_mb"],
                "rss_ratio": rss_ratio,
                "rss_ratio_limit": RSS_RATIO_LIMIT,
                "rss_flat": rss_ok,
                "expected_matching_lines": main_job["expected_matching_lines"],
                "failure_events": main_job["failure_events"],
                "grep_matched_lines": grep_main["matched_lines"],
                "denpex_events": dx_main["events"],
                "elapsed_s": elapsed,
            },
        }
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"figures written to {a.json}")

    if not a.keep:
        for j in [*jobs.values(), tiny]:
            shutil.rmtree(j["dir"], ignore_errors=True)
        print("generated logs deleted (use --keep to reuse them next time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
