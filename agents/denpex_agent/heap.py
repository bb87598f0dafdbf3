"""Keep the C heap's freed memory in a process that reads big files chunk by chunk.

`diagnose` reads each file in 1 MiB chunks and joins a chunk to the partial line before it:
about 2 MiB of short-lived buffers per chunk. glibc's malloc, with its default dynamic
thresholds, serves buffers of that size from the top of the heap and gives the top back to the
kernel (``trim``) as soon as more than twice the largest such buffer lies free there, that is
after nearly every chunk: each new chunk then faults its pages in again. On a 1 GiB job that is
about 240,000 minor page faults and most of the process's system time (bench/README.md).

`keep_freed_memory` sets two of malloc's documented tunables (``mallopt(3)``, glibc's public
API, reached through `ctypes`): buffers below ``mmap_threshold`` come from the heap, and the heap
is trimmed only once ``trim_threshold`` lies free at its top. The process's peak memory is
unchanged (the same buffers are reused); it only returns its memory to the kernel later. Where
there is no glibc (musl, macOS, Windows), nothing is done.
"""

from __future__ import annotations

import ctypes
import sys

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 64 << 20
MMAP_THRESHOLD = 32 << 20  # glibc's own upper bound for the dynamic threshold on 64-bit


def keep_freed_memory(trim_threshold: int = TRIM_THRESHOLD, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Tune glibc's malloc as the module's docstring says; True when it took the settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        # glibc's own symbol, not a compatible one: musl's mallopt accepts and ignores anything
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # both, in this order: setting either one turns glibc's dynamic adjustment of both off
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
