"""TensorBoard event files, written and read without TensorFlow.

An event file is a sequence of TFRecords: ``uint64 length``, ``uint32 masked_crc32c(length)``,
``data``, ``uint32 masked_crc32c(data)`` (little endian), where the CRC is CRC-32C (Castagnoli)
and ``masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2**32)``. Each record's data is an
``Event`` protobuf; the first holds ``file_version = "brain.Event:2"``, the rest one ``Summary``
of scalar values each. The protobuf subset we need, encoded by hand::

    message Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    message Summary { repeated Value value = 1; }
    message Value   { string tag = 1; float simple_value = 2; }

TensorBoard reads ``simple_value`` scalars directly (its scalars plugin converts them).
"""

from __future__ import annotations

import os
import pathlib
import socket
import struct
import time
import uuid
from collections.abc import Iterator, Mapping

FILE_VERSION = "brain.Event:2"

# --------------------------------------------------------------------------------------------
# CRC-32C


def _crc32c_table() -> list[int]:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (``crc32c(b"123456789") == 0xE3069283``)."""
    c = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------
# Protobuf wire format (the subset above)


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 negatives: ten-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def encode_event(
    wall_time: float, step: int = 0, *, scalars: Mapping[str, float] | None = None, file_version: str | None = None
) -> bytes:
    """An ``Event`` message: a file-version header, or scalar summaries at ``step``."""
    out = _key(1, 1) + struct.pack("<d", wall_time)
    if step:
        out += _key(2, 0) + _varint(int(step))
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        summary = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode()) + _key(2, 5) + struct.pack("<f", float(v)))
            for tag, v in scalars.items()
        )
        out += _length_delimited(5, summary)
    return out


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    """``(field, wire_type, value)`` of one message: ints for varints, bytes for the rest."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")
        if i > len(buf):
            raise ValueError(f"truncated protobuf field {field}")
        yield field, wire, value


def decode_event(data: bytes) -> dict:
    """An ``Event`` message -> ``{"wall_time", "step", "file_version"?, "scalars": {tag: value}}``."""
    event: dict = {"wall_time": 0.0, "step": 0, "scalars": {}}
    for field, _, value in _fields(data):
        if field == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif field == 2:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 3:
            event["file_version"] = value.decode()
        elif field == 5:
            for f, _, v in _fields(value):
                if f != 1:
                    continue
                tag, scalar = None, None
                for vf, _, vv in _fields(v):
                    if vf == 1:
                        tag = vv.decode()
                    elif vf == 2:
                        scalar = struct.unpack("<f", vv)[0]
                if tag is not None and scalar is not None:
                    event["scalars"][tag] = scalar
    return event


# --------------------------------------------------------------------------------------------
# Records and files


def frame_record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def read_records(path: str | os.PathLike) -> Iterator[bytes]:
    """The data of each TFRecord in ``path``, both CRCs verified.

    Raises:
        ValueError: a CRC does not match or the file ends inside a record (naming the offset).
    """
    buf = pathlib.Path(path).read_bytes()
    i = 0
    while i < len(buf):
        if i + 12 > len(buf):
            raise ValueError(f"{path}: truncated record header at byte {i}")
        length_bytes = buf[i : i + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", buf[i + 8 : i + 12])
        if length_crc != masked_crc32c(length_bytes):
            raise ValueError(f"{path}: record length CRC mismatch at byte {i}")
        start, end = i + 12, i + 12 + length
        if end + 4 > len(buf):
            raise ValueError(f"{path}: truncated record at byte {i}")
        data = buf[start:end]
        (data_crc,) = struct.unpack("<I", buf[end : end + 4])
        if data_crc != masked_crc32c(data):
            raise ValueError(f"{path}: record data CRC mismatch at byte {i}")
        yield data
        i = end + 4


def read_events(path: str | os.PathLike) -> list[dict]:
    """Every event of an event file, decoded (see :func:`decode_event`)."""
    return [decode_event(r) for r in read_records(path)]


class EventWriter:
    """Appends scalar summaries to a new event file ``logdir/events.out.tfevents.<time>.<host>.<pid>.<uid>``.

    Every :meth:`scalars` call is one flushed record, so a killed run leaves a readable file.
    """

    def __init__(self, logdir: str | os.PathLike):
        logdir = pathlib.Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # A unique suffix: two writers never share a file (a bucket copy of one would replace the other's).
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.path = logdir / name
        self._file = open(self.path, "ab")  # noqa: SIM115 (kept open for the writer's life)
        self._write(encode_event(now, file_version=FILE_VERSION))

    def _write(self, event: bytes) -> None:
        self._file.write(frame_record(event))
        self._file.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Writes ``{tag: value}`` at ``step`` (non-finite values are written as they are)."""
        if values:
            self._write(encode_event(time.time(), step, scalars=values))

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
