from __future__ import annotations

import pytest

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
