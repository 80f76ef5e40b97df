"""Zip archives that two zip readers read differently, built byte by byte.

torch reads a ``.pt2`` with miniz (``torch._C.PyTorchFileReader``), Python's ``zipfile``
reads the same bytes its own way. Each builder here takes a benign archive (what the checker
should see) and an evil one (what torch should load), both as ``{name: bytes}`` under one root
folder, and lays them out so that the readers part ways:

* ``case_variant``: the evil member under the benign name in other letter case (miniz finds
  names case-insensitively, and which of the two it finds is the binary search's choice);
* ``prepended``: the benign archive after the evil one, its directory offsets relative to its
  own start (``zipfile`` shifts them by the data in front, miniz does not);
* ``zip64_locator``: two zip64 end records; ``zipfile`` takes the one right before the
  locator, miniz the one the locator points to;
* ``trailing_directory``, ``local_name``, ``hidden_bytes``, ``nul_name``, ``cp437_name``,
  ``descriptor_lie``: layouts on which the readers disagree on names or bytes, or that hide
  bytes no reader accounts for.
"""

from __future__ import annotations

import struct
import zlib

Members = dict[str, bytes]


def _local(name: bytes, data: bytes, *, flags: int = 0, local_name: bytes | None = None) -> bytes:
    n = name if local_name is None else local_name
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, flags, 0, 0, 0, zlib.crc32(data),
                       len(data), len(data), len(n), 0) + n + data


def _central(name: bytes, data: bytes, offset: int, *, flags: int = 0) -> bytes:
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, flags, 0, 0, 0,
                       zlib.crc32(data), len(data), len(data), len(name), 0, 0, 0, 0, 0,
                       offset) + name


def _eocd(count: int, cd_size: int, cd_off: int, comment: bytes = b"") -> bytes:
    return struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_off,
                       len(comment)) + comment


def _members_and_cd(files: list[tuple[bytes, bytes]], base: int = 0, *, flags: int = 0,
                    local_names: dict[bytes, bytes] | None = None) -> tuple[bytes, bytes]:
    """Local headers + data (offsets counted from ``base``) and the central directory."""
    body, cd = bytearray(), bytearray()
    for name, data in files:
        cd += _central(name, data, base + len(body), flags=flags)
        body += _local(name, data, flags=flags, local_name=(local_names or {}).get(name))
    return bytes(body), bytes(cd)


def _full(root: str, members: Members) -> list[tuple[bytes, bytes]]:
    return [(f"{root}/{k}".encode(), v) for k, v in members.items()]


def plain(root: str, members: Members) -> bytes:
    body, cd = _members_and_cd(_full(root, members))
    return body + cd + _eocd(len(members), len(cd), len(body))


def case_variant(root: str, benign: Members, evil_name: str, evil_data: bytes, upper: str) -> bytes:
    """``benign`` plus ``evil_data`` under ``evil_name`` spelled ``upper`` (another case),
    right after the benign member: where miniz's binary search lands on it first."""
    assert upper.lower() == evil_name.lower() and upper != evil_name
    files = _full(root, benign)
    at = list(benign).index(evil_name) + 1
    files.insert(at, (f"{root}/{upper}".encode(), evil_data))
    body, cd = _members_and_cd(files)
    return body + cd + _eocd(len(files), len(cd), len(body))


def prepended(root: str, benign: Members, evil: Members) -> bytes:
    """[evil members][evil directory][benign members][benign directory][end record]: the end
    record's directory offset is relative to the benign archive's start (zipfile's view);
    read as absolute (miniz's view) it lands on the evil directory. Both archives have the
    same member names in the same order, so their directories have the same size; the evil
    members must not take more room than the benign ones (padding fills the rest)."""
    assert list(benign) == list(evil)
    b_body, b_cd = _members_and_cd(_full(root, benign))
    e_body, e_cd = _members_and_cd(_full(root, evil))
    assert len(e_cd) == len(b_cd) and len(e_body) <= len(b_body), "pad the benign archive"
    front = e_body + b"\0" * (len(b_body) - len(e_body)) + e_cd
    return front + b_body + b_cd + _eocd(len(benign), len(b_cd), len(b_body))


def zip64_locator(root: str, benign: Members, evil: Members) -> bytes:
    """[evil members][evil dir][evil zip64 end][benign members][benign dir][benign zip64 end]
    [locator -> evil zip64 end][end record (zip64 markers)]."""
    e_body, e_cd = _members_and_cd(_full(root, evil))
    z_evil_at = len(e_body) + len(e_cd)
    z_evil = _zip64_end(len(evil), len(e_cd), 0)
    base = z_evil_at + len(z_evil)
    b_body, b_cd = _members_and_cd(_full(root, benign), base)
    z_benign = _zip64_end(len(benign), len(b_cd), base + len(b_body))
    out = e_body + e_cd + z_evil + b_body + b_cd + z_benign
    locator = struct.pack("<IIQI", 0x07064B50, 0, z_evil_at, 1)
    return out + locator + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF,
                                       0xFFFFFFFF, 0xFFFFFFFF, 0)


def _zip64_end(count: int, cd_size: int, cd_off: int) -> bytes:
    return struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_off)


def trailing_directory(root: str, benign: Members, evil: Members) -> bytes:
    """The evil archive, then the benign one's end record hidden in a comment of the evil
    end record: a reader that takes the last end-record signature reads the benign one."""
    e_body, e_cd = _members_and_cd(_full(root, evil))
    b_body, b_cd = _members_and_cd(_full(root, benign), len(e_body) + len(e_cd))
    tail = b_body + b_cd + _eocd(len(benign), len(b_cd), len(e_body) + len(e_cd) + len(b_body))
    return e_body + e_cd + _eocd(len(evil), len(e_cd), len(e_body), comment=tail)


def local_name(root: str, members: Members, rel: str, other: str) -> bytes:
    """Member ``rel``'s local header names it ``other`` (miniz ignores local names)."""
    files = _full(root, members)
    body, cd = _members_and_cd(files, local_names={f"{root}/{rel}".encode(): f"{root}/{other}".encode()})
    return body + cd + _eocd(len(files), len(cd), len(body))


def hidden_bytes(root: str, members: Members, blob: bytes) -> bytes:
    """``blob`` between the last member and the directory, where no member accounts for it."""
    body, cd = _members_and_cd(_full(root, members))
    return body + blob + cd + _eocd(len(members), len(cd), len(body) + len(blob))


def nul_name(root: str, members: Members, rel: str, data: bytes) -> bytes:
    """An extra member named ``rel`` + NUL + junk: zipfile cuts the name at the NUL."""
    files = _full(root, members) + [(f"{root}/{rel}\0x".encode(), data)]
    body, cd = _members_and_cd(files)
    return body + cd + _eocd(len(files), len(cd), len(body))


def cp437_name(root: str, members: Members, data: bytes) -> bytes:
    """A member whose UTF-8 name is not flagged as UTF-8: zipfile decodes it as cp437."""
    files = _full(root, members) + [(f"{root}/extra/\u00df.json".encode(), data)]
    body, cd = _members_and_cd(files)
    return body + cd + _eocd(len(files), len(cd), len(body))


def descriptor_lie(root: str, members: Members) -> bytes:
    """Every member flags a data descriptor that is not there (the directory is right)."""
    body, cd = _members_and_cd(_full(root, members), flags=0x0008)
    return body + cd + _eocd(len(members), len(cd), len(body))
