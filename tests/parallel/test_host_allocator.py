"""moestack.host_allocator: freed large host blocks go back to the OS (glibc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from moestack import host_allocator
from moestack.config import ParallelConfig

# A child process: one 8 MiB block freed (glibc then raises its threshold to 8 MiB), then 96
# blocks of 1 MiB, freed but the last (which pins the heap's top): the anonymous memory still
# resident, in MiB, with and without the fixed threshold.
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from moestack import host_allocator

    def anon_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024

    taken = host_allocator.set_mmap_threshold(128 << 10) if sys.argv[1] == "on" else False
    big = torch.ones(2 << 20)  # 8 MiB
    del big
    start = anon_mib()
    blocks = [torch.ones(256 << 10) for _ in range(96)]  # 1 MiB each, written
    keep = blocks[-1]
    del blocks[:-1]
    print(json.dumps({"taken": taken, "retained": anon_mib() - start}))
    """
)


def _retained(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != host_allocator.ENV}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_return_to_the_os_with_the_threshold_fixed():
    off, on = _retained("off"), _retained("on")
    if not on["taken"]:
        pytest.skip("no glibc mallopt here")
    assert off["retained"] >= 64, off  # glibc's heap kept the 95 freed blocks
    assert on["retained"] <= 16, on  # each had its own mapping, unmapped when freed


def test_settings_it_leaves_alone_and_bad_values(monkeypatch):
    assert host_allocator.set_mmap_threshold(0) is False
    monkeypatch.setenv(host_allocator.ENV, "65536")  # the user's own choice wins
    assert host_allocator.set_mmap_threshold(128 << 10) is False
    monkeypatch.delenv(host_allocator.ENV)
    with pytest.raises(ValueError, match="1 to"):
        host_allocator.set_mmap_threshold(64 << 20)
    with pytest.raises(ValueError, match="host_mmap_threshold_kb"):
        ParallelConfig(ep=2, host_mmap_threshold_kb=-1)
