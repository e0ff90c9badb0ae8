"""Read LRTrace bags: complete rosbag2 directories, bare ``.mcap`` files and cut-short recordings.

:func:`read_bag` accepts a bag directory or its ``.mcap`` file. The ``.mcap`` file is the source
of truth (``metadata.yaml`` is not needed, nor trusted): :func:`scan_mcap` walks it record by
record. The ``mcap`` package parses each record it needs (its
:class:`~mcap.stream_reader.StreamReader`) and decompresses and CRC-checks each chunk; this module
checks each record's place and length against the file before it is parsed, that it holds
exactly its fields, that records come in the order the MCAP specification gives them and that
messages are on declared channels, and it checks the data-section and summary CRCs (the package
cannot here: see :func:`_parse`). A CRC of 0 means "not computed", as in bags of older recorders.

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

import io
import logging
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcap.data_stream import RecordBuilder
from mcap.exceptions import UnsupportedCompressionError
from mcap.opcode import Opcode
from mcap.records import Channel, Chunk, DataEnd, Footer, McapRecord, Message, Schema, Statistics
from mcap.stream_reader import CRCValidationError, StreamReader, get_chunk_data_stream

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

_RECORD_HEADER = struct.Struct('<BQ')
"""What every MCAP record starts with: its opcode and the length of its fields."""

_COMPRESSIONS = ('', 'zstd', 'lz4')
_DATA_ONLY = frozenset({Opcode.MESSAGE, Opcode.CHUNK, Opcode.MESSAGE_INDEX, Opcode.ATTACHMENT,
                        Opcode.METADATA})
_SUMMARY_ONLY = frozenset({Opcode.CHUNK_INDEX, Opcode.ATTACHMENT_INDEX, Opcode.METADATA_INDEX,
                           Opcode.STATISTICS, Opcode.SUMMARY_OFFSET})
# the records parsed; the others (indexes, attachments, metadata) are skipped over, unread
_NEEDED = frozenset({Opcode.HEADER, Opcode.SCHEMA, Opcode.CHANNEL, Opcode.MESSAGE, Opcode.CHUNK,
                     Opcode.DATA_END, Opcode.STATISTICS})
_IN_CHUNK = frozenset({Opcode.SCHEMA, Opcode.CHANNEL, Opcode.MESSAGE})


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


def _record_header(buf: bytes, start: int, limit: int) -> tuple[int, int] | None:
    """The opcode and length of the record at ``start`` (``None``: they run past ``limit``)."""
    if limit - start < _RECORD_HEADER.size:
        return None
    opcode, length = _RECORD_HEADER.unpack_from(buf, start)
    return int(opcode), int(length)


_NAMES = {int(opcode): opcode.name.title().replace('_', '') for opcode in Opcode}
"""Record names by opcode (``ChunkIndex``), as the ``mcap`` package's record classes have them."""


def _name(opcode: int) -> str | None:
    """The record name of an opcode, ``None`` for an unknown one."""
    return _NAMES.get(opcode)


def _parse(buf: bytes, start: int, end: int) -> McapRecord:
    """The record at ``buf[start:end]``, parsed by the ``mcap`` package's stream reader.

    A fresh reader reads just this record, from a :class:`io.BytesIO` set at ``start``: one
    reader over the whole file stops for good at the first record it cannot parse, and it
    parses every kind of record, while this module reads past the ones it does not need (so
    that the data-section and summary CRCs, checked after them, name what was altered). A
    field longer than its record reads on into the bytes after it (short at the end of
    ``buf``: nothing is allocated beyond it); the record, written back by the package, must
    then give back its bytes exactly.

    Raises:
        _Corrupt: the fields do not parse, or do not hold exactly the record's bytes.
    """
    stream = io.BytesIO(buf)
    stream.seek(start)
    records = StreamReader(stream, skip_magic=True, emit_chunks=True,
                           record_size_limit=len(buf)).records
    name = _name(buf[start])
    try:
        record = next(records)
    except Exception as err:  # noqa: BLE001 - struct.error, EndOfFile, UnicodeDecodeError, ...
        text = f': {err}' if str(err) else ''
        raise _Corrupt(start, f'{name} record does not parse ({type(err).__name__}{text})'
                       ) from None
    # Written back by the package, the record must give its bytes again: the reader skips what
    # follows the last field, and reads a map on to the end of the entry its length ends in.
    builder = RecordBuilder()
    record.write(builder)
    written = builder.end()  # type: ignore[no-untyped-call]  # mcap leaves it unannotated
    if memoryview(buf)[start:end] != written:
        size = len(written) - _RECORD_HEADER.size
        how = (f'its fields read as {size} bytes' if size != end - start - 9 else
               'a length inside it does not match what it holds')
        raise _Corrupt(start, f'{name} record of {end - start - 9} bytes: {how}')
    return record


