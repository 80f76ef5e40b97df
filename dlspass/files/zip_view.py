"""One reading of a torch zip archive that every zip reader agrees with, or a refusal.

torch reads ``.pt2`` archives and ``torch.save`` files with miniz (``PyTorchStreamReader``,
``torch._C.PyTorchFileReader``); Python's ``zipfile`` reads the same bytes differently where
the zip format leaves room: miniz looks member names up case-insensitively, ignores a
local header's name, finds the end record and the zip64 record its own way and takes the
central directory's offsets as they are, while ``zipfile`` shifts them by any data found
before the archive (``concat``). A checker that reads an archive one way and lets torch read
it another approves one archive and loads another.

``read_view(data, where)`` therefore accepts only the layout both readers necessarily agree
on, and checks that they do:

* the end record ends the file (no comment, no trailing data, no second directory); a zip64
  end record, when present, sits right before its locator and agrees with the end record;
* the central directory ends where the end records start, and the members tile the file
  from byte 0 to the directory in directory order: local header (the same name, flags and
  method as the directory's), data, and a data descriptor only where the flags announce
  one and with the directory's values; no prepended, hidden, overlapping or unread byte;
* names are UTF-8 (flagged as such when not ASCII, or ``zipfile`` decodes them as cp437),
  free of control characters and backslashes, all inside the first name's root folder, and
  unique even ignoring ASCII case (miniz's lookup);
* members are stored or deflated, not encrypted, every CRC correct, deflate streams end
  exactly where the directory says and inflate to exactly the declared size; the total
  inflation is bounded (``MAX_INFLATION_BYTES``: torch allocates each declared size);

and then compares the result with ``torch._C.PyTorchFileReader`` (names in order, sizes,
data offsets, inflated bytes) and with ``zipfile`` (names, offsets, sizes, methods, CRCs)
on the same bytes. Whatever passes, torch reads as exactly the records of the view.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from dlspass.errors import InputValueError
from dlspass.files.bounded_text import excerpt

MAX_INFLATION_BYTES = 64 * 2**20
"""How much larger than the archive its members may inflate in total. torch writes every
member uncompressed, so a real archive inflates by nothing; a zip bomb (a 2 MB file whose
``model.json`` declares 2 GiB) is refused from its directory alone."""
MAX_MEMBERS = 100_000
MAX_NAME_BYTES = 500
"""Longest member name: torch's ``get_all_records`` cuts names at 511 bytes."""

_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_U32, _U16 = 0xFFFFFFFF, 0xFFFF
_FLAG_DESCRIPTOR, _FLAG_UTF8 = 0x0008, 0x0800
_FLAGS_ALLOWED = _FLAG_DESCRIPTOR | _FLAG_UTF8 | 0x0006  # 0x0006: deflate speed hints
_NAME_FORBIDDEN = re.compile("[\x00-\x1f\x7f\\\\]")


# a zip that zip readers could read differently, or that inflates beyond the bounds
UnsafeZipError = InputValueError


@dataclass(frozen=True)
class Record:
    """One member: its name relative to the root folder and where its data lies."""
    name: str
    header: int  # offset of the local header
    offset: int  # offset of the data
    compressed: int
    size: int
    method: int
    crc: int


