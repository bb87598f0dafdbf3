from __future__ import annotations

import pytest

from denpex_agent.attribution import (
    Attribution,
    Layout,
    attribute_path,
    dominant_rank,
    line_rank,
    strip_prefix,
    tee_echo,
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


# Every prefix form with a line as real launchers and frameworks print it (the source in the
# comment). Expected: (global rank, local rank) and the text left after the prefixes.
REAL_PREFIXES = [
    # PyTorch's own prefix (github.com/hiyouga/LlamaFactory/issues/5769)
    (
        "[rank2]: frame #4: c10d::TCPStore::get(std::string const&) + 0x7a (0x7fdfeab5883a in "
        "/home/user/enter/envs/train/lib/python3.10/site-packages/torch/lib/libtorch_cpu.so)",
        (2, None),
        "frame #4: c10d::TCPStore::get(",
    ),
    # torchrun --tee around it (recorded by tests/fixtures/make_jobs.py)
    ("[default0]:[rank1]: Traceback (most recent call last):", (1, 0), "Traceback (most recent"),
    # OpenMPI --tag-output: [jobid,rank] (github.com/open-mmlab/mmcv/issues/1240)
    (
        "[1,3]<stderr>:2021-08-04 11:52:22,414 - mmdet - INFO - Epoch [1][7400/14659]\tlr: 1.000e-02",
        (3, None),
        "2021-08-04 11:52:22,414 - mmdet",
    ),
    # ... with OpenMPI's own [host:pid] after it: a process id, not a rank
    # (github.com/horovod/horovod/issues/1029)
    (
        "[1,0]<stderr>:[939debe34dff:00468] Read -1, expected 6441, errno = 1",
        (0, None),
        "[939debe34dff:00468] Read -1",
    ),
    # horovodrun: [rank] (github.com/horovod/horovod/pull/3827)
    ("[1]<stdout>:test_common.py::CommonTests::test_gloo_built PASSED", (1, None), "test_common.py"),
    # a collector's timestamp before the MPI tag (a log shipper's capture of an mpirun job)
    (
        "2026-08-03T09:47:01Z [1,0]<stderr>:Traceback (most recent call last):",
        (0, None),
        "Traceback (most recent call last):",
    ),
    # srun --label (-l): the task number (Slurm reference manual, --multi-prog example output)
    ("4: alc20.llnl.gov", (4, None), "alc20.llnl.gov"),
    # DeepSpeed's log_dist: [Rank N] after the logger's own brackets (DeepSpeed runtime, fp16 loss scaler)
    (
        "[2023-12-11 16:39:34,450] [INFO] [logging.py:96:log_dist] [Rank 0] Overflow detected. "
        "Skipping step. Attempted loss scale: 65536, reducing to 32768.0",
        (0, None),
        None,
    ),
    # Lightning's rank_prefixed_message: [rank: N] (github.com/nishantb06/imagenet, README.md)
    (
        "[rank: 2] Child process with PID 13117 terminated with code -6. Forcefully terminating all other "
        "processes to avoid zombies 🧟",
        (2, None),
        "Child process with PID 13117",
    ),
    # PMIx's [host:pid] alone names no rank (github.com/karpathy/llm.c/pull/426)
    (
        "[qbd487:400139] PMIX ERROR: ERROR in file ../../../../../../src/mca/gds/ds12/gds_ds12_lock_pthread.c at line 169",
        (None, None),
        None,
    ),
]


@pytest.mark.parametrize(("line", "want", "rest"), REAL_PREFIXES)
def test_real_prefix_forms(line: str, want: tuple[int | None, int | None], rest: str | None) -> None:
    assert line_rank(line) == want
    stripped = strip_prefix(line)
    if rest is None:
        assert stripped == line
    else:
        assert stripped.startswith(rest)


def test_nested_prefixes_before_the_rank_tag() -> None:
    # a job-step tag (Megatron under a pipeline runner) and a collector's timestamp
    assert line_rank("i.pretrain/0 [default2]:[rank2]: torch.OutOfMemoryError: CUDA out of memory.") == (2, 2)
    assert line_rank("2024-05-02T10:01:02.123456789Z [default3]:[rank11]: Traceback") == (11, 3)
    # srun --label around torchrun --tee: the srun number is the node's task, the tag a local rank
    assert line_rank('1: [default2]:  File "train.py", line 3') == (None, 2)
    assert line_rank(" 12: [rank7]: RuntimeError: boom") == (7, None)
    # a logger's file:line is not a host:rank, and prose is not a prefix
    assert line_rank("[train.py:42] loss is nan") == (None, None)
    assert (
        strip_prefix("2026-11-29 12:00:00,000 INFO [rank7] step 1")
        == "2026-11-29 12:00:00,000 INFO [rank7] step 1"
    )


def test_only_a_strong_prefix_beats_the_files_rank() -> None:
    from denpex_agent.attribution import has_prefix

    assert has_prefix("[rank3]: x") and has_prefix("[1,3]<stderr>:x") and has_prefix("[gpu-node-3:12] x")
    assert not has_prefix("3: x")  # a bare srun number may be anybody's text
    assert not has_prefix("[Rank 3] x")


def test_a_tee_echo_is_known_behind_a_collectors_timestamp_or_task_label() -> None:
    assert tee_echo("[default1]:[rank3]: RuntimeError: boom")
    assert tee_echo("2026-11-29T12:00:00.123Z [default0]:2026-11-29 12:00:00,100 ERROR [rank2] boom")
    assert tee_echo("i.pretrain/0 [default2]:[rank2]: boom")
    assert tee_echo(" 1: [default0]:Traceback (most recent call last):")
    assert not tee_echo("[rank3]: RuntimeError: boom")
    assert not tee_echo("2026-11-29 12:00:00,100 ERROR [default0] is a queue name here")


def test_lightnings_rank_prefix() -> None:
    from denpex_agent.attribution import has_prefix, stream_key

    # the launcher's report of a child names the child's rank, which beats the file's (rank 0 wrote it)
    line = "[rank: 1] Child process with PID 224779 terminated with code 1. Forcefully terminating"
    assert line_rank(line) == (1, None) and has_prefix(line)
    assert strip_prefix(line).startswith("Child process") and stream_key(line) != stream_key("[rank: 2] x")
    # behind a logger's level, as `logging.basicConfig` prints it
    assert line_rank("INFO: [rank: 3] Child process with PID 9487 terminated with code -9.") == (3, None)
    # behind a logger name too long to be a prefix token: a rank the text names, not a prefix
    long_lead = (
        "INFO     lightning.fabric.strategies.launchers.subprocess_script:subprocess_script.py:224 "
        "[rank: 1] Child process with PID 2977 terminated with code 4."
    )
    assert line_rank(long_lead) == (1, None) and not has_prefix(long_lead)
    # prose about a rank is no tag
    assert line_rank("waiting for rank: 3 to join") == (None, None)
