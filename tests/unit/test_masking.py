from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from denpex_agent import masking
from denpex_agent.masking import mask


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("connect mqtt://agent:s3cr3t@broker:1883 ok", "s3cr3t"),
        ("HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123456789", "hf_abcdefghijklmnopqrstuvwxyz0123456789"),
        ("Authorization: Bearer abcdefghijk123", "abcdefghijk123"),
        ('{"password": "hunter2"}', "hunter2"),
        ("aws AKIAABCDEFGHIJKLMNOP", "AKIAABCDEFGHIJKLMNOP"),
        ("api_key=abc123 next", "abc123"),
        ("AWS_SECRET_ACCESS_KEY=xyz", "xyz"),
        ("wandb: token: 0123456789abcdef", "0123456789abcdef"),
        ("openai sk-abcdefghijklmnopqrstuvwx", "sk-abcdefghijklmnopqrstuvwx"),
    ],
)
def test_secrets_are_masked(text: str, secret: str) -> None:
    out = mask(text)
    assert secret not in out
    assert "***" in out


@pytest.mark.parametrize(
    "text",
    [
        "2026-11-29 12:00:01,123 INFO [rank3] step 17 | loss 2.3 | tokens/s 51234",
        "max_tokens=4096 vocab 32000",
        "init_process_group(backend=nccl, timeout=0:30:00, world_size=32)",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0.",
    ],
)
def test_ordinary_lines_are_untouched(text: str) -> None:
    assert mask(text) == text


def _mask_everything(text: str) -> str:
    for rx, repl in masking._PATTERNS:
        text = rx.sub(repl, text)
    return text


_FRAGMENTS = [
    "step 12 loss 2.5",
    "Bearer\u00a0abcdefghij12",
    "BASIC\tQWxhZGRpbjpvcGVu",
    "mqtts://User:pw@host",
    "Api-Key = 'v4lue'",
    "TOKEN:x",
    "\u212aey=1",
    "to\u212aen=x",
    "ghs_" + "a" * 30,
    "xoxb-1234567890",
    "akia" + "A" * 16,
    "AKIA" + "B" * 16,
    "sk-" + "z" * 25,
    "passwd=é",
    " ",
    "\n",
    "é",
    "\udcff",
]


@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=12), st.text(max_size=40))
def test_quick_check_never_skips_a_masked_text(parts: list[str], noise: str) -> None:
    """The cheap pre-check (hyperscan, or re on lowercased text) only skips texts that the full
    substitutions would leave unchanged."""
    text = "".join(parts) + noise
    assert mask(text) == _mask_everything(text)
    assert masking.mask_lines(text.split("\n")) == _mask_everything(text).split("\n")


def test_fallback_quick_check_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = ["step 1 loss 2", "Bearer abcdefghij12", "x hf_" + "a" * 31, "pwd", "plain text"]
    fast = [masking._may_hold_secret(t) for t in texts]
    monkeypatch.setattr(masking, "HAVE_HYPERSCAN", False)
    assert [masking._may_hold_secret(t) for t in texts] == fast == [False, True, True, True, False]
