from __future__ import annotations

import datetime
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import RuleSet, _parse_toml, load_rules
from denpex_agent.scanner import LineScanner, Source
from tests.conftest import UNIT_RULES

LOG = (
    "2026-11-29 12:00:01,100 INFO [rank3] step 1 | loss 2.0\n"
    "2026-11-29 12:00:01,200 INFO [rank3] step 2 | loss 2.0\n"
    "[rank3]: Traceback (most recent call last):\n"
    '[rank3]:   File "train.py", line 3, in <module>\n'
    "[rank3]:     loss.backward()\n"
    "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB password=hunter2\n"
    "2026-11-29 12:00:02,200 INFO [rank3] after\n"
    "Traceback (most recent call last):\n"
    '  File "/usr/bin/torchrun", line 8, in <module>\n'
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    "============================================================\n"
    "train.py FAILED\n"
    "------------------------------------------------------------\n"
    "Root Cause (first observed failure):\n"
    "[0]:\n"
    "  time      : 2026-11-29_12:00:05\n"
    "  rank      : 3 (local_rank: 1)\n"
    "  exitcode  : -9 (pid: 1234)\n"
    "  traceback : Signal 9 (SIGKILL) received by PID 1234\n"
    "============================================================\n"
    "Traceback (most recent call last):\n"
    '  File "x.py", line 1, in <module>\n'
    "KeyError: 'shard-9'\n"
    "Killed\n"
)


def _source() -> Source:
    return Source(
        job="j",
        agent="a",
        node="n1",
        rank=None,
        local_rank=None,
        file="f.log",
        identity="id",
        default_year=2026,
    )


def _scan(matcher: Matcher, data: bytes, sizes: list[int] | None = None, **kw: int) -> list[Event]:
    sc = LineScanner(matcher, _source(), **kw)
    out: list[Event] = []
    if sizes is None:
        out += sc.feed(data)
    else:
        pos = 0
        i = 0
        while pos < len(data):
            n = sizes[i % len(sizes)]
            out += sc.feed(data[pos : pos + n])
            pos += n
            i += 1
    out += sc.finish()
    return out


def _matches(rules: RuleSet, data: bytes, sizes: list[int] | None = None) -> list[Event]:
    """The match events of ``data`` read with the library ``rules`` in reads of ``sizes``."""
    return [e for e in _scan(Matcher(rules), data, sizes) if e.kind == "match"]


def _key(e: Event) -> tuple[object, ...]:
    return (
        e.kind,
        e.rule,
        e.offset,
        e.line_no,
        e.rank,
        e.ts,
        e.ts_source,
        e.text,
        tuple(sorted(e.fields.items())),
    )


def test_tracebacks_fold_into_one_event_classified_by_the_exception(unit_matcher: Matcher) -> None:
    events = [e for e in _scan(unit_matcher, LOG.encode()) if e.kind == "match"]
    rules = [e.rule for e in events]
    assert rules == ["cuda-oom", "elastic-child-failed", "python-traceback", "killed-line"]
    oom = events[0]
    assert oom.line_no == 3 and oom.rank == 3
    assert oom.text.startswith("[rank3]: Traceback") and "CUDA out of memory" in oom.text
    assert "hunter2" not in oom.text and "password=***" in oom.text
    assert oom.ts_source == "inherited" and oom.ts is not None
    assert oom.context[-1].endswith("step 2 | loss 2.0")


def test_elastic_summary_names_the_root_cause_rank(unit_matcher: Matcher) -> None:
    ev = next(e for e in _scan(unit_matcher, LOG.encode()) if e.rule == "elastic-child-failed")
    assert ev.fields["culprit_rank"] == 3
    assert ev.fields["culprit_local_rank"] == 1
    assert ev.fields["exitcode"] == -9
    assert ev.fields["signal"] == 9


# torch.multiprocessing.spawn's report of a failed worker, in the parent's exception: the header
# and the worker's first frames as posted in facebookresearch/detectron2#3819 (torch 1.10) and
# #51 (before torch 1.8: a plain `Exception`); the final exception lines are written for the test.
SPAWN_REPORTS = (
    (
        "    raise ProcessRaisedException(msg, error_index, failed_process.pid)\n"
        "torch.multiprocessing.spawn.ProcessRaisedException: \n"
        "\n"
        "-- Process 1 terminated with the following error:\n"
        "Traceback (most recent call last):\n"
        '  File "/usr/local/lib/python3.6/dist-packages/torch/multiprocessing/spawn.py", line 59, in _wrap\n'
        "    fn(i, *args)\n"
        "ValueError: bad batch\n",
        1,
    ),
    (
        "    raise Exception(msg)\n"
        "Exception:\n"
        "\n"
        "\n"
        "-- Process 2 terminated with the following error:\n"
        "Traceback (most recent call last):\n"
        '  File "/home/user/miniconda/envs/detectron2/lib/python3.7/site-packages/torch/multiprocessing/spawn.py", '
        "line 19, in _wrap\n"
        "    fn(i, *args)\n"
        "ValueError: bad batch\n",
        2,
    ),
)