class _Scanner:
    """One strict pass over the bytes of an ``.mcap`` file (see the module docstring)."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.size = len(buf)
        self.complete = self.size >= 2 * len(MAGIC) + FOOTER_SIZE and buf[-8:] == MAGIC
        self.limit = self.size - len(MAGIC) - FOOTER_SIZE if self.complete else self.size
        self.schemas: dict[int, Schema] = {}
        self.channels: dict[int, Channel] = {}
        self.messages: list[RawMessage] = []
        self.chunks = 0
        self.seen_header = False
        self.data_end: int | None = None    # where the summary section starts (after DataEnd)
        self._zeros: int | None = None

    # -- the file -----------------------------------------------------------------------------
    def scan(self) -> int | None:
        """Read every record; returns where a cut-short file stops (``None``: complete)."""
        self._magic()
        pos = len(MAGIC)
        while True:
            end = self._frame(pos)
            if end is None:
                return pos      # the record the writer was writing when it stopped
            opcode = self.buf[pos]
            if opcode == Opcode.FOOTER:
                return self._footer(_parse(self.buf, pos, end), pos, end)
            try:
                self._record(opcode, pos, end)
            except _Corrupt:
                if not self._runs_into_hole(end):
                    raise
                return pos      # a record that runs into the hole a crash left at the end
            pos = end

    def _magic(self) -> None:
        """Check the opening magic (a cut inside it is not a bad one)."""
        head = self.buf[:len(MAGIC)]
        if head == MAGIC:
            return
        if len(head) < len(MAGIC) and MAGIC.startswith(head):
            raise TraceFormatError(f'cut short at byte {self.size}, inside the MCAP magic: '
                                   'nothing to recover')
        raise _Corrupt(0, 'not an MCAP file (no MCAP magic at the start)')

    def _frame(self, start: int) -> int | None:
        """Where the record at ``start`` ends, checked against the file before it is read.

        Returns ``None`` where a cut-short file stops: a record that runs past its end, or the
        zeros a crash left there.

        Raises:
            _Corrupt: an unknown opcode, a record that runs into the footer, or a Footer
                record out of place or of the wrong size.
        """
        if self.complete and start == self.limit:
            if _record_header(self.buf, start, self.size) != (Opcode.FOOTER, FOOTER_SIZE - 9):
                raise _Corrupt(start, 'no Footer record of the right size before the closing '
                                      'MCAP magic')
            return self.size - len(MAGIC)
        header = _record_header(self.buf, start, self.limit)
        if header is None:
            if self.complete:
                raise _Corrupt(start, 'record header runs into the footer')
            return None
        opcode, length = header
        name = _name(opcode)
        if name is None:
            if not self.complete and self._zeros_from() <= start:
                return None     # only zeros from here: the hole a crash left at the end
            raise _Corrupt(start, f'unknown record opcode 0x{opcode:02x}')
        end = start + 9 + length
        if end > self.limit:
            if self.complete:
                raise _Corrupt(start, f'{name} record of {length} bytes runs past the footer '
                                      f'at byte {self.limit}')
            return None
        if opcode == Opcode.FOOTER and (self.complete or length != FOOTER_SIZE - 9):
            raise _Corrupt(start, f'Footer record of {length} bytes before the end of the file')
        return end

    def _zeros_from(self) -> int:
        """Where the run of zero bytes that ends the file starts (its size if there is none).

        A crash (power cut) can leave a file longer than what reached the disk, zero-filled.
        """
        if self._zeros is None:
            self._zeros = len(self.buf.rstrip(b'\x00'))
        return self._zeros

    def _runs_into_hole(self, end: int) -> bool:
        """Whether a record that does not read runs into a hole of zeros ending a cut file."""
        hole = self._zeros_from()
        return not self.complete and hole < end and self.size - hole >= HOLE_MIN_BYTES

    def _footer(self, footer: McapRecord, start: int, end: int) -> int | None:
        """Check the Footer record against what was read; returns where a cut file stops."""
        assert isinstance(footer, Footer)
        data_end = self.data_end
        if data_end is None:
            raise _Corrupt(start, 'no DataEnd record before the Footer record')
        summary_start = footer.summary_start
        if summary_start not in (0, data_end) or (summary_start == 0 and data_end != start):
            raise _Corrupt(start + 9, f'Footer record: summary_start {summary_start} is not '
                                      f'where the summary section starts ({data_end})')
        offsets = footer.summary_offset_start
        if offsets and not data_end <= offsets <= start:
            raise _Corrupt(start + 17, f'Footer record: summary_offset_start {offsets} is '
                                       'outside the summary section')
        # The mcap package does not check this CRC (1.6.0: neither its stream reader nor its
        # seeking reader): it covers the summary section and the footer up to the CRC.
        self._crc('summary section', footer.summary_crc, data_end, end - 4, data_end,
                  'the summary or footer was altered')
        if self.complete:
            return None
        rest = self.buf[end:]
        if len(rest) < len(MAGIC) and MAGIC.startswith(rest):
            return end  # cut inside the closing magic
        raise _Corrupt(end, 'the bytes after the Footer record are not the MCAP magic')

    def _crc(self, what: str, stored: int, start: int, end: int, pos: int, altered: str) -> None:
        """Check a CRC of ``buf[start:end]`` (0: not computed); an error names byte ``pos``."""
        actual = zlib.crc32(memoryview(self.buf)[start:end]) if stored else 0
        if actual != stored:
            raise _Corrupt(pos, f'{what} CRC mismatch (stored 0x{stored:08x}, computed '
                                  f'0x{actual:08x}): {altered}')

    # -- records ------------------------------------------------------------------------------
    def _record(self, opcode: int, start: int, end: int) -> None:
        """Check one record of the data or summary section and keep what it declares."""
        name = _name(opcode)
        if opcode == Opcode.HEADER and start != len(MAGIC):
            raise _Corrupt(start, 'a second Header record')
        if opcode != Opcode.HEADER and not self.seen_header:
            raise _Corrupt(start, f'{name} record where the Header record should be')
        if self.data_end is None and opcode in _SUMMARY_ONLY:
            raise _Corrupt(start, f'{name} record in the data section')
        if self.data_end is not None and opcode in _DATA_ONLY:
            raise _Corrupt(start, f'{name} record after the DataEnd record')
        if opcode not in _NEEDED:
            return  # indexes, attachments, metadata: not needed (and covered by the CRCs)
        record = _parse(self.buf, start, end)
        if opcode == Opcode.HEADER:
            self.seen_header = True
        elif isinstance(record, Schema):
            self._schema(record, start)
        elif isinstance(record, Channel):
            self._channel(record, start)
        elif isinstance(record, Message):
            self.messages.append(self._message(record, start, start, None))
        elif isinstance(record, Chunk):
            self._chunk(record, start, end)
        elif isinstance(record, DataEnd):
            # The mcap stream reader checks this CRC only in one pass over the whole file,
            # which this module does not make (see _parse): every byte before the record.
            self._crc('data section', record.data_section_crc, 0, start, start,
                      f'bytes 0..{start} were altered')
            self.data_end = end
        elif isinstance(record, Statistics):
            self._statistics(record, start)

    def _schema(self, schema: Schema, pos: int) -> None:
        if schema.id == 0:
            raise _Corrupt(pos, 'Schema record with the reserved id 0')
        if self.schemas.setdefault(schema.id, schema) != schema:
            raise _Corrupt(pos, f'Schema record redefines schema {schema.id} differently')

    def _channel(self, channel: Channel, pos: int) -> None:
        if channel.schema_id and channel.schema_id not in self.schemas:
            raise _Corrupt(pos, f'Channel record {channel.id} ({channel.topic}) refers to '
                                f'unknown schema {channel.schema_id}')
        if self.channels.setdefault(channel.id, channel) != channel:
            raise _Corrupt(pos, f'Channel record redefines channel {channel.id} differently')

    def _message(self, message: Message, pos: int, offset: int,
                 times: tuple[int, int] | None) -> RawMessage:
        channel = self.channels.get(message.channel_id)
        if channel is None:
            raise _Corrupt(pos, f'Message record on unknown channel {message.channel_id}')
        log_time = message.log_time
        if times is not None and not times[0] <= log_time <= times[1]:
            raise _Corrupt(pos, f'Message record: log time {log_time} ns outside the chunk range '
                                f'{times[0]}..{times[1]} ns')
        schema = self.schemas.get(channel.schema_id)
        return RawMessage(channel.topic, schema.name if schema else '', log_time,
                          bytes(message.data), offset)

    def _chunk(self, chunk: Chunk, start: int, end: int) -> None:
        """Read one chunk's records; its messages are kept only if all of it reads."""
        compression = chunk.compression
        data = self._chunk_data(chunk, start)
        base = None if compression else end - len(chunk.data)   # file offset of its records
        try:
            messages = self._chunk_records(data, base, start, chunk)
        except _Corrupt as err:
            if base is not None:
                raise _Corrupt(base + err.pos, f'{err.text} (in the chunk at byte {start})'
                               ) from None
            raise _Corrupt(start, f'{compression} chunk, byte {err.pos} of its records: '
                                  f'{err.text}') from None
        self.messages.extend(messages)
        self.chunks += 1

    def _chunk_data(self, chunk: Chunk, start: int) -> bytes:
        """The records of a chunk, decompressed and CRC-checked by the ``mcap`` package."""
        compression, size = chunk.compression, chunk.uncompressed_size
        if compression not in _COMPRESSIONS:    # the package would take them for uncompressed
            raise _Corrupt(start, f'Chunk record with unknown compression {compression!r}')
        if not compression and size != len(chunk.data):
            raise _Corrupt(start, f'Chunk record declares {size} uncompressed bytes but holds '
                                  f'{len(chunk.data)}')
        if size > MAX_CHUNK_BYTES:  # the package would allocate it to decompress into
            raise _Corrupt(start, f'Chunk record declares {size} uncompressed bytes (more '
                                  f'than {MAX_CHUNK_BYTES})')
        try:
            stream, length = get_chunk_data_stream(chunk, validate_crc=True)
        except UnsupportedCompressionError as err:
            raise TraceFormatError(f'chunk at byte {start} is {compression}-compressed, which '
                                   f'needs a package that is not installed: {err}') from None
        except CRCValidationError as err:
            raise _Corrupt(start, f'chunk CRC mismatch (stored 0x{err.expected:08x}, computed '
                                  f'0x{err.actual:08x}): the data of the chunk was altered'
                           ) from None
        except Exception as err:  # noqa: BLE001 - each codec raises its own errors
            raise _Corrupt(start, f'{compression} Chunk record does not decompress: '
                                  f'{type(err).__name__}: {err}') from None
        if length != size:
            raise _Corrupt(start, f'{compression} Chunk record decompresses to {length} '
                                  f'bytes, not the {size} it declares')
        return stream.read(length)

    def _chunk_records(self, data: bytes, base: int | None, start: int,
                       chunk: Chunk) -> list[RawMessage]:
        """The Schema, Channel and Message records of one chunk, which must fill it exactly.

        Offsets in errors are of ``data``; a message's is of its record in the file (``base``
        is where the records start) or of its chunk (``start``) when compressed.
        """
        times = (chunk.message_start_time, chunk.message_end_time)
        messages = []
        pos = 0
        while pos < len(data):
            end = _chunk_frame(data, pos)
            record = _parse(data, pos, end)
            if isinstance(record, Schema):
                self._schema(record, pos)
            elif isinstance(record, Channel):
                self._channel(record, pos)
            elif isinstance(record, Message):
                offset = start if base is None else base + pos
                messages.append(self._message(record, pos, offset, times))
            pos = end
        return messages

    def _statistics(self, statistics: Statistics, pos: int) -> None:
        counts = (statistics.message_count, statistics.chunk_count)
        if counts != (len(self.messages), self.chunks):
            raise _Corrupt(pos, f'Statistics record counts {counts[0]} messages in {counts[1]} '
                                f'chunks, the file holds {len(self.messages)} in {self.chunks}')


def _chunk_frame(data: bytes, pos: int) -> int:
    """Where the record at ``pos`` of a chunk's records ends, checked before it is read.

    Raises:
        _Corrupt: a record other than Schema, Channel and Message, or one that runs past the
            end of the chunk.
    """
    header = _record_header(data, pos, len(data))
    if header is None:
        raise _Corrupt(pos, 'record header runs past the end of the chunk')
    opcode, length = header
    name = _name(opcode) or f'opcode 0x{opcode:02x}'
    if opcode not in _IN_CHUNK:
        raise _Corrupt(pos, f'{name} record inside a chunk')
    end = pos + 9 + length
    if end > len(data):
        raise _Corrupt(pos, f'{name} record of {length} bytes runs past the end of the chunk '
                            f'at byte {len(data)}')
    return end


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
