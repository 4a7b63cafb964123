"""Deterministic tar.gz of a bundle directory, and a safe unpack for verification."""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from pathlib import Path

from harness.bundle import ARCHIVE_ROOT


def bundle_files(root: Path) -> list[str]:
    """Bundle-relative POSIX paths of every regular file, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def pack(root: Path, dest: Path) -> Path:
    """Same directory contents -> byte-identical archive: sorted entries, zero times/owners, fixed modes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in bundle_files(root):
            data = (root / rel).read_bytes()
            info = tarfile.TarInfo(f"{ARCHIVE_ROOT}/{rel}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    tmp = dest.with_name(dest.name + ".partial")
    with (
        tmp.open("wb") as fh,
        gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=9) as gz,
    ):
        gz.write(raw.getvalue())
    tmp.replace(dest)
    return dest


class ArchiveError(ValueError):
    """The archive is damaged or holds something other than a bundle."""


def unpack(archive: Path, into: Path) -> Path:
    """Extract only regular files under the archive root; anything else is a malformed bundle."""
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = tar.getmembers()
            for m in members:
                parts = Path(m.name).parts
                if not m.isfile() or not parts or parts[0] != ARCHIVE_ROOT or ".." in parts or m.name.startswith("/"):
                    raise ArchiveError(f"{archive.name}: unexpected archive entry {m.name!r} — not a k3gate bundle")
            tar.extractall(into, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError) as exc:
        raise ArchiveError(f"{archive.name}: damaged or not a tar.gz ({exc}) — re-download the archive") from None
    return into / ARCHIVE_ROOT