@pytest.mark.parametrize(("report", "index"), SPAWN_REPORTS)
def test_a_spawned_workers_traceback_takes_the_process_index_as_its_local_rank(
    unit_matcher: Matcher, report: str, index: int
) -> None:
    parent = 'Traceback (most recent call last):\n  File "train_net.py", line 9, in <module>\n'
    events = [e for e in _scan(unit_matcher, (parent + report).encode()) if e.kind == "match"]
    assert [e.fields.get("local_rank") for e in events] == [None, index]  # the parent's, the worker's
    assert [e.local_rank for e in events] == [None, index]  # not one aggregate with the parent's
    assert "ValueError: bad batch" in events[1].text


def test_a_spawned_worker_cut_off_in_a_single_node_job_is_named(library: RuleSet) -> None:
    """The parent's traceback comes first in the file; the worker's (its exception line lost)
    follows the spawn header. Both name no global rank, and the job has one node: the worker's
    local rank is its rank, and it is the one that failed."""
    from denpexd.diagnosecmd import diagnose_paths

    report = SPAWN_REPORTS[1][0].replace("ValueError: bad batch\n", "")
    text = 'Traceback (most recent call last):\n  File "train_net.py", line 9, in <module>\n' + report
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "node0")
        path.mkdir()
        (path / "console.log").write_text(text)
        doc = diagnose_paths([tmp], job="spawn", rules=library, context_lines=0)
    assert doc["verdict"] == "failed" and doc["initiator"]["rank"] == 2


def test_a_traceback_after_other_lines_names_no_spawned_worker(unit_matcher: Matcher) -> None:
    text = SPAWN_REPORTS[0][0].replace(
        "-- Process 1 terminated with the following error:\n",
        "-- Process 1 terminated with the following error:\nsome other line\n",
    )
    (ev,) = [e for e in _scan(unit_matcher, text.encode()) if e.kind == "match"]
    assert "local_rank" not in ev.fields


def test_unknown_exception_keeps_the_generic_rule_and_names_it(unit_matcher: Matcher) -> None:
    ev = next(e for e in _scan(unit_matcher, LOG.encode()) if e.rule == "python-traceback")
    assert ev.fields["exception"] == "KeyError: 'shard-9'"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=8))
def test_events_do_not_depend_on_chunk_boundaries(unit_matcher: Matcher, sizes: list[int]) -> None:
    data = (LOG * 3).encode()
    whole = sorted(map(_key, _scan(unit_matcher, data)))
    pieces = sorted(map(_key, _scan(unit_matcher, data, sizes)))
    assert pieces == whole


def _step_lines(n: int, pad: int = 0) -> bytes:
    return "".join(
        f"2026-11-29 12:{i // 600:02d}:{i // 10 % 60:02d},{i % 10}00 INFO [rank0] step {i} | loss 1.5{' ' * pad}\n"
        for i in range(n)
    ).encode()


def test_progress_samples_the_first_lines_then_one_per_bucket(unit_matcher: Matcher) -> None:
    data = _step_lines(200)
    every = [
        e for e in _scan(unit_matcher, data, dense=1000) if e.kind == "progress" and not e.fields.get("tip")
    ]
    assert [e.fields["step"] for e in every] == list(range(200))
    sampled = [e for e in _scan(unit_matcher, data, dense=10, stride=2048) if e.kind == "progress"]
    samples = [e for e in sampled if not e.fields.get("tip")]
    line_starts = [0]
    for line in data.splitlines(keepends=True)[:-1]:
        line_starts.append(line_starts[-1] + len(line))
    want = line_starts[:10]  # the first ten step lines ...
    seen = {want[-1] // 2048}
    for o in line_starts[10:]:  # ... then the first line that starts in each bucket not sampled yet
        if o // 2048 not in seen:
            seen.add(o // 2048)
            want.append(o)
    assert [e.offset for e in samples] == want
    tip = sampled[-1]
    assert tip.fields["step"] == 199 and tip.fields.get("last") is True and tip.fields.get("tip") is True


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=12))
def test_samples_do_not_depend_on_read_sizes(unit_matcher: Matcher, sizes: list[int]) -> None:
    data = _step_lines(400, pad=7)
    kw = {"dense": 25, "stride": 1500}

    def samples(got: list[Event]) -> list[tuple[object, ...]]:
        return [_key(e) for e in got if e.kind == "progress" and not e.fields.get("tip")]

    assert samples(_scan(unit_matcher, data, sizes, **kw)) == samples(_scan(unit_matcher, data, **kw))


def test_a_resumed_scanner_samples_what_an_uninterrupted_one_does(unit_matcher: Matcher) -> None:
    data = _step_lines(400, pad=3)
    kw = {"dense": 20, "stride": 1700}
    whole = [
        e.offset for e in _scan(unit_matcher, data, **kw) if e.kind == "progress" and not e.fields.get("tip")
    ]
    for cut_line in (5, 17, 60, 133, 301):
        cut = sum(len(line) for line in data.splitlines(keepends=True)[:cut_line])
        first = LineScanner(unit_matcher, _source(), **kw)
        got = [e for e in first.feed(data[:cut]) if e.kind == "progress"]
        resumed = LineScanner(
            unit_matcher, _source(), start_offset=first.offset, sampling=first.sampling, **kw
        )
        got += resumed.feed(data[first.offset :]) + resumed.finish()
        assert sorted({e.offset for e in got if not e.fields.get("tip")}) == whole, cut_line


