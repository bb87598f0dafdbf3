from __future__ import annotations

import pytest

from denpex_agent.attribution import (
    Attribution,
    Layout,
    attribute_path,
    dominant_rank,
    line_rank,
    strip_prefix,
)
from denpex_agent.errors import LayoutError


@pytest.mark.parametrize(
    ("rel", "want"),
    [
        ("node1/rank3.log", Attribution("node1", 3, None)),
        ("host-a/3.log", Attribution("host-a", 3, None)),
        ("host-a/3.log.1", Attribution("host-a", 3, None)),
        ("node2/torchrun_logs/run/attempt_0/1/stdout.log", Attribution("node2", None, 1)),
        ("node2/torchrun_logs/run/attempt_3/0/stderr.log", Attribution("node2", None, 0)),
        ("gpu7-rank12.log", Attribution("gpu7", 12, None)),
        ("rank5.txt", Attribution("local", 5, None)),
        ("node1/torchrun.log", Attribution("node1", None, None)),
    ],
)
def test_built_in_layouts(rel: str, want: Attribution) -> None:
    assert attribute_path(rel) == want


def test_layout_template() -> None:
    lay = Layout("{node}/logs/{any}-r{rank}.log")
    assert lay.match("n7/logs/2026-11-29-r12.log") == Attribution("n7", 12, None)
    assert lay.match("n7/logs/2026-11-29-r12.log.3") == Attribution("n7", 12, None)
    assert lay.match("n7/other/x-r1.log") is None
    with pytest.raises(LayoutError):
        Layout("{node}/{bogus}.log")
    with pytest.raises(LayoutError):
        Layout("/abs/{rank}.log")


def test_line_prefixes() -> None:
    assert line_rank("[rank3]: Traceback (most recent call last):") == (3, None)
    assert line_rank("[default1]:[rank5]:   File 'x'") == (5, 1)
    assert line_rank("[default2]:hello") == (None, 2)
    assert line_rank("2026-11-29 12:00:00,000 INFO [rank7] step 1") == (7, None)
    assert line_rank("[Rank 4] Watchdog caught collective operation timeout") == (4, None)
    assert line_rank("plain") == (None, None)
    assert strip_prefix("[default1]:[rank5]:   File 'x'") == "  File 'x'"


def test_dominant_rank() -> None:
    assert dominant_rank(b"[rank2] a\n[rank2] b\n" * 20) == 2
    assert dominant_rank(b"[rank2] a\n[rank3] b\n" * 20) is None
    assert dominant_rank(b"nothing") is None