class ZipView:
    """The records of an archive as every reader sees them (built by ``read_view``)."""
    def __init__(self, data: bytes, where: str, root: str, records: dict[str, Record]) -> None:
        self.data, self.where, self.root, self.records = data, where, root, records

    def fail(self, why: str) -> UnsafeZipError:
        return UnsafeZipError(f"{self.where}: {why}")

    def record(self, name: str) -> Record:
        """The record named exactly ``name`` (torch would also find a case variant: refused)."""
        rec = self.records.get(name)
        if rec is None:
            raise self.fail(f"{excerpt(name, 80)} is missing")
        return rec

    def read(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of record ``name``; refused past ``limit`` before anything is inflated."""
        rec = self.record(name)
        if limit is not None and rec.size > limit:
            raise self.fail(f"member {excerpt(name, 80)} inflates to {rec.size:,} bytes "
                            f"(more than {limit:,})")
        return _inflate(self.data, rec, self.fail)


def read_view(data: bytes, where: str) -> ZipView:
    """The archive in ``data`` as a ``ZipView``, or ``UnsafeZipError`` (see the module)."""
    view = _parse(data, where)
    _agrees_with_zipfile(view)
    _agrees_with_torch(view)
    return view


def _parse(data: bytes, where: str) -> ZipView:
    def fail(why: str) -> UnsafeZipError:
        return UnsafeZipError(f"{where}: {why}")

    n = len(data)
    if n < _EOCD.size:
        raise fail("not a zip archive (too short)")
    sig, disk, cd_disk, count_disk, count, cd_size, cd_off, comment = _EOCD.unpack_from(data, n - _EOCD.size)
    if sig != 0x06054B50:
        raise fail("not a zip archive, or its end record is not at the end of the file "
                   "(a comment, trailing data or a second archive)")
    if disk or cd_disk or count_disk != count or comment:
        raise fail("a multi-disk or commented zip (not what torch writes)")
    cd_end = n - _EOCD.size
    loc_at = cd_end - _LOCATOR.size
    if loc_at >= 0 and data[loc_at:loc_at + 4] == b"PK\x06\x07":
        _, loc_disk, z64_off, disks = _LOCATOR.unpack_from(data, loc_at)
        rec_at = loc_at - _EOCD64.size
        if loc_disk or disks != 1 or rec_at < 0 or z64_off != rec_at:
            raise fail("its zip64 end record is not where its locator says (two directories?)")
        (sig64, size64, _, _, disk64, cd_disk64, count_disk64, count64, cd_size64,
         cd_off64) = _EOCD64.unpack_from(data, rec_at)
        if sig64 != 0x06064B50 or size64 != _EOCD64.size - 12 or disk64 or cd_disk64 \
                or count_disk64 != count64:
            raise fail("its zip64 end record is malformed")
        for small, big, full in ((count, count64, _U16), (cd_size, cd_size64, _U32), (cd_off, cd_off64, _U32)):
            if small != full and small != big:
                raise fail("its zip64 end record disagrees with its end record")
        count, cd_size, cd_off, cd_end = count64, cd_size64, cd_off64, rec_at
    elif _U16 == count or _U32 in (cd_size, cd_off):
        raise fail("its end record points to a zip64 record that is not there")
    if count == 0:
        raise fail("an empty zip")
    if count > MAX_MEMBERS:
        raise fail(f"{count:,} members (more than {MAX_MEMBERS:,})")
    if cd_off + cd_size != cd_end:
        raise fail("its central directory does not end where the end record starts "
                   "(data before or inside the archive)")
    entries = list(_central_entries(data, cd_off, cd_end, count, fail))
    root = entries[0][0].split("/", 1)[0]
    records: dict[str, Record] = {}
    folded: set[str] = set()
    inflation = 0
    pos = 0
    for i, (name, raw_name, flags, method, crc, csize, size, header) in enumerate(entries):
        head, _, rel = name.partition("/")
        if head != root or not rel:
            raise fail(f"member {excerpt(name, 80)} is outside the archive's root folder "
                       f"{excerpt(root, 40)} (not a torch archive)")
        if rel.lower() in folded:  # str.lower folds more than ASCII: stricter than miniz
            raise fail(f"member {excerpt(rel, 80)} appears twice, or twice up to letter case "
                       "(which copy a reader takes is not defined)")
        folded.add(rel.lower())
        if header != pos:
            raise fail(f"member {excerpt(rel, 80)} does not start where the previous one ends "
                       "(prepended, hidden or overlapping data)")
        offset = _local_header(data, header, raw_name, flags, method, crc, csize, size, rel, fail)
        end = offset + csize
        nxt = entries[i + 1][7] if i + 1 < len(entries) else cd_off
        if end > nxt:
            raise fail(f"member {excerpt(rel, 80)} overlaps what follows it")
        _descriptor(data, end, nxt, flags, crc, csize, size, rel, fail)
        pos = nxt
        if method == zipfile.ZIP_STORED and csize != size:
            raise fail(f"stored member {excerpt(rel, 80)} declares two sizes")
        inflation += max(0, size - csize)
        if inflation > MAX_INFLATION_BYTES:
            raise fail(f"its members inflate to {inflation:,}+ bytes more than they occupy "
                       f"(more than {MAX_INFLATION_BYTES:,}; a zip bomb?)")
        records[rel] = Record(rel, header, offset, csize, size, method, crc)
    view = ZipView(data, where, root, records)
    for rec in records.values():
        _inflate(data, rec, view.fail)  # every CRC and deflate stream, as zipfile would check
    return view


def _central_entries(data: bytes, at: int, end: int, count: int, fail) -> Iterator[tuple]:
    for _ in range(count):
        if at + _CENTRAL.size > end:
            raise fail("its central directory is truncated")
        (sig, _, _, flags, method, _, _, crc, csize, size, nlen, elen, clen, disk, _, _,
         header) = _CENTRAL.unpack_from(data, at)
        if sig != 0x02014B50:
            raise fail("its central directory is malformed")
        raw_name = data[at + _CENTRAL.size: at + _CENTRAL.size + nlen]
        extra = data[at + _CENTRAL.size + nlen: at + _CENTRAL.size + nlen + elen]
        at += _CENTRAL.size + nlen + elen + clen
        if at > end:
            raise fail("its central directory is truncated")
        name = _name(raw_name, flags, fail)
        if flags & ~_FLAGS_ALLOWED:
            raise fail(f"member {excerpt(name, 80)} is encrypted or uses zip features torch "
                       f"does not write (flags {flags:#06x})")
        if method not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise fail(f"member {excerpt(name, 80)} uses an unsupported compression method ({method})")
        if clen or disk:
            raise fail(f"member {excerpt(name, 80)} has a comment or lies on another disk")
        size, csize, header = _zip64_extra(extra, size, csize, header, name, fail)
        yield name, raw_name, flags, method, crc, csize, size, header
    if at != end:
        raise fail("its central directory holds more than its end record counts")


def _name(raw: bytes, flags: int, fail) -> str:
    if len(raw) > MAX_NAME_BYTES:
        raise fail(f"a member name of {len(raw):,} bytes (more than {MAX_NAME_BYTES})")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise fail(f"member name {excerpt(raw, 80)} is not UTF-8") from None
    if not name.isascii() and not flags & _FLAG_UTF8:
        # zipfile would decode it as cp437, torch as UTF-8: two names for one member
        raise fail(f"member name {excerpt(name, 80)} is not flagged as UTF-8")
    if _NAME_FORBIDDEN.search(name):
        raise fail(f"member name {excerpt(name, 80)} holds a control character or backslash")
    return name


def _zip64_extra(extra: bytes, size: int, csize: int, header: int, name: str, fail
                 ) -> tuple[int, int, int]:
    at = 0
    while at < len(extra):
        if at + 4 > len(extra):
            raise fail(f"member {excerpt(name, 80)} has a malformed extra field")
        tag, length = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4: at + 4 + length]
        if len(body) != length:
            raise fail(f"member {excerpt(name, 80)} has a malformed extra field")
        if tag == 0x0001:
            values = list(struct.unpack_from(f"<{length // 8}Q", body))
            out = []
            for v in (size, csize, header):
                if v == _U32:
                    if not values:
                        raise fail(f"member {excerpt(name, 80)} has a malformed zip64 field")
                    v = values.pop(0)
                out.append(v)
            size, csize, header = out
        at += 4 + length
    if _U32 in (size, csize, header):
        raise fail(f"member {excerpt(name, 80)} lacks its zip64 sizes")
    return size, csize, header


def _local_header(data: bytes, at: int, raw_name: bytes, flags: int, method: int, crc: int,
                  csize: int, size: int, rel: str, fail) -> int:
    if at + _LOCAL.size > len(data):
        raise fail(f"member {excerpt(rel, 80)} lies outside the file")
    sig, _, lflags, lmethod, _, _, lcrc, lcsize, lsize, nlen, elen = _LOCAL.unpack_from(data, at)
    name = data[at + _LOCAL.size: at + _LOCAL.size + nlen]
    if sig != 0x04034B50 or lflags != flags or lmethod != method or name != raw_name:
        raise fail(f"member {excerpt(rel, 80)}: its local header disagrees with the central "
                   "directory (name, flags or method)")
    for local, central in ((lcrc, crc), (lcsize, csize), (lsize, size)):
        if local not in (central, 0, _U32) or (local == 0 and central and not flags & _FLAG_DESCRIPTOR):
            raise fail(f"member {excerpt(rel, 80)}: its local header disagrees with the "
                       "central directory (CRC or sizes)")
    return at + _LOCAL.size + nlen + elen


def _descriptor(data: bytes, at: int, nxt: int, flags: int, crc: int, csize: int, size: int,
                rel: str, fail) -> None:
    gap = data[at:nxt]
    if not flags & _FLAG_DESCRIPTOR:
        ok = not gap
    else:
        ok = gap in (struct.pack("<IIII", 0x08074B50, crc, csize, size) if max(csize, size) <= _U32 else b"-",
                     struct.pack("<IIQQ", 0x08074B50, crc, csize, size))
    if not ok:
        raise fail(f"member {excerpt(rel, 80)} is followed by {len(gap):,} bytes no member "
                   "accounts for (hidden data, or a data descriptor that disagrees)")


def _inflate(data: bytes, rec: Record, fail) -> bytes:
    raw = data[rec.offset: rec.offset + rec.compressed]
    if rec.method == zipfile.ZIP_STORED:
        out = raw
    else:
        d = zlib.decompressobj(-15)
        try:
            out = d.decompress(raw, rec.size + 1)
        except zlib.error as e:
            raise fail(f"member {excerpt(rec.name, 80)} is damaged ({excerpt(str(e), 60)})") from None
        if len(out) != rec.size or not d.eof or d.unused_data or d.unconsumed_tail:
            raise fail(f"member {excerpt(rec.name, 80)} is damaged (it does not inflate to "
                       "exactly its declared size)")
    if zlib.crc32(out) != rec.crc:
        raise fail(f"member {excerpt(rec.name, 80)} is damaged (CRC mismatch)")
    return out


def _agrees_with_zipfile(view: ZipView) -> None:
    """``zipfile`` (torch's fallback for legacy archives) must list the same members."""
    try:
        with zipfile.ZipFile(io.BytesIO(view.data)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise view.fail(f"zipfile cannot read it ({excerpt(str(e), 60)})") from None
    ours = [(f"{view.root}/{r.name}", r.header, r.compressed, r.size, r.method, r.crc)
            for r in view.records.values()]
    theirs = [(i.filename, i.header_offset, i.compress_size, i.file_size, i.compress_type, i.CRC)
              for i in infos]
    if ours != theirs:
        raise view.fail("zipfile reads a different archive from these bytes than torch would")


def _agrees_with_torch(view: ZipView) -> None:
    """torch's own reader must list the same records at the same places."""
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(view.data))
        names = reader.get_all_records()
        if names != list(view.records):
            raise view.fail("torch's zip reader lists other members than zipfile")
        for rec in view.records.values():
            if reader.get_record_size(rec.name) != rec.size:
                raise view.fail(f"torch's zip reader sizes member {excerpt(rec.name, 80)} differently")
            if rec.method == zipfile.ZIP_STORED:
                same = reader.get_record_offset(rec.name) == rec.offset
            else:  # bounded: the inflation check came first
                same = reader.get_record(rec.name) == _inflate(view.data, rec, view.fail)
            if not same:
                raise view.fail(f"torch's zip reader reads member {excerpt(rec.name, 80)} "
                                "from other bytes")
    except UnsafeZipError:
        raise
    except Exception as e:  # torch's reader raises RuntimeError with miniz's message
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise view.fail(f"torch's zip reader refuses it ({excerpt(first, 80)})") from None


# an archive that torch would unpickle, evaluate or inflate without bound (``.pt2`` files and
# ``torch.save`` zips alike)
UnsafeArchiveError = InputValueError


def check_zip_bounds(source: str | Path | IO[bytes] | bytes, name: str | None = None) -> bytes:
    """The bytes of a ``torch.save`` zip (a path, a file object or bytes) once its layout is
    one that torch's reader and ``zipfile`` read alike (`read_view`) and
    its members inflate within ``MAX_INFLATION_BYTES`` (torch allocates each declared size);
    else ``UnsafeArchiveError``. Reads the whole source; ``name`` names it in messages."""
    where = name if name is not None else str(source if not isinstance(source, bytes) else "<bytes>")
    try:
        if isinstance(source, bytes):
            data = source
        elif isinstance(source, (str, Path)):
            data = Path(source).read_bytes()
        else:  # a file object: read from its start
            source.seek(0)
            data = source.read()
    except OSError as e:
        raise UnsafeArchiveError(f"{where}: cannot be read ({e.strerror or type(e).__name__})") from None
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise UnsafeArchiveError(f"{where}: not a readable zip (not in torch.save's zip format)")
    read_view(data, where)
    return data