def test_truncated_line_carries_a_marker(unit_matcher: Matcher) -> None:
    sc = LineScanner(unit_matcher, _source(), max_line_bytes=4096)
    events = sc.feed(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB " + b"x" * 10000)
    events += sc.feed(b"y" * 10000 + b"\nnext\n") + sc.finish()
    (oom,) = [e for e in events if e.rule == "cuda-oom"]
    assert oom.text.endswith("[denpex: line truncated]")
    assert sc.offset == 20000 + len(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB "
    ) + len("\nnext\n")
    assert sc.line_no == 3


def test_huge_line_is_truncated_counted_and_the_file_goes_on(unit_matcher: Matcher) -> None:
    data = b"x" * (3 << 20) + b" Killed\nKilled\n2026-11-29 12:00:00,000 INFO [rank0] step 5 | loss 1.0\n"
    sc = LineScanner(unit_matcher, _source(), max_line_bytes=1 << 20)
    out: list[Event] = []
    for i in range(0, len(data), 65536):
        out += sc.feed(data[i : i + 65536])
    out += sc.finish()
    assert sc.stats.truncated_lines == 1
    assert sc.stats.warnings and "longer than" in sc.stats.warnings[0]
    assert not any(e.rule == "killed-line" and e.line_no == 1 for e in out)  # "...x Killed" is no bare Killed
    killed = [e for e in out if e.rule == "killed-line"]
    assert len(killed) == 1 and killed[0].line_no == 2 and killed[0].offset == (3 << 20) + 8
    assert [e.fields["step"] for e in out if e.kind == "progress"] == [5]


def test_invalid_utf8_and_nul_bytes_are_read_with_replacement(unit_matcher: Matcher, tmp_path: Path) -> None:
    bad = tmp_path / "node1" / "rank0.log"
    bad.parent.mkdir()
    bad.write_bytes(
        b"\xff\xfe\x00garbage\x00\n\xc3\x28 Killed\nKilled\n\x80\x81 CUDA out of memory. Tried to allocate 1 GiB\n"
    )
    report = ReadReport()
    files = discover([tmp_path], None, report)
    events = [e for e in read_files(files, unit_matcher, "j", report) if e.kind == "match"]
    assert [e.rule for e in events] == ["killed-line", "cuda-oom"]
    assert "\ufffd" in events[1].text
    assert any("binary" in w for w in report.warnings)
    assert any("undecodable" in w for w in report.warnings)


def test_discovery_warns_about_missing_empty_and_non_log_inputs(
    unit_matcher: Matcher, tmp_path: Path
) -> None:
    (tmp_path / "job" / "node1").mkdir(parents=True)
    (tmp_path / "job" / "node1" / "rank0.log").write_bytes(b"")
    (tmp_path / "job" / "node1" / "rank1.log").mkdir()  # a directory where a file should be
    (tmp_path / "job" / "node1" / "model.bin").write_bytes(b"\x00" * 10)
    report = ReadReport()
    files = discover([tmp_path / "job", tmp_path / "missing"], None, report)
    assert [f.rel for f in files] == ["job/node1/rank0.log"]  # several paths: each under its name
    assert any("missing" in w and "cannot read" in w for w in report.warnings)
    assert list(read_files(files, unit_matcher, "j", report)) == []
    assert report.files == 1


def test_rotated_files_are_read_oldest_first(unit_matcher: Matcher, tmp_path: Path) -> None:
    d = tmp_path / "node1"
    d.mkdir()
    for name in ("rank0.log", "rank0.log.1", "rank0.log.2"):
        (d / name).write_text("Killed\n")
    report = ReadReport()
    assert [f.rel for f in discover([tmp_path], None, report)] == [
        "node1/rank0.log.2",
        "node1/rank0.log.1",
        "node1/rank0.log",
    ]


def test_flush_closes_a_traceback_at_the_end_of_the_data(unit_matcher: Matcher) -> None:
    sc = LineScanner(unit_matcher, _source())
    data = b"Traceback (most recent call last):\n  File 'x', line 1\nKeyError: 'k'\npartial line without newl"
    assert sc.feed(data) == []  # the block might go on
    events = sc.flush()
    assert [e.rule for e in events] == ["python-traceback"]
    assert events[0].fields["exception"] == "KeyError: 'k'"
    assert sc.pending == len(b"partial line without newl")


def test_pattern_database_cache_round_trip_and_damage(
    unit_rules: RuleSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    data = LOG.encode()
    fresh = [(h.rule.id, h.start) for h in Matcher(unit_rules).scan(data)]
    cached_files = list((tmp_path / "denpex").glob("*.hsdb"))
    assert cached_files, "the compiled database is cached"
    assert [(h.rule.id, h.start) for h in Matcher(unit_rules).scan(data)] == fresh
    for f in cached_files:
        f.write_bytes(b"\x00\x00\x00\x05garbage")
    assert [(h.rule.id, h.start) for h in Matcher(unit_rules).scan(data)] == fresh


def test_parsed_rule_files_are_cached_and_a_damaged_cache_only_costs_the_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib = tmp_path / "rules"
    lib.mkdir()
    (lib / "unit.toml").write_text(UNIT_RULES)

    def shape(rules: RuleSet) -> list[tuple[object, ...]]:
        return [(r.id, r.patterns, r.examples, r.counterexamples, r.severity) for r in rules]

    fresh = shape(load_rules(lib))
    cached = list((tmp_path / "cache" / "denpex").glob("rules-*.json"))
    assert len(cached) == 1
    assert shape(load_rules(lib)) == fresh
    cached[0].write_bytes(b"{not json")
    assert shape(load_rules(lib)) == fresh
    # a value JSON cannot carry exactly (a TOML date) is parsed every time, never cached
    (lib / "unit.toml").write_text(UNIT_RULES + "\n# touched\n")
    dated = tmp_path / "dated.toml"
    dated.write_text("when = 2026-12-01\n")
    assert _parse_toml(dated.read_bytes()) == {"when": datetime.date(2026, 12, 1)}
    assert len(list((tmp_path / "cache" / "denpex").glob("rules-*.json"))) == 1


def test_rule_patterns_compile_at_their_first_search(unit_rules: RuleSet) -> None:
    rule = unit_rules.get("python-traceback")
    assert rule is not None
    fresh = load_rules(Path(rule.source))
    pattern = fresh.get("python-traceback").regexes[0]  # type: ignore[union-attr]
    assert pattern._rx is None
    assert fresh.get("python-traceback").search("Traceback (most recent call last):") == {}  # type: ignore[union-attr]
    assert pattern._rx is not None


def test_fields_by_group_position_are_the_named_groups(library: RuleSet) -> None:
    """`Rule.search` pairs `Match.groups()` with the groups' names instead of asking for the
    named groups' dict (ten times slower on the `regex` engine): the same fields for every
    example line of the library, whichever pattern of its rule matched."""
    from denpex_agent.rules import convert_fields

    checked = 0
    for rule in library:
        for ex in rule.examples:
            text = ex if isinstance(ex, str) else ex.text
            for rx in rule.regexes:
                m = rx.search(text)
                if m is None:
                    continue
                got, want = rule.search(text), convert_fields(m.groupdict())
                assert repr(got) == repr(want), (rule.id, text)  # repr: a NaN field equals itself
                checked += 1
                break
    assert checked > 500


def test_line_numbers_of_hits_and_samples_whatever_their_order(unit_matcher: Matcher) -> None:
    lines = [
        f"2026-11-29 12:00:{i % 60:02d},000 INFO [rank0] step {i} | loss 1.0" if i % 3 else "Killed"
        for i in range(1, 400)
    ]
    data = ("\n".join(lines) + "\n").encode()
    for sizes in (None, [333], [5, 4096]):
        for ev in _scan(unit_matcher, data, sizes):
            assert lines[ev.line_no - 1] == ev.text, (sizes, ev.line_no)


def test_context_is_the_lines_right_before_the_event(unit_matcher: Matcher) -> None:
    lines = [f"2026-11-29 12:00:00,000 INFO [rank0] line {i}" for i in range(300)]
    data = ("\n".join(lines) + "\nKilled\n").encode()
    for sizes in (None, [1000], [7, 4096]):
        (ev,) = [e for e in _scan(unit_matcher, data, sizes, context_lines=100) if e.kind == "match"]
        assert ev.context == lines[-100:]
    (ev,) = [e for e in _scan(unit_matcher, b"a\nb\nKilled\n", None, context_lines=100) if e.kind == "match"]
    assert ev.context == ["a", "b"]


MERGED = (
    "[2023-12-11 16:39:34,450] [INFO] [logging.py:96:log_dist] [Rank 3] step=120, skipped=0, lr=[1e-05]\n"
    "[2023-12-11 16:39:35,112] [INFO] [logging.py:96:log_dist] [Rank 3] step=121, skipped=0, lr=[1e-05]\n"
    "Traceback (most recent call last):\n"
    '  File "train.py", line 88, in <module>\n'
    "    loss.backward()\n"
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
)


def test_an_unprefixed_traceback_takes_the_rank_its_stream_agrees_on(unit_matcher: Matcher) -> None:
    oom = next(e for e in _scan(unit_matcher, MERGED.encode()) if e.rule == "cuda-oom")
    assert oom.rank == 3
    # the lines before it name two ranks: no rank is guessed
    mixed = MERGED.replace("[Rank 3] step=121", "[Rank 5] step=121")
    oom = next(e for e in _scan(unit_matcher, mixed.encode()) if e.rule == "cuda-oom")
    assert oom.rank is None
    # prose that mentions a rank lends none
    prose = MERGED.replace("[Rank 3] ", "waiting for rank 3 ")
    oom = next(e for e in _scan(unit_matcher, prose.encode()) if e.rule == "cuda-oom")
    assert oom.rank is None


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=8))
def test_a_neighbours_rank_does_not_depend_on_read_sizes(unit_matcher: Matcher, sizes: list[int]) -> None:
    data = (MERGED * 3).encode()
    assert [_key(e) for e in _scan(unit_matcher, data, sizes)] == [_key(e) for e in _scan(unit_matcher, data)]


