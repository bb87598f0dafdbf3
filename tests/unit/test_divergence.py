"""Templates of real lines, and the comparison with a control on the recorded jobs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.reader import ReadReport, discover
from denpexd import divergence
from denpexd.report import render_text
from denpexd.templates import Templater, template

JOBS = Path(__file__).resolve().parents[1] / "fixtures" / "jobs"
NODES = ("node1", "node2", "node3", "node4", "host-a", "host-b")


def _line(rel: str, number: int) -> str:
    return (JOBS / rel).read_text(encoding="utf-8").splitlines()[number - 1]


def _grep(rel: str, needle: str) -> list[str]:
    return [x for x in (JOBS / rel).read_text(encoding="utf-8").splitlines() if needle in x]


def _tpl(line: str) -> str | None:
    return template(line, NODES)


def test_step_lines_with_other_numbers_share_a_template() -> None:
    a, b = _line("healthy/node1/rank0.log", 3), _line("healthy/node2/rank1.log", 30)
    assert a != b
    assert _tpl(a) == _tpl(b) == "INFO step <n> | loss <n> | grad_norm <n> | data_time <n>"


def test_numbers_pids_ranks_nodes_and_world_size_are_masked() -> None:
    healthy = _line("healthy/node3/rank2.log", 1)  # node3, rank 2 of 3, its pid
    other = _line("alloc_fail/host-b/rank3.log", 1)  # host-b, rank 3 of 4, another pid
    assert "world_size=3" in healthy and "world_size=4" in other
    expected = "INFO starting: node=<node> rank=<n> local_rank=<n> world_size=<n> pid=<n> torch=<n>.<n>+cpu"
    assert _tpl(healthy) == _tpl(other) == expected


def test_torchrun_start_up_chatter_of_two_runs_maps_equal() -> None:
    for needle in ("Setting OMP_NUM_THREADS", "Sending process"):
        lines = _grep("hang/node1/torchrun.log", needle) + _grep(
            "exception_rdzv_info/node2/torchrun.log", needle
        )
        lines += _grep("slow_rank/node2/torchrun.log", needle)
        assert len({x.split("]")[0] for x in lines}) > 1  # other times and pids
        assert len({_tpl(x) for x in lines}) == 1, lines


def test_ports_run_ids_and_paths_are_masked() -> None:
    log = "exception_rdzv_info/node1/torchrun.log"
    assert _tpl(_grep(log, "rdzv_endpoint")[0]) == "INFO rdzv_endpoint : <ip>"
    assert _tpl(_grep(log, "master_port=")[0]) == "INFO master_port=<n>"
    assert _tpl(_grep(log, "run_id ")[0]) == "INFO run_id : <id>"
    assert _tpl(_grep(log, "log_dir ")[0]) == "INFO log_dir : <path>"
    assert _tpl(_grep(log, "global_ranks=")[0]) == "INFO global_ranks=[<n>]"
    closed = _grep("alloc_fail/host-a/rank0.log", "Connection closed by peer")[0]
    assert "[<path>:<n>] Connection closed by peer [<ip>]:<n>." in str(_tpl(closed))


def test_rank_prefixes_and_the_record_header_are_removed() -> None:
    tee = _grep("exception/node3/torchrun.log", "training failed")[0]  # [default0]:2026-… ERROR [rank2] …
    own = _grep("exception/node3/torchrun_logs/denpex-exception/attempt_0/0/stderr.log", "training failed")[0]
    assert tee.startswith("[default0]:") and not own.startswith("[default0]:")
    assert _tpl(tee) == _tpl(own) == "ERROR training failed at step <n>: KeyError: 'shard-<n>'"
    torch_prefixed = _grep("nan_fp16/node1/rank0.log", "[rank0]: Traceback")[0]
    assert _tpl(torch_prefixed) == "Traceback (most recent call last):"
    # one message in three record formats: ISO + "[rank0] INFO", logging + "INFO [rank0]", Megatron's
    starts = [_line(f"{job}/node1/rank0.log", 2) for job in ("healthy", "barrier_timeout", "nan_fp16")]
    assert len(set(starts)) == 3
    assert {_tpl(x) for x in starts} == {"INFO process group initialised: backend=gloo timeout=<dur>"}


def test_a_nan_loss_is_a_new_template() -> None:
    nan = _grep("norm_overflow_ln/node1/rank0.log", "loss nan")[0]
    finite = _line("norm_overflow_ln/node1/rank0.log", 3)
    assert _tpl(nan) != _tpl(finite)
    assert "loss nan" in str(_tpl(nan))


def test_lines_with_nothing_to_compare_are_skipped() -> None:
    rules = _grep("hang/node1/torchrun.log", "*****")
    empty_glog = [
        x for x in (JOBS / "hang/node1/torchrun.log").read_text().splitlines() if x.endswith("874] ")
    ]
    assert rules and empty_glog
    for line in [*rules, *empty_glog, "", "   ", "[rank3]: ", "12 34.5", "INFO"]:
        assert _tpl(line) is None, line


def test_a_template_depends_on_the_line_alone() -> None:
    lines = []
    for job in ("hang", "nan_fp16", "exception_rdzv_info"):
        for path in sorted((JOBS / job).rglob("*.log")):
            lines += path.read_bytes().split(b"\n")
    fresh = [Templater(NODES)(x) for x in lines]
    shuffled = list(range(len(lines)))
    random.Random(7).shuffle(shuffled)
    warm = Templater(NODES)
    seen = {i: warm(lines[i]) for i in shuffled}
    assert [seen[i] for i in range(len(lines))] == fresh


def test_long_lines_and_carriage_returns(tmp_path: Path) -> None:
    p = tmp_path / "rank0.log"
    p.write_bytes(b"first\r\n" + b"x" * (3 * divergence.CHUNK) + b"\nlast line\nno newline at the end")
    warnings: list[str] = []
    lines = list(divergence.read_lines(p, warnings))
    assert lines == [b"first", b"x" * divergence.MAX_LINE, b"last line", b"no newline at the end"]
    assert len(warnings) == 1 and "1 line(s) longer than" in warnings[0]


def _files(*paths: Path) -> list[divergence.Source]:
    return divergence.file_sources(discover([str(p) for p in paths], None, ReadReport()))


def _compare(failed: Path, *control: Path, clock: dict[str, Any] | None = None) -> dict[str, Any]:
    ctl_sources = _files(*control)
    ctl = divergence.read_control(ctl_sources, {s.node for s in ctl_sources})
    sources = _files(failed)
    return divergence.divergence(sources, {s.node for s in sources}, ctl, dict(clock or {}))


def test_a_run_against_itself_does_not_diverge() -> None:
    d = _compare(JOBS / "healthy", JOBS / "healthy")
    assert d["first"] is None and d["per_rank"] == []
    assert d["control"] == {"files": 6, "lines": 99, "templates": 4, "launcher_lines": 0}


def test_the_failed_ranks_first_new_lines() -> None:
    d = _compare(JOBS / "alloc_fail", JOBS / "healthy")
    per_rank = d["per_rank"]
    assert [(e["node"], e["rank"], e["line"]) for e in per_rank] == [
        ("host-b", 2, 17),
        ("host-a", 1, 17),
        ("host-b", 3, 17),
        ("host-a", 0, 17),
    ]
    assert "DefaultCPUAllocator: can't allocate memory" in per_rank[0]["text"]
    assert per_rank[0]["time"] == "2026-11-29T20:19:02.160Z"


def test_launcher_lines_count_only_against_a_control_with_launcher_lines() -> None:
    without = _compare(JOBS / "hang", JOBS / "healthy")  # healthy's torchrun.log files are empty
    with_launchers = _compare(JOBS / "hang", JOBS / "slow_rank")
    assert all(e["rank"] is not None for e in without["per_rank"])
    launchers = [e for e in with_launchers["per_rank"] if e["rank"] is None]
    assert {e["node"] for e in launchers} == {"node1", "node2"}
    assert all("closing signal SIGTERM" in e["text"] for e in launchers)


def test_the_report_shows_the_first_eight_ranks() -> None:
    entry = {"node": "n", "time": "2026-11-29T20:00:00.000Z", "file": "f.log", "line": 3, "text": "boom"}
    div = {
        "first": {**entry, "rank": 0},
        "per_rank": [{**entry, "rank": r} for r in range(11)],
        "control": {"files": 2, "lines": 40, "templates": 5},
    }
    text = render_text({"job": "j", "verdict": "failed", "divergence": div})
    section = text.split("FIRST DIVERGENCE FROM THE HEALTHY RUN")[1]
    assert "node n rank 7 " in section and "node n rank 8 " not in section
    assert "+3 more" in section
    nothing = render_text(
        {"job": "j", "verdict": "failed", "divergence": {**div, "first": None, "per_rank": []}}
    )
    assert "none       every line's template occurs in the healthy run" in nothing


@pytest.mark.parametrize("job", ["healthy", "slow_rank"])
def test_runs_that_only_say_what_a_healthy_run_says(job: str) -> None:
    assert _compare(JOBS / job, JOBS / "healthy")["first"] is None


def test_the_control_keeps_a_bounded_number_of_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(divergence, "MAX_TEMPLATES", 2)
    d = _compare(JOBS / "healthy", JOBS / "healthy")
    assert d["control"]["templates"] == 2 and d["control"]["templates_not_kept"] > 0
    assert any("more than 2 distinct templates" in w for w in d["warnings"])
    assert d["first"] is not None  # what was not kept counts as new
