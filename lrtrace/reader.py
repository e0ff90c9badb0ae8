"""Read LRTrace bags: complete rosbag2 directories, bare ``.mcap`` files and cut-short recordings.

:func:`read_bag` accepts a bag directory or its ``.mcap`` file. The ``.mcap`` file is the source
of truth (``metadata.yaml`` is not needed, nor trusted): :func:`scan_mcap` parses it record by
record with a strict reader of its own that never allocates on a declared length before checking
it against the bytes there are, and that checks the CRCs the recorder writes (every chunk, the
data section and the summary; a CRC of 0 means "not computed", as in bags of older recorders).

* A file that ends with its footer and the closing magic is *complete* and must be intact.
* A file without them was *cut short* (a killed recorder, a copy that stopped, a full disk): its
  records are read up to the first one that runs past the end of the file (or into the zeros a
  power cut can leave at its end), and what was complete before the cut (every closed chunk) is
  returned, with :attr:`TraceBag.truncated` set and a warning logged -- whether or not
  ``metadata.yaml`` is there.

Anything else that is wrong -- a CRC that does not match, a length that does not add up inside
the file, an unknown record, a message on an undeclared channel, a message that does not decode
-- is corruption, not truncation: :class:`~timelyllm_ros.errors.TraceFormatError` naming the file,
the byte offset and the record or chunk. No other exception escapes for bad data.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lrtrace import format as fmt
from timelyllm_ros.errors import TraceFormatError

__all__ = ['McapScan', 'RawMessage', 'TraceBag', 'iter_raw_messages', 'mcap_file', 'read_bag',
           'scan_mcap']

logger = logging.getLogger(__name__)

MAGIC = b'\x89MCAP0\r\n'
"""The MCAP magic, at the start and at the end of a complete file."""

FOOTER_SIZE = 1 + 8 + 8 + 8 + 4
"""Bytes of the Footer record: opcode, length, summary start and offset start, summary CRC."""

HOLE_MIN_BYTES = 512
"""Zero bytes that must end a cut-short file for a record that runs into them to count as cut
(a power cut leaves whole zero-filled blocks; a few zeros are just what the record ends with)."""

MAX_CHUNK_BYTES = 1 << 30
"""Largest decompressed chunk accepted (a larger declared size is taken for corruption)."""

_U16 = struct.Struct('<H')
_U32 = struct.Struct('<I')
_U64 = struct.Struct('<Q')

# MCAP record opcodes (https://mcap.dev/spec).
_HEADER, _FOOTER, _SCHEMA, _CHANNEL, _MESSAGE, _CHUNK = 0x01, 0x02, 0x03, 0x04, 0x05, 0x06
_MESSAGE_INDEX, _CHUNK_INDEX, _ATTACHMENT, _ATTACHMENT_INDEX = 0x07, 0x08, 0x09, 0x0A
_STATISTICS, _METADATA, _METADATA_INDEX, _SUMMARY_OFFSET, _DATA_END = 0x0B, 0x0C, 0x0D, 0x0E, 0x0F

_NAMES = {
    _HEADER: 'Header', _FOOTER: 'Footer', _SCHEMA: 'Schema', _CHANNEL: 'Channel',
    _MESSAGE: 'Message', _CHUNK: 'Chunk', _MESSAGE_INDEX: 'MessageIndex',
    _CHUNK_INDEX: 'ChunkIndex', _ATTACHMENT: 'Attachment', _ATTACHMENT_INDEX: 'AttachmentIndex',
    _STATISTICS: 'Statistics', _METADATA: 'Metadata', _METADATA_INDEX: 'MetadataIndex',
    _SUMMARY_OFFSET: 'SummaryOffset', _DATA_END: 'DataEnd',
}
_DATA_ONLY = frozenset({_MESSAGE, _CHUNK, _MESSAGE_INDEX, _ATTACHMENT, _METADATA})
_SUMMARY_ONLY = frozenset({_CHUNK_INDEX, _ATTACHMENT_INDEX, _METADATA_INDEX, _STATISTICS,
                           _SUMMARY_OFFSET})
_IN_CHUNK = frozenset({_SCHEMA, _CHANNEL, _MESSAGE})


@dataclass(frozen=True, slots=True)
class RawMessage:
    """One undecoded message of a bag."""

    topic: str
    msgtype: str
    log_time_ns: int
    data: bytes
    offset: int = -1    # byte offset in the .mcap file of its record (of its chunk if compressed)


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
    truncated: bool = False                                 # the file was cut short
    truncated_at: int | None = None                         # byte where readable data stops

    @property
    def message_count(self) -> int:
        return 1 + len(self.tasks) + len(self.segments) + len(self.segment_done) + len(
            self.skills)


@dataclass(slots=True)
class McapScan:
    """What one strict pass over an ``.mcap`` file read."""

    path: Path                      # the .mcap file
    size: int                       # its size (bytes)
    messages: list[RawMessage]      # every message, in log-time order (file order within a time)
    chunks: int                     # complete chunks read
    truncated_at: int | None        # byte offset where a cut-short file stops being readable

    @property
    def truncated(self) -> bool:
        return self.truncated_at is not None


class _Corrupt(Exception):
    """A defect at a byte offset (of the file, or of a decompressed chunk until relocated)."""

    def __init__(self, pos: int, text: str) -> None:
        super().__init__(pos, text)
        self.pos = pos
        self.text = text


class _Fields:
    """Bounded reads of one record's fields: nothing is read beyond the record's end."""

    __slots__ = ('buf', 'end', 'pos', 'record')

    def __init__(self, buf: bytes, start: int, end: int, record: str) -> None:
        self.buf = buf
        self.pos = start
        self.end = end
        self.record = record

    def _take(self, size: int, name: str) -> int:
        if size > self.end - self.pos:
            raise _Corrupt(self.pos, f'{self.record} record: {name} ({size} bytes) runs past '
                                     f'the end of the record (byte {self.end})')
        start = self.pos
        self.pos += size
        return start

    def u16(self, name: str) -> int:
        return int(_U16.unpack_from(self.buf, self._take(2, name))[0])

    def u32(self, name: str) -> int:
        return int(_U32.unpack_from(self.buf, self._take(4, name))[0])

    def u64(self, name: str) -> int:
        return int(_U64.unpack_from(self.buf, self._take(8, name))[0])

    def span(self, prefix: int, name: str) -> tuple[int, int]:
        """Start and end of a field prefixed by its uint32 (``prefix=4``) or uint64 length."""
        size = self.u32(name) if prefix == 4 else self.u64(name)
        start = self._take(size, name)
        return start, start + size

    def blob(self, name: str) -> bytes:
        start, end = self.span(4, name)
        return bytes(self.buf[start:end])

    def text(self, name: str) -> str:
        start, end = self.span(4, name)
        try:
            return bytes(self.buf[start:end]).decode('utf-8')
        except UnicodeDecodeError:
            raise _Corrupt(start, f'{self.record} record: {name} is not UTF-8') from None

    def rest(self) -> bytes:
        start, self.pos = self.pos, self.end
        return bytes(self.buf[start:self.end])

    def done(self) -> None:
        if self.pos != self.end:
            raise _Corrupt(self.pos, f'{self.record} record: {self.end - self.pos} unexpected '
                                     'bytes after its last field')


def _decompress(compression: str, data: bytes, size: int) -> bytes:
    """Decompress one chunk's records (output bounded by the declared size where possible)."""
    if compression == 'zstd':
        import zstandard

        return bytes(zstandard.ZstdDecompressor().decompress(data, max_output_size=size))
    import lz4.frame

    return bytes(lz4.frame.decompress(data))