def _interleaved() -> bytes:
    # two workers' tracebacks through torchrun --tee, line by line interleaved (their real order
    # in tests/fixtures/jobs/norm_overflow_rms/node1/torchrun.log)
    a = [
        "[default0]:[rank0]: Traceback (most recent call last):",
        '[default0]:[rank0]:   File "train.py", line 9, in <module>',
        "[default0]:[rank0]: RuntimeError: loss scale reduced on 3 consecutive steps (now 512)",
    ]
    b = [
        "[default1]:[rank1]: Traceback (most recent call last):",
        '[default1]:[rank1]:   File "train.py", line 9, in <module>',
        "[default1]:[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    ]
    lines = [x for pair in zip(a, b, strict=True) for x in pair] + ["[default0]:done", "[default1]:done"]
    return ("\n".join(lines) + "\n").encode()


def test_interleaved_tracebacks_of_two_workers_are_two_records(unit_matcher: Matcher) -> None:
    events = [e for e in _scan(unit_matcher, _interleaved()) if e.kind == "match"]
    by_rank = {e.rank: e for e in events}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[1].rule == "cuda-oom"
    assert "RuntimeError" not in by_rank[1].text and "[default0]" not in by_rank[1].text
    assert "RuntimeError" in by_rank[0].text and "[default1]" not in by_rank[0].text


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=61), min_size=1, max_size=8))
def test_interleaved_records_do_not_depend_on_read_sizes(unit_matcher: Matcher, sizes: list[int]) -> None:
    data = _interleaved() * 2
    assert [_key(e) for e in _scan(unit_matcher, data, sizes)] == [_key(e) for e in _scan(unit_matcher, data)]


