"""Read LRTrace bags: complete rosbag2 directories, bare ``.mcap`` files and killed recordings.

:func:`read_bag` accepts a bag directory or its ``.mcap`` file. A complete bag is read with
rosbags' :class:`~rosbags.rosbag2.Reader`. When ``metadata.yaml`` is missing (the recorder was
killed) the ``.mcap`` file is read directly, first through its index and, when the file has no
summary or footer (killed mid-recording), by streaming its records with the ``mcap`` package
up to the last complete chunk; :attr:`TraceBag.truncated` then says so.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcap.exceptions import McapError
from mcap.records import Channel, Message, Schema
from mcap.stream_reader import StreamReader
from rosbags.rosbag2 import Reader, ReaderError

from lrtrace import format as fmt
from timelyllm_ros.errors import TraceFormatError

__all__ = ['RawMessage', 'TraceBag', 'iter_raw_messages', 'mcap_file', 'read_bag']


@dataclass(frozen=True, slots=True)
class RawMessage:
    """One undecoded message of a bag."""

    topic: str
    msgtype: str
    log_time_ns: int
    data: bytes


@dataclass(slots=True)
class TraceBag:
    """The decoded content of one LRTrace bag (rosbags message dataclasses, in log order)."""

    path: Path
    version: int
    source: str
    info: dict[str, str]
    tasks: list[Any] = field(default_factory=list)          # TaskRecord
    segments: list[Any] = field(default_factory=list)       # Segment
    segment_done: list[Any] = field(default_factory=list)   # SegmentDone
    skills: list[Any] = field(default_factory=list)         # SkillExecution
    truncated: bool = False                                 # read from a killed recording

    @property
    def message_count(self) -> int:
        return 1 + len(self.tasks) + len(self.segments) + len(self.segment_done) + len(
            self.skills)


def mcap_file(path: str | Path) -> Path:
    """The ``.mcap`` file of a bag directory (or the path itself when it is a file).

    Raises:
        TraceFormatError: no such path, or a directory without exactly one ``.mcap`` file.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise TraceFormatError(f'{path}: no such bag')
    files = sorted(path.glob('*.mcap'))
    if len(files) != 1:
        raise TraceFormatError(f'{path}: expected one .mcap file in the bag directory, '
                               f'found {len(files)}')
    return files[0]


def _rosbags_messages(path: Path) -> list[RawMessage]:
    with Reader(path) as reader:
        return [RawMessage(c.topic, c.msgtype, int(t), bytes(d))
                for c, t, d in reader.messages()]


def _stream_messages(path: Path) -> tuple[list[RawMessage], bool]:
    """Stream an MCAP file record by record; stop quietly where a killed writer stopped."""
    schemas: dict[int, Schema] = {}
    channels: dict[int, Channel] = {}
    out: list[RawMessage] = []
    truncated = False
    with path.open('rb') as stream:
        records = StreamReader(stream, validate_crcs=False).records
        try:
            for record in records:
                if isinstance(record, Schema):
                    schemas[record.id] = record
                elif isinstance(record, Channel):
                    channels[record.id] = record
                elif isinstance(record, Message):
                    channel = channels.get(record.channel_id)
                    if channel is None:
                        raise TraceFormatError(f'{path}: message on unknown channel '
                                               f'{record.channel_id}')
                    schema = schemas.get(channel.schema_id)
                    msgtype = schema.name if schema is not None else ''
                    out.append(RawMessage(channel.topic, msgtype, record.log_time,
                                          bytes(record.data)))
        except (McapError, struct.error, ValueError, EOFError):
            # EndOfFile (an McapError) or a record cut short: the writer stopped here.
            truncated = True
    out.sort(key=lambda m: m.log_time_ns)   # stable: file order within one time
    return out, truncated


def iter_raw_messages(path: str | Path) -> tuple[list[RawMessage], bool]:
    """Every message of a bag, undecoded, in log-time order, and whether the file was cut.

    Raises:
        TraceFormatError: no such bag, or not an MCAP/rosbag2 file.
    """
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f'{path}: no such bag')
    if path.is_dir() and (path / 'metadata.yaml').exists():
        try:
            return _rosbags_messages(path), False
        except (ReaderError, OSError, KeyError, ValueError) as err:
            raise TraceFormatError(f'{path}: cannot read bag: {err}') from None
    file = mcap_file(path)
    try:
        return _rosbags_messages(file), False
    except (ReaderError, OSError, KeyError, ValueError, struct.error):
        pass    # no summary/footer: a killed recording; stream what reached the disk
    try:
        return _stream_messages(file)
    except OSError as err:
        raise TraceFormatError(f'{file}: cannot read: {err.strerror}') from None
    except McapError as err:  # invalid magic at the start
        raise TraceFormatError(f'{file}: not an MCAP file: {err}') from None


def read_bag(path: str | Path) -> TraceBag:
    """Read and decode an LRTrace bag.

    Args:
        path: the bag directory or its ``.mcap`` file.

    Returns:
        The decoded messages by topic; other topics in the bag are ignored.

    Raises:
        TraceFormatError: missing bag, not MCAP, no ``/lrtrace/meta`` header, a format
            version newer than :data:`~lrtrace.format.VERSION_LATEST`, a topic with the wrong
            message type, or a message that does not decode.
    """
    messages, truncated = iter_raw_messages(path)
    metas = [m for m in messages if m.topic == fmt.META_TOPIC]
    if not metas:
        raise TraceFormatError(f'{path}: not an LRTrace bag (no {fmt.META_TOPIC} message)')
    for message in messages:
        expected = fmt.TOPICS.get(message.topic)
        if expected is not None and message.msgtype != expected:
            raise TraceFormatError(f'{path}: {message.topic} carries {message.msgtype!r}, '
                                   f'expected {expected!r}')
    meta = fmt.deserialize(metas[0].data, fmt.TRACE_META)
    if not 1 <= int(meta.version) <= fmt.VERSION_LATEST:
        raise TraceFormatError(f'{path}: LRTrace format version {meta.version} is not '
                               f'supported (this lrtrace reads 1..{fmt.VERSION_LATEST})')
    bag = TraceBag(path=Path(path), version=int(meta.version), source=meta.source,
                   info=dict(zip(meta.keys, meta.values, strict=False)), truncated=truncated)
    targets = {fmt.TASKS_TOPIC: bag.tasks, fmt.SEGMENTS_TOPIC: bag.segments,
               fmt.SEGMENT_DONE_TOPIC: bag.segment_done, fmt.SKILLS_TOPIC: bag.skills}
    for message in messages:
        target = targets.get(message.topic)
        if target is not None:
            try:
                target.append(fmt.deserialize(message.data, message.msgtype))
            except TraceFormatError as err:
                raise TraceFormatError(f'{path}: {err}') from None
    return bag


def iter_bags(paths: list[str | Path] | tuple[str | Path, ...]) -> Iterator[TraceBag]:
    """Read several bags in turn (see :func:`read_bag`)."""
    for path in paths:
        yield read_bag(path)