class _Scanner:
    """One strict pass over the bytes of an ``.mcap`` file (see the module docstring)."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.schemas: dict[int, tuple[str, str, bytes]] = {}            # name, encoding, data
        self.channels: dict[int, tuple[int, str, str, bytes]] = {}      # schema, topic, ...
        self.messages: list[RawMessage] = []
        self.chunks = 0
        self.seen_header = False
        self.data_end: int | None = None    # where the summary section starts (after DataEnd)

    # -- the file -----------------------------------------------------------------------------
    def scan(self) -> int | None:
        """Read every record; returns where a cut-short file stops (``None``: complete)."""
        buf = self.buf
        size = len(buf)
        if buf[:8] != MAGIC:
            if len(buf) < 8 and MAGIC.startswith(buf):
                raise TraceFormatError(f'cut short at byte {size}, inside the MCAP magic: '
                                       'nothing to recover')
            raise _Corrupt(0, 'not an MCAP file (no MCAP magic at the start)')
        complete = size >= 8 + FOOTER_SIZE + 8 and buf[-8:] == MAGIC
        limit = size - 8 - FOOTER_SIZE if complete else size
        pos = 8
        while pos < limit:
            if limit - pos < 9:
                if complete:
                    raise _Corrupt(pos, 'record header runs into the footer')
                return pos
            opcode = buf[pos]
            length = int(_U64.unpack_from(buf, pos + 1)[0])
            name = _NAMES.get(opcode)
            if name is None:
                if not complete and self._zeros_from() <= pos:
                    return pos  # only zeros from here: the hole a crash left at the end
                raise _Corrupt(pos, f'unknown record opcode 0x{opcode:02x}')
            end = pos + 9 + length
            if end > limit:
                if complete:
                    raise _Corrupt(pos, f'{name} record of {length} bytes runs past the footer '
                                        f'at byte {limit}')
                return pos      # the record the writer was writing when it stopped
            if opcode == _FOOTER:
                if complete:
                    raise _Corrupt(pos, 'Footer record before the end of the file')
                self._footer(pos, end)
                rest = buf[end:]
                if len(rest) < len(MAGIC) and MAGIC.startswith(rest):
                    return end  # cut inside the closing magic
                raise _Corrupt(end, 'the bytes after the Footer record are not the MCAP magic')
            kept = len(self.messages)
            try:
                self._record(opcode, pos, end)
            except _Corrupt:
                hole = self._zeros_from()
                if complete or hole >= end or size - hole < HOLE_MIN_BYTES:
                    raise
                del self.messages[kept:]
                return pos      # a record that runs into the hole a crash left at the end
            pos = end
        if not complete:
            return pos          # cut at a record boundary: no footer
        self._footer(limit, size - 8)
        return None

    def _zeros_from(self) -> int:
        """Where the run of zero bytes that ends the file starts (its size if there is none).

        A crash (power cut) can leave a file longer than what reached the disk, zero-filled.
        """
        return len(self.buf.rstrip(b'\x00'))

    def _footer(self, pos: int, end: int) -> None:
        """Check the Footer record (and the summary CRC it holds) against what was read."""
        buf = self.buf
        if buf[pos] != _FOOTER:
            raise _Corrupt(pos, 'no Footer record before the closing MCAP magic')
        length = int(_U64.unpack_from(buf, pos + 1)[0])
        if end - pos != FOOTER_SIZE or length != FOOTER_SIZE - 9:
            raise _Corrupt(pos, f'Footer record of {length} bytes, not {FOOTER_SIZE - 9}')
        fields = _Fields(buf, pos + 9, end, 'Footer')
        summary_start = fields.u64('summary_start')
        summary_offset_start = fields.u64('summary_offset_start')
        summary_crc = fields.u32('summary_crc')
        if self.data_end is None:
            raise _Corrupt(pos, 'no DataEnd record before the Footer record')
        if summary_start not in (0, self.data_end) or (summary_start == 0
                                                       and self.data_end != pos):
            raise _Corrupt(pos + 9, f'Footer record: summary_start {summary_start} is not '
                                    f'where the summary section starts ({self.data_end})')
        if summary_offset_start and not self.data_end <= summary_offset_start <= pos:
            raise _Corrupt(pos + 17, f'Footer record: summary_offset_start '
                                     f'{summary_offset_start} is outside the summary section')
        if summary_crc:
            actual = zlib.crc32(memoryview(buf)[self.data_end:pos + 25])
            if actual != summary_crc:
                raise _Corrupt(self.data_end, f'summary section CRC mismatch (stored '
                                              f'0x{summary_crc:08x}, computed 0x{actual:08x}): '
                                              'the summary or footer was altered')

    # -- records ------------------------------------------------------------------------------
    def _record(self, opcode: int, pos: int, end: int) -> None:
        name = _NAMES[opcode]
        fields = _Fields(self.buf, pos + 9, end, name)
        if opcode == _HEADER:
            if pos != 8:
                raise _Corrupt(pos, 'a second Header record')
            fields.text('profile')
            fields.text('library')
            fields.done()
            self.seen_header = True
            return
        if not self.seen_header:
            raise _Corrupt(pos, f'{name} record where the Header record should be')
        if self.data_end is None and opcode in _SUMMARY_ONLY:
            raise _Corrupt(pos, f'{name} record in the data section')
        if self.data_end is not None and opcode in _DATA_ONLY:
            raise _Corrupt(pos, f'{name} record after the DataEnd record')
        if opcode == _SCHEMA:
            self._schema(fields, pos)
        elif opcode == _CHANNEL:
            self._channel(fields, pos)
        elif opcode == _MESSAGE:
            self._message(fields, pos, pos, None)
        elif opcode == _CHUNK:
            self._chunk(fields, pos)
        elif opcode == _DATA_END:
            crc = fields.u32('data_section_crc')
            fields.done()
            if crc:
                actual = zlib.crc32(memoryview(self.buf)[:pos])
                if actual != crc:
                    raise _Corrupt(pos, f'data section CRC mismatch (stored 0x{crc:08x}, '
                                        f'computed 0x{actual:08x}): bytes 0..{pos} were altered')
            self.data_end = end
        elif opcode == _STATISTICS:
            self._statistics(fields, pos)
        # other records (indexes, attachments, metadata, summary offsets) are not needed

    def _schema(self, fields: _Fields, pos: int) -> None:
        schema_id = fields.u16('id')
        value = (fields.text('name'), fields.text('encoding'), fields.blob('data'))
        fields.done()
        if schema_id == 0:
            raise _Corrupt(pos, 'Schema record with the reserved id 0')
        if self.schemas.setdefault(schema_id, value) != value:
            raise _Corrupt(pos, f'Schema record redefines schema {schema_id} differently')

    def _channel(self, fields: _Fields, pos: int) -> None:
        channel_id = fields.u16('id')
        schema_id = fields.u16('schema_id')
        value = (schema_id, fields.text('topic'), fields.text('message_encoding'),
                 fields.blob('metadata'))
        fields.done()
        if schema_id and schema_id not in self.schemas:
            raise _Corrupt(pos, f'Channel record {channel_id} ({value[1]}) refers to unknown '
                                f'schema {schema_id}')
        if self.channels.setdefault(channel_id, value) != value:
            raise _Corrupt(pos, f'Channel record redefines channel {channel_id} differently')

    def _message(self, fields: _Fields, pos: int, offset: int,
                 times: tuple[int, int] | None) -> None:
        channel_id = fields.u16('channel_id')
        fields.u32('sequence')
        log_time = fields.u64('log_time')
        fields.u64('publish_time')
        data = fields.rest()
        channel = self.channels.get(channel_id)
        if channel is None:
            raise _Corrupt(pos, f'Message record on unknown channel {channel_id}')
        if times is not None and not times[0] <= log_time <= times[1]:
            raise _Corrupt(pos, f'Message record: log time {log_time} ns outside the chunk range '
                                f'{times[0]}..{times[1]} ns')
        schema = self.schemas.get(channel[0])
        self.messages.append(RawMessage(channel[1], schema[0] if schema else '', log_time, data,
                                        offset))

    def _chunk(self, fields: _Fields, pos: int) -> None:
        times = (fields.u64('message_start_time'), fields.u64('message_end_time'))
        size = fields.u64('uncompressed_size')
        crc = fields.u32('uncompressed_crc')
        compression = fields.text('compression')
        start, end = fields.span(8, 'records')
        fields.done()
        buf = self.buf
        if compression == '':
            if size != end - start:
                raise _Corrupt(pos, f'Chunk record declares {size} uncompressed bytes but holds '
                                    f'{end - start}')
        elif compression in ('zstd', 'lz4'):
            if size > MAX_CHUNK_BYTES:
                raise _Corrupt(pos, f'Chunk record declares {size} uncompressed bytes (more '
                                    f'than {MAX_CHUNK_BYTES})')
            try:
                buf = _decompress(compression, buf[start:end], size)
            except ImportError as err:
                raise TraceFormatError(f'chunk at byte {pos} is {compression}-compressed, which '
                                       f'needs a package that is not installed: {err}') from None
            except Exception as err:  # noqa: BLE001 - each codec raises its own errors
                raise _Corrupt(pos, f'{compression} Chunk record does not decompress: '
                                    f'{type(err).__name__}: {err}') from None
            if len(buf) != size:
                raise _Corrupt(pos, f'{compression} Chunk record decompresses to {len(buf)} '
                                    f'bytes, not the {size} it declares')
            start, end = 0, size
        else:
            raise _Corrupt(pos, f'Chunk record with unknown compression {compression!r}')
        if crc:
            actual = zlib.crc32(memoryview(buf)[start:end])
            if actual != crc:
                raise _Corrupt(pos, f'chunk CRC mismatch (stored 0x{crc:08x}, computed '
                                    f'0x{actual:08x}): the data of the chunk was altered')
        try:
            self._chunk_records(buf, start, end, pos if compression else None, times)
        except _Corrupt as err:
            if not compression:
                raise _Corrupt(err.pos, f'{err.text} (in the chunk at byte {pos})') from None
            raise _Corrupt(pos, f'{compression} chunk, byte {err.pos} of its records: '
                                f'{err.text}') from None
        self.chunks += 1

    def _chunk_records(self, buf: bytes, pos: int, end: int, offset: int | None,
                       times: tuple[int, int]) -> None:
        """The Schema, Channel and Message records of one chunk, which must fill it exactly."""
        while pos < end:
            if end - pos < 9:
                raise _Corrupt(pos, 'record header runs past the end of the chunk')
            opcode = buf[pos]
            length = int(_U64.unpack_from(buf, pos + 1)[0])
            stop = pos + 9 + length
            name = _NAMES.get(opcode, f'opcode 0x{opcode:02x}')
            if opcode not in _IN_CHUNK:
                raise _Corrupt(pos, f'{name} record inside a chunk')
            if stop > end:
                raise _Corrupt(pos, f'{name} record of {length} bytes runs past the end of the '
                                    f'chunk at byte {end}')
            fields = _Fields(buf, pos + 9, stop, name)
            if opcode == _SCHEMA:
                self._schema(fields, pos)
            elif opcode == _CHANNEL:
                self._channel(fields, pos)
            else:
                self._message(fields, pos, pos if offset is None else offset, times)
            pos = stop

    def _statistics(self, fields: _Fields, pos: int) -> None:
        messages = fields.u64('message_count')
        fields.u16('schema_count')
        fields.u32('channel_count')
        fields.u32('attachment_count')
        fields.u32('metadata_count')
        chunks = fields.u32('chunk_count')
        fields.u64('message_start_time')
        fields.u64('message_end_time')
        fields.span(4, 'channel_message_counts')
        fields.done()
        if (messages, chunks) != (len(self.messages), self.chunks):
            raise _Corrupt(pos, f'Statistics record counts {messages} messages in {chunks} '
                                f'chunks, the file holds {len(self.messages)} in {self.chunks}')


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


def scan_mcap(path: str | Path) -> McapScan:
    """Read every message of a bag's ``.mcap`` file, checking the file as it goes.

    Args:
        path: the bag directory or its ``.mcap`` file.

    Returns:
        The messages (undecoded, in log-time order) and, for a file that was cut short, where
        it stops; a warning is logged then.

    Raises:
        TraceFormatError: no such bag, not an MCAP file, or corrupt data (the message names the
            file, the byte offset and the record or chunk).
    """
    file = mcap_file(path)
    try:
        buf = file.read_bytes()
    except OSError as err:
        raise TraceFormatError(f'{file}: cannot read: {err.strerror or err}') from None
    except MemoryError:
        raise TraceFormatError(f'{file}: too large to read into memory') from None
    scanner = _Scanner(buf)
    try:
        cut = scanner.scan()
    except _Corrupt as err:
        raise TraceFormatError(f'{file}: corrupt at byte {err.pos}: {err.text}') from None
    except TraceFormatError as err:
        raise TraceFormatError(f'{file}: {err}') from None
    except Exception as err:  # noqa: BLE001 - last resort: bad data never escapes as a crash
        raise TraceFormatError(f'{file}: unreadable MCAP data: {type(err).__name__}: '
                               f'{err}') from err
    messages = sorted(scanner.messages, key=lambda m: m.log_time_ns)   # stable
    if cut is not None:
        note = (' although metadata.yaml says the recording was closed'
                if (file.parent / 'metadata.yaml').is_file() else '')
        logger.warning('%s: cut short at byte %d of %d%s: recovered %d messages from %d '
                       'complete chunks', file, cut, len(buf), note, len(messages),
                       scanner.chunks)
    return McapScan(file, len(buf), messages, scanner.chunks, cut)


def iter_raw_messages(path: str | Path) -> tuple[list[RawMessage], bool]:
    """Every message of a bag, undecoded, in log-time order, and whether the file was cut.

    Raises:
        TraceFormatError: see :func:`scan_mcap`.
    """
    scan = scan_mcap(path)
    return scan.messages, scan.truncated


def _decode(path: str | Path, message: RawMessage) -> Any:
    try:
        msg = fmt.deserialize(message.data, message.msgtype)
        fmt.check_message(msg, message.msgtype)
    except TraceFormatError as err:
        raise TraceFormatError(f'{path}: {message.topic} message at byte {message.offset}: '
                               f'{err}') from None
    return msg


def read_bag(path: str | Path) -> TraceBag:
    """Read and decode an LRTrace bag.

    Args:
        path: the bag directory or its ``.mcap`` file.

    Returns:
        The decoded messages by topic; other topics in the bag are ignored. A bag whose file
        was cut short holds what was complete before the cut (``truncated`` is set).

    Raises:
        TraceFormatError: missing bag, not MCAP, corrupt data, no ``/lrtrace/meta`` header, a
            format version newer than :data:`~lrtrace.format.VERSION_LATEST`, a topic with the
            wrong message type, or a message that does not decode.
    """
    scan = scan_mcap(path)
    try:
        return _bag(path, scan)
    except TraceFormatError:
        raise
    except Exception as err:  # noqa: BLE001 - last resort: bad data never escapes as a crash
        raise TraceFormatError(f'{path}: unreadable LRTrace data: {type(err).__name__}: '
                               f'{err}') from err


def _bag(path: str | Path, scan: McapScan) -> TraceBag:
    messages = scan.messages
    metas = [m for m in messages if m.topic == fmt.META_TOPIC]
    if not metas:
        if scan.truncated_at is not None:
            raise TraceFormatError(f'{scan.path}: cut short at byte {scan.truncated_at} with no '
                                   f'complete {fmt.META_TOPIC} message before it: nothing to '
                                   'recover')
        raise TraceFormatError(f'{path}: not an LRTrace bag (no {fmt.META_TOPIC} message)')
    for message in messages:
        expected = fmt.TOPICS.get(message.topic)
        if expected is not None and message.msgtype != expected:
            raise TraceFormatError(f'{path}: {message.topic} message at byte {message.offset} '
                                   f'carries {message.msgtype!r}, expected {expected!r}')
    meta = _decode(path, metas[0])
    if not 1 <= int(meta.version) <= fmt.VERSION_LATEST:
        raise TraceFormatError(f'{path}: LRTrace format version {meta.version} is not '
                               f'supported (this lrtrace reads 1..{fmt.VERSION_LATEST})')
    bag = TraceBag(path=Path(path), version=int(meta.version), source=meta.source,
                   info=dict(zip(meta.keys, meta.values, strict=False)),
                   truncated=scan.truncated, truncated_at=scan.truncated_at)
    targets = {fmt.TASKS_TOPIC: bag.tasks, fmt.SEGMENTS_TOPIC: bag.segments,
               fmt.SEGMENT_DONE_TOPIC: bag.segment_done, fmt.SKILLS_TOPIC: bag.skills}
    for message in messages:
        target = targets.get(message.topic)
        if target is not None:
            target.append(_decode(path, message))
    return bag


def iter_bags(paths: list[str | Path] | tuple[str | Path, ...]) -> Iterator[TraceBag]:
    """Read several bags in turn (see :func:`read_bag`)."""
    for path in paths:
        yield read_bag(path)