def _rdzv_lines() -> list[str]:
    """torchrun's own lines from a real run with LOGLEVEL=INFO (tests/fixtures/jobs/
    exception_rdzv_info, node2: group rank 1, local ranks 0 and 1 are global ranks 2 and 3)."""
    path = Path(__file__).resolve().parents[1] / "fixtures/jobs/exception_rdzv_info/node2/torchrun.log"
    lines = path.read_text().splitlines(keepends=True)
    block = [x for x in lines if "Rendezvous complete" in x or "_ranks=[" in x or "group_rank=" in x]
    failed = [x for x in lines if "failed (exitcode: 1) local_rank: 1" in x]
    assert len(block) >= 4 and len(failed) == 1
    return [*block, *failed]


def test_torchruns_rendezvous_result_maps_local_ranks_to_global(
    unit_matcher: Matcher, tmp_path: Path
) -> None:
    from denpex_agent.rules import load_rules

    matcher = Matcher(load_rules())
    lines = _rdzv_lines()
    data = "".join(lines).encode()
    failed = next(e for e in _scan(matcher, data) if e.kind == "match" and "exitcode" in e.fields)
    assert failed.fields["local_rank"] == 1 and failed.rank == 3
    # without the rendezvous result the line names only its local rank
    alone = next(e for e in _scan(matcher, lines[-1].encode()) if e.kind == "match")
    assert alone.rank is None
    # the same however the bytes were read
    for size in (7, 64, 333):
        got = [e for e in _scan(matcher, data, [size]) if e.kind == "match" and "exitcode" in e.fields]
        assert [e.rank for e in got] == [3]


_WATCHDOG_STACK = (
    "Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:609 (most recent "
    "call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7fbeb989ef86 in "
    "/opt/conda/lib/python3.11/site-packages/torch/lib/libc10.so)\n"
    "frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, "
    "std::ratio<1l, 1000l> > >) + 0x1d2 (0x7fbebab8bf22 in /opt/conda/lib/python3.11/site-packages/torch/lib/"
    "libtorch_cuda.so)\n"
    "frame #2: c10d::ProcessGroupNCCL::watchdogHandler() + 0x233 (0x7fbebab92963 in "
    "/opt/conda/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so)\n"
)


def test_a_watchdog_stack_is_one_timeout_with_or_without_its_heading(library: RuleSet) -> None:
    """The C++ stack of the NCCL watchdog belongs to the timeout printed above it (one event);
    when an excerpt lost the heading, the stack alone still says a collective timed out."""
    matcher = Matcher(library)
    heading = (
        "[rank1]:[E1129 10:00:03.000000 1 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 "
        "milliseconds before timing out.\n"
    )
    headed = [e for e in _scan(matcher, (heading + _WATCHDOG_STACK).encode()) if e.kind == "match"]
    assert [(e.rule, e.rank) for e in headed] == [("nccl-watchdog-timeout", 1)]
    assert "watchdogHandler" in headed[0].text  # the stack is part of the heading's event
    alone = [e for e in _scan(matcher, _WATCHDOG_STACK.encode()) if e.kind == "match"]
    assert [e.rule for e in alone] == ["nccl-watchdog-timeout"]


def test_a_chained_traceback_is_what_its_known_exception_is_not_its_second_heading(library: RuleSet) -> None:
    """A traceback chained to another ("During handling ...") is one record; its second
    "Traceback" heading is part of it, not a reason to call the record a generic exception when
    a signature knows one of its exception lines."""
    data = (
        b"[rank2]: Traceback (most recent call last):\n"
        b'[rank2]:   File "train.py", line 40, in step\n'
        b"[rank2]:     batch = next(it)\n"
        b"[rank2]: StopIteration\n"
        b"[rank2]: \n"
        b"[rank2]: During handling of the above exception, another exception occurred:\n"
        b"[rank2]: \n"
        b"[rank2]: Traceback (most recent call last):\n"
        b'[rank2]:   File "train.py", line 44, in step\n'
        b"[rank2]:     loss.backward()\n"
        b"[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        b"capacity of 79.15 GiB of which 1.06 GiB is free.\n"
        b"2026-11-29 10:00:02,000 INFO [rank0] after\n"
    )
    events = _matches(library, data)
    assert [(e.rule, e.rank) for e in events] == [("cuda-oom", 2)]
    assert "StopIteration" in events[0].text and "CUDA out of memory" in events[0].text


