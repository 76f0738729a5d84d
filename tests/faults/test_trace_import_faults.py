"""Fault injection on ``moestack trace import``: an npz archive whose array header claims far
more tokens than the file holds (2^40), stored or compressed, or whose zip directory claims
more uncompressed bytes than its compressed ones can hold, ends in one line naming the file,
the member and the sizes, before anything that large is allocated; nothing is written."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from moestack import cli

pytestmark = pytest.mark.faults

META = {"num_experts": 8, "top_k": 2, "n_moe_layers": 2}
CLAIMED = (2, 2**40, 2)  # layers, tokens, k: 8 TiB of int16 ids


def npy(shape: tuple[int, ...], descr: str, data: bytes) -> bytes:
    """An .npy file whose header says ``shape`` and dtype ``descr``, then ``data`` as is."""
    buf = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + data


def archive(path: Path, experts: bytes, method: int = zipfile.ZIP_STORED) -> Path:
    """An npz as numpy writes one: ``experts.npy`` (the bytes given) and a valid ``meta``."""
    meta = io.BytesIO()
    np.save(meta, np.array(json.dumps(META)))
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        zf.writestr("experts.npy", experts)
        zf.writestr("meta.npy", meta.getvalue())
    return path


def say_uncompressed(path: Path, member: str, size: int) -> None:
    """Rewrite the zip directory's uncompressed size of ``member`` (what zipfile reads)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x01\x02")  # the first central directory entry
    while True:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + name_len] == member.encode():
            struct.pack_into("<I", data, at + 24, size)
            break
        extra, comment = struct.unpack_from("<HH", data, at + 30)
        at += 46 + name_len + extra + comment
    path.write_bytes(bytes(data))


def refused(capsys, fault_report, kind: str, src: Path, out: Path) -> str:
    """``moestack trace import SRC OUT`` ends with exit status 2 and one error line (returned),
    no traceback, and nothing written."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["trace", "import", str(src), str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert not out.exists() and sorted(p.name for p in out.parent.iterdir()) == [src.name]
    fault_report.add(f"trace import: {kind}", injected=1, refused=1)
    return lines[0]


@pytest.mark.parametrize(
    "method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED], ids=["stored", "compressed"]
)
def test_a_header_claiming_2_to_the_40_tokens_is_refused(tmp_path, capsys, fault_report, method):
    """The header says [2, 2^40, 2] int16 (2^43 bytes); the member holds 100 tokens' ids."""
    ids = np.arange(400, dtype="<i2") % 8
    src = archive(tmp_path / "big.npz", npy(CLAIMED, "<i2", ids.tobytes()), method)
    line = refused(capsys, fault_report, "array header claiming 2^40 tokens", src, tmp_path / "o")
    assert str(src) in line and "experts.npy" in line and str(CLAIMED) in line
    assert f"claims {2**43} bytes" in line and "holds 800" in line  # 400 int16 ids


def test_meta_header_claiming_a_huge_string_is_refused(tmp_path, capsys, fault_report):
    """The meta's header says one string of 2^28 characters (4 bytes each in numpy's
    UTF-32): 1 GiB, which numpy would allocate before finding the member short of it."""
    chars = 2**28
    ids = (np.arange(400, dtype="<i2") % 8).reshape(2, 100, 2)
    experts = io.BytesIO()
    np.save(experts, ids)
    src = tmp_path / "meta.npz"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("experts.npy", experts.getvalue())
        zf.writestr("meta.npy", npy((), f"<U{chars}", json.dumps(META).encode()))
    line = refused(capsys, fault_report, "array header claiming a huge meta string", src,
                   tmp_path / "o")  # fmt: skip
    assert str(src) in line and "meta.npy" in line and f"<U{chars}" in line
    assert f"claims {2**30} bytes" in line


def test_a_zip_directory_claiming_more_than_deflate_can_hold(tmp_path, capsys, fault_report):
    """The header and the zip directory agree on 2 GiB of ids, but the member's compressed
    bytes (a few hundred) could inflate to 1032 times their size at most: refused before
    numpy allocates the 2 GiB it would then fail to fill."""
    shape = (2, 2**28, 2)  # 2 GiB of int16
    body = npy(shape, "<i2", bytes(800))
    src = archive(tmp_path / "forged.npz", body, zipfile.ZIP_DEFLATED)
    header_len = len(body) - 800
    say_uncompressed(src, "experts.npy", header_len + 2**31)
    line = refused(capsys, fault_report, "zip directory claiming more than its bytes hold", src,
                   tmp_path / "o")  # fmt: skip
    assert str(src) in line and "experts.npy" in line and "compressed" in line
    assert str(header_len + 2**31) in line


def test_a_whole_archive_still_imports(tmp_path):
    """The checks refuse nothing numpy writes: savez and savez_compressed import alike."""
    from moestack.telemetry import import_trace

    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(2 * 300)]).reshape(2, 300, 2)
    for save in (np.savez, np.savez_compressed):
        src = tmp_path / f"{save.__name__}.npz"
        save(src, experts=ids.astype(np.int16), meta=np.array(json.dumps(META)))
        trace = import_trace(src, tmp_path / save.__name__)
        got = [trace.accesses(layer).tolist() for layer in range(2)]
        assert got == [layer.reshape(-1).tolist() for layer in ids]
