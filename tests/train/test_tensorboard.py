"""TensorBoard event files: CRC-32C against published check values, our records decoded by the
protobuf library (an independent decoder, from a hand-built descriptor of the Event messages),
framing and corruption detection."""

import struct

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from jaxmoe.train import tensorboard as tb


def test_crc32c_check_values():
    # RFC 3720 (iSCSI) appendix B.4 and the usual "123456789" check value.
    assert tb.crc32c(b"123456789") == 0xE3069283
    assert tb.crc32c(bytes(32)) == 0x8A9136AA
    assert tb.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert tb.crc32c(bytes(range(32))) == 0x46DD794E
    assert tb.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C


def test_masked_crc():
    c = tb.crc32c(b"abc")
    assert tb.masked_crc32c(b"abc") == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _event_classes():
    """``Event`` / ``Summary`` message classes from a descriptor written out by hand (tensorflow's field numbers)."""
    f = descriptor_pb2.FileDescriptorProto(name="jaxmoe_test_event.proto", package="jaxmoe_test", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    value = f.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=T.TYPE_FLOAT, label=T.LABEL_OPTIONAL)
    summary = f.message_type.add(name="Summary")
    summary.field.add(
        name="value", number=1, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED, type_name=".jaxmoe_test.Value"
    )
    event = f.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=T.TYPE_DOUBLE, label=T.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=T.TYPE_INT64, label=T.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    event.field.add(
        name="summary", number=5, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL, type_name=".jaxmoe_test.Summary"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("jaxmoe_test.Event"))


@pytest.mark.parametrize("step", [0, 1, 127, 128, 300, 2**40, -5])
def test_events_decode_with_protobuf(step):
    Event = _event_classes()
    scalars = {"loss": 6.25, "moe/expert_load/0/3": 117.0, "lr": 3e-4, "tiny": -1e-30}
    data = tb.encode_event(1234.5, step, scalars=scalars)
    event = Event.FromString(data)
    assert event.wall_time == 1234.5 and event.step == step
    assert {v.tag: v.simple_value for v in event.summary.value} == {k: np.float32(v) for k, v in scalars.items()}
    # And our own decoder agrees with protobuf's on protobuf's own encoding.
    theirs = Event(wall_time=2.0, step=step, file_version="brain.Event:2").SerializeToString()
    assert tb.decode_event(theirs) == {"wall_time": 2.0, "step": step, "file_version": "brain.Event:2", "scalars": {}}
    assert tb.decode_event(data)["scalars"] == {k: np.float32(v) for k, v in scalars.items()}


def test_writer_file_reads_back(tmp_path):
    Event = _event_classes()
    with tb.EventWriter(tmp_path / "tb") as w:
        w.scalars(1, {"loss": 6.0})
        w.scalars(2, {"loss": 5.5, "heldout_loss": 5.75})
    events = tb.read_events(w.path)
    assert events[0]["file_version"] == tb.FILE_VERSION
    assert [(e["step"], e["scalars"]) for e in events[1:]] == [
        (1, {"loss": 6.0}),
        (2, {"loss": 5.5, "heldout_loss": 5.75}),
    ]
    # The framing, read independently: u64 length, masked CRC of it, data, masked CRC of the data.
    buf, i, steps = w.path.read_bytes(), 0, []
    while i < len(buf):
        (n,) = struct.unpack("<Q", buf[i : i + 8])
        assert struct.unpack("<I", buf[i + 8 : i + 12])[0] == tb.masked_crc32c(buf[i : i + 8])
        data = buf[i + 12 : i + 12 + n]
        assert struct.unpack("<I", buf[i + 12 + n : i + 16 + n])[0] == tb.masked_crc32c(data)
        steps.append(Event.FromString(data).step)
        i += 16 + n
    assert steps == [0, 1, 2]


@pytest.mark.parametrize("where", ["length", "data", "end"])
def test_corruption_detected(tmp_path, where):
    with tb.EventWriter(tmp_path) as w:
        w.scalars(1, {"loss": 6.0})
    buf = bytearray(w.path.read_bytes())
    if where == "length":
        buf[-30] ^= 0x01  # inside the second record's length or CRC
    elif where == "data":
        buf[-8] ^= 0x40
    else:
        buf = buf[:-2]
    w.path.write_bytes(bytes(buf))
    with pytest.raises(ValueError, match="CRC mismatch|truncated"):
        tb.read_events(w.path)