def _nccl_warn_ranks(library: RuleSet, text: str) -> list[int | None]:
    events = _scan(Matcher(library), text.encode())
    return [e.rank for e in events if e.kind == "match" and e.rule == "nccl-unhandled-cuda-error"]


def test_an_nccl_warning_takes_the_rank_its_process_stated(library: RuleSet) -> None:
    """A ``NCCL WARN`` carries only NCCL's ``host:pid:tid [dev]`` prefix; the same process's
    INFO lines said its rank before: a ring or channel link it sends on (the receiving end of a
    ``[receive]`` link), or its communicator's ``rank R nranks N`` (the largest communicator's
    rank when it is in several)."""
    links = (
        # Horovod over NCCL 2.3 (horovod/horovod#893): the rank on the sending side of a ring link
        "heinzel135:151780:151928 [2] NCCL INFO Ring 00 : 2[2] -> 3[3] via direct shared memory\n"
        "heinzel136:84299:84449 [0] NCCL INFO Ring 00 : 3 -> 4 [receive] via NET/IB/0\n"
        # NCCL 2.18 channels, a bus id or a device in brackets
        "tpgds-aihub0008:181411:181411 [0] NCCL INFO Channel 00/0 : 1[1] -> 8[0] [receive] via NET/IB/0/GDRDMA\n"
        "tesla-105:1480:2169 [2] NCCL INFO Channel 01 : 2[af000] -> 3[b1000] via P2P/IPC\n"
        "heinzel135:151780:151928 [2] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
        "heinzel136:84299:84449 [0] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
        "tpgds-aihub0008:181411:181413 [0] transport/p2p.cc:275 NCCL WARN Cuda failure 'invalid argument'\n"
        "tesla-105:1480:2170 [2] misc/shmutils.cc:103 NCCL WARN Cuda failure 'invalid argument'\n"
    )
    assert _nccl_warn_ranks(library, links) == [2, 4, 8, 2]
    comms = (
        "node7:2338:2379 [2] NCCL INFO comm 0x87952f0 rank 0 nranks 2 cudaDev 2 busId 3d000 - Init COMPLETE\n"
        "node7:2338:2379 [2] NCCL INFO ncclCommInitRank comm 0x8df0a00 rank 6 nranks 8 cudaDev 2 nvmlDev 2 "
        "busId 3d000 commId 0x5e1c - Init COMPLETE\n"
        "node7:2338:2379 [2] NCCL INFO comm 0x87952f0 rank 1 nranks 4 cudaDev 2 busId 3d000 - Init COMPLETE\n"
        "node7:2338:2390 [2] transport/nvls.cc:157 NCCL WARN Cuda failure 1 'invalid argument'\n"
    )
    assert _nccl_warn_ranks(library, comms) == [6]


def test_an_nccl_process_that_states_no_single_rank_gives_none(library: RuleSet) -> None:
    """One process driving several GPUs (nccl-tests ``-g 8``) states several ranks in equal
    communicators; a warning printed before the process said anything gets none either."""
    text = (
        "h100-1:9821:9821 [0] top.cc:1 NCCL WARN Cuda failure 'invalid argument'\n"
        "nf5688m7-1:422771:422771 [0] NCCL INFO comm 0x5598478a4d90 rank 1 nranks 8 cudaDev 1 busId 34000 - Init "
        "COMPLETE\n"
        "nf5688m7-1:422771:422771 [0] NCCL INFO comm 0x5598478aaae0 rank 2 nranks 8 cudaDev 2 busId 48000 - Init "
        "COMPLETE\n"
        "h100-1:9821:9821 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n"
        "nf5688m7-1:422771:422790 [0] init.cc:416 NCCL WARN Cuda failure 'operation not supported'\n"
    )
    assert _nccl_warn_ranks(library, text) == [None, None]


# Two processes of host gpu-b state their world ranks on their devices (rank = device + 8); a third,
# whose own INFO lines the log lost, warns on device 3.
HOST_OFFSET = (
    "gpu-b:501:520 [0] NCCL INFO comm 0x55a1 rank 8 nranks 16 cudaDev 0 busId 5000 - Init COMPLETE\n"
    "gpu-b:502:521 [1] NCCL INFO comm 0x55a2 rank 9 nranks 16 cudaDev 1 busId 6000 - Init COMPLETE\n"
    "gpu-b:504:530 [3] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
)


def test_an_nccl_process_that_stated_nothing_takes_its_device_plus_its_host_s_offset(
    library: RuleSet,
) -> None:
    """Ranks are laid out a process per device, node by node: when two or more processes of a host
    agree on rank - device in the world's communicator, a process of that host that never stated
    its rank (its INFO lines cut from the log) is its device plus that offset."""
    assert _nccl_warn_ranks(library, HOST_OFFSET) == [11]
    # the offset of the largest communicator: a tensor-parallel group's ranks are not the world's
    tp = HOST_OFFSET.replace(
        "gpu-b:504:530",
        "gpu-b:501:522 [0] NCCL INFO comm 0x66b1 rank 0 nranks 2 cudaDev 0 busId 5000 - Init COMPLETE\n"
        "gpu-b:502:523 [1] NCCL INFO comm 0x66b2 rank 1 nranks 2 cudaDev 1 busId 6000 - Init COMPLETE\n"
        "gpu-b:504:530",
    )
    assert _nccl_warn_ranks(library, tp) == [11]


def test_an_nccl_host_without_one_offset_names_no_rank(library: RuleSet) -> None:
    """No guess where the host's processes do not agree (each sees its GPU as device 0, so rank -
    device differs), where only one process said anything, or on another host."""
    one_device_each = (
        "gpu-c:601:620 [0] NCCL INFO comm 0x1 rank 4 nranks 8 cudaDev 0 busId 5000 - Init COMPLETE\n"
        "gpu-c:602:621 [0] NCCL INFO comm 0x2 rank 5 nranks 8 cudaDev 0 busId 6000 - Init COMPLETE\n"
        "gpu-c:603:630 [0] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
    )
    assert _nccl_warn_ranks(library, one_device_each) == [None]
    alone = HOST_OFFSET.split("\n", 1)[1]  # gpu-b's rank 9 alone
    assert _nccl_warn_ranks(library, alone) == [None]
    elsewhere = HOST_OFFSET.replace("gpu-b:504:530", "gpu-a:504:530")
    assert _nccl_warn_ranks(library, elsewhere) == [None]
    # a warning before the host's processes said anything
    first = HOST_OFFSET.rsplit("\n", 2)[-2] + "\n" + HOST_OFFSET
    assert _nccl_warn_ranks(library, first) == [None, 11]


@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=12))
@settings(max_examples=40, deadline=None)
def test_an_nccl_host_s_offset_does_not_depend_on_read_sizes(sizes: list[int]) -> None:
    text = HOST_OFFSET.encode()
    matcher = _MATCHER_CACHE.setdefault("lib", Matcher(load_rules()))
    assert [_key(e) for e in _scan(matcher, text, sizes)] == [_key(e) for e in _scan(matcher, text)]


@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=12))
@settings(max_examples=40, deadline=None)
def test_nccl_process_ranks_do_not_depend_on_read_sizes(sizes: list[int]) -> None:
    lib = load_rules()
    text = (
        b"heinzel135:151780:151928 [2] NCCL INFO Ring 00 : 2[2] -> 3[3] via direct shared memory\n"
        b"heinzel135:151779:151929 [1] NCCL INFO Ring 00 : 1[1] -> 2[2] via direct shared memory\n"
        b"heinzel135:151780:151928 [2] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
        b"heinzel135:151779:151929 [1] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
    )
    whole = [_key(e) for e in _scan(_MATCHER_CACHE.setdefault("lib", Matcher(lib)), text)]
    cut = [_key(e) for e in _scan(_MATCHER_CACHE["lib"], text, sizes)]
    assert cut == whole
    assert [k[4] for k in whole if k[1] == "nccl-unhandled-cuda-error"] == [2, 1]


_MATCHER_CACHE: dict[str, Matcher] = {}


# A traceback posted or logged without its exception line: the frames, then another program's line
# or a log line. That line is not the traceback's exception (the record ends at the last frame), and
# it is read on its own (here: the NCCL watchdog's timeout, an error of its own).
CUT_OFF = (
    b"Traceback (most recent call last):\n"
    b'  File "/home/u/models/detr.py", line 637, in forward\n'
    b"    torch.distributed.all_reduce(num_boxes)\n"
    b'  File "/opt/conda/lib/python3.9/site-packages/torch/distributed/distributed_c10d.py", line 1320, in all_reduce\n'
    b"    work = default_pg.allreduce([tensor], opts)\n"
    b"[rank1]:[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=86645, "
    b"OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1804483 milliseconds before timing out.\n"
    b"Unable to determine the device handle for GPU 0000:1C:00.0: Unknown Error\n"
)


@given(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=8))
@settings(max_examples=40, deadline=None)
def test_a_traceback_cut_off_before_its_exception_ends_at_its_last_frame(
    library: RuleSet, sizes: list[int]
) -> None:
    events = _matches(library, CUT_OFF, sizes)
    assert [(e.rule, e.rank) for e in events] == [
        ("python-traceback", None),
        ("nccl-watchdog-timeout", 1),
        ("nvml-gpu-lost", 1),
    ]
    cut = events[0]
    assert cut.text.rstrip().endswith("work = default_pg.allreduce([tensor], opts)")
    assert "exception" not in cut.fields and "Watchdog" not in cut.text


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: NCCL communicator was aborted on rank 1.",
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275",
        "KeyboardInterrupt",
        "_pickle.UnpicklingError: pickle data was truncated",
    ],
)
def test_an_exception_line_after_the_frames_still_closes_the_traceback(library: RuleSet, line: str) -> None:
    data = CUT_OFF[: CUT_OFF.index(b"[rank1]")] + line.encode() + b"\n2026-11-29 10:00:02,000 INFO after\n"
    events = _matches(library, data)
    assert len(events) == 1 and events[0].text.rstrip().endswith(line)


# A log that begins inside a traceback (rotated, cut or pasted mid-way): frames, then the exception.
HEADLESS = (
    b'[rank0]:   File "/venv/lib/python3.10/site-packages/torch/cuda/random.py", line 85, in set_rng_state_all\n'
    b"[rank0]:     set_rng_state(state, i)\n"
    b'[rank0]:   File "/venv/lib/python3.10/site-packages/torch/cuda/random.py", line 72, in cb\n'
    b"[rank0]:     default_generator = torch.cuda.default_generators[idx]\n"
    b"[rank0]: IndexError: tuple index out of range\n"
    b"W1215 23:03:38.333000 1 torch/distributed/elastic/multiprocessing/api.py:858] Sending process 5193 "
    b"closing signal SIGTERM\n"
)


@given(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=8))
@settings(max_examples=40, deadline=None)
def test_a_traceback_without_its_header_is_one_exception_whatever_the_read_sizes(
    library: RuleSet, sizes: list[int]
) -> None:
    events = _matches(library, HEADLESS, sizes)
    failures = [e for e in events if e.severity == "error"]
    assert [(e.rule, e.rank, e.line_no) for e in failures] == [("python-traceback-headless", 0, 1)]
    assert failures[0].fields["exception"] == "IndexError: tuple index out of range"
    assert failures[0].text.rstrip().endswith("IndexError: tuple index out of range")


def test_a_headless_traceback_is_what_its_known_exception_is(library: RuleSet) -> None:
    data = (
        b'  File "train.py", line 44, in step\n'
        b"    loss.backward()\n"
        b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    events = _matches(library, data)
    assert [e.rule for e in events] == ["cuda-oom"]


@pytest.mark.parametrize(
    "after",
    [
        b"2026-11-29 10:00:02,000 INFO step 7 | loss 2.0\n",  # traceback.print_stack(), then the log goes on
        b"Killed\n",  # a word that could be a class name is not an exception line without a header
    ],
)
def test_frames_without_an_exception_are_no_failure_and_hide_nothing(library: RuleSet, after: bytes) -> None:
    stack = b'  File "train.py", line 3, in <module>\n    main()\n  File "train.py", line 9, in main\n    dump()\n'
    for data in (stack + after, b"Stack (most recent call first):\n" + stack + after):
        events = _matches(library, data)
        assert not any(e.rule and e.rule.startswith("python-traceback") for e in events)
        assert [e.rule for e in events] == (["bare-killed"] if after == b"Killed\n" else [])


def test_a_whole_traceback_is_one_record_not_one_per_frame(library: RuleSet) -> None:
    data = b"[rank0]: Traceback (most recent call last):\n" + HEADLESS[: HEADLESS.index(b"W1215")]
    events = _matches(library, data)
    assert [(e.rule, e.line_no) for e in events] == [("python-traceback", 1)]


# The end of torchrun's summary as a log that lost its start keeps it: the root-cause heading, the
# entry (fields as torchrun prints them, here a worker that exited with 1), the closing rule.
HEADLESS_SUMMARY = (
    b"------------------------------------------------------------\n"
    b"Root Cause (first observed failure):\n"
    b"[0]:\n"
    b"  time      : 2026-11-29_12:00:05\n"
    b"  host      : gpu-node-7\n"
    b"  rank      : 0 (local_rank: 0)\n"
    b"  exitcode  : 1 (pid: 39886)\n"
    b"  error_file: <N/A>\n"
    b"  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
    b"============================================================\n"
    b"Killed\n"
)


@given(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=8))
@settings(max_examples=40, deadline=None)
def test_a_summary_without_its_childfailederror_line_is_one_failure_whatever_the_read_sizes(
    library: RuleSet, sizes: list[int]
) -> None:
    events = _matches(library, HEADLESS_SUMMARY, sizes)
    assert [(e.rule, e.line_no) for e in events] == [
        ("elastic-failure-summary-headless", 2),
        ("bare-killed", 11),
    ]
    fields = events[0].fields
    assert fields["exitcode"] == 1 and fields["host"] == "gpu-node-7"
    # the failures listed before the heading are lost: torchrun's pick among those of the same
    # second cannot be checked, so the headless summary names no rank
    assert "culprit_rank" not in fields and "culprit_local_rank" not in fields


def test_a_headless_summary_ends_at_the_first_line_that_is_not_its_entry(library: RuleSet) -> None:
    cut = HEADLESS_SUMMARY[: HEADLESS_SUMMARY.index(b"=====")]  # its closing rule lost too
    data = cut + b"RuntimeError: CUDA error: an illegal memory access was encountered\n"
    events = _matches(library, data)
    assert [e.rule for e in events] == ["elastic-failure-summary-headless", "illegal-memory-access"]


def test_a_whole_summarys_root_cause_heading_is_no_event_of_its_own(library: RuleSet) -> None:
    events = _matches(library, LOG.encode())
    assert "elastic-failure-summary-headless" not in [e.rule for e in events]
    summary = next(e for e in events if e.rule == "elastic-child-failed")
    assert summary.fields["culprit_rank"] == 3  # a whole summary still names its root cause
