"""Corrupt and cut LRTrace bags (issue 13, item 9): a clear TraceFormatError or the flushed data,
never a crash and never altered data read back as if it were intact."""

from __future__ import annotations

import io
import logging
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mcap.reader import make_reader
from mcap.stream_reader import StreamReader
from mcap.writer import CompressionType, Writer
from utils import load_benchmark

from lrtrace import format as fmt
from lrtrace.cli import main
from lrtrace.reader import iter_raw_messages, read_bag, scan_mcap
from lrtrace.recorder import TraceRecorder
from timelyllm_ros.errors import TraceFormatError
from timelyllm_ros.robots.backend import SkillRecord

GROUPS = 4          # chunks of skills after the header chunk
PER_GROUP = 5       # skills per chunk


def _load_campaign():
    return load_benchmark('bag_faults')


def _skill(i: int) -> SkillRecord:
    return SkillRecord('move_forward', f'mf({20 + i})', {}, float(i), i + 0.5, True)


@pytest.fixture(scope='module')
def small_bag(tmp_path_factory) -> Path:
    """A bag of one header chunk and GROUPS chunks of PER_GROUP skills (flushed in turn)."""
    path = tmp_path_factory.mktemp('bags') / 'small'
    with TraceRecorder(path, chunk_size=1 << 20, source='faults') as recorder:
        for group in range(GROUPS):
            for i in range(PER_GROUP):
                recorder.record_skill('tello-01', 'task-0', group, _skill(group * PER_GROUP + i))
            recorder.flush()
    return path


def _records(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(opcode, start, end)`` of the records in ``data[start:end]`` (an intact file)."""
    while start + 9 <= end:
        opcode, length = struct.unpack_from('<BQ', data, start)
        yield opcode, start, start + 9 + length
        start += 9 + length


def _chunks(data: bytes) -> list[tuple[int, int, int]]:
    """``(record start, records start, record end)`` of every (uncompressed) chunk."""
    return [(start, start + 49, end) for opcode, start, end in _records(data, 8, len(data) - 8)
            if opcode == 0x06]


def _without_crcs(data: bytes) -> bytes:
    """The file as recorders before CRCs wrote it: every CRC 0 ("not computed")."""
    out = bytearray(data)
    for opcode, start, _ in _records(data, 8, len(data) - 8):
        if opcode == 0x06:
            out[start + 33:start + 37] = bytes(4)
        elif opcode == 0x0F:
            out[start + 9:start + 13] = bytes(4)
    out[-12:-8] = bytes(4)
    return bytes(out)


def _copy(bag: Path, dest: Path, data: bytes, metadata: bool = True) -> Path:
    dest.mkdir(parents=True)
    (dest / f'{dest.name}.mcap').write_bytes(data)
    if metadata:
        shutil.copy(bag / 'metadata.yaml', dest / 'metadata.yaml')
    return dest


def _data(bag: Path) -> bytes:
    return (bag / f'{bag.name}.mcap').read_bytes()


# -- CRCs -----------------------------------------------------------------------------------------
def test_recorder_writes_chunk_data_and_summary_crcs(small_bag):
    data = _data(small_bag)
    chunks = _chunks(data)
    assert len(chunks) == GROUPS + 1
    for start, records, end in chunks:
        stored = struct.unpack_from('<I', data, start + 33)[0]
        assert stored == zlib.crc32(data[records:end]) != 0
    data_end = [s for op, s, _ in _records(data, 8, len(data) - 8) if op == 0x0F]
    assert struct.unpack_from('<I', data, data_end[0] + 9)[0] == zlib.crc32(data[:data_end[0]])
    assert struct.unpack_from('<I', data, len(data) - 12)[0] != 0
    # the mcap package checks the chunk and data-section CRCs as the specification defines them
    records = list(StreamReader(io.BytesIO(data), validate_crcs=True).records)
    assert sum(type(r).__name__ == 'Message' for r in records) == 1 + GROUPS * PER_GROUP
    reader = make_reader(io.BytesIO(data), validate_crcs=True)
    assert sum(1 for _ in reader.iter_messages()) == 1 + GROUPS * PER_GROUP


def test_a_bit_flip_in_chunk_data_is_a_crc_error(small_bag, tmp_path):
    data = _data(small_bag)
    for k, (start, records, end) in enumerate(_chunks(data)):
        for offset in (records, (records + end) // 2, end - 1):
            flipped = bytearray(data)
            flipped[offset] ^= 0x10
            bag = _copy(small_bag, tmp_path / f'flip{k}-{offset}', bytes(flipped))
            with pytest.raises(TraceFormatError, match=f'byte {start}: chunk CRC mismatch'):
                read_bag(bag)
            # cut short after the flipped chunk: still an error, not a recovery
            for tail in (0, 3):
                cut = _copy(small_bag, tmp_path / f'cut{k}-{offset}-{tail}',
                            bytes(flipped[:end + tail]), metadata=False)
                with pytest.raises(TraceFormatError, match='chunk CRC mismatch'):
                    read_bag(cut)


def test_data_section_and_summary_crcs_cover_the_bytes_outside_chunks(small_bag, tmp_path):
    data = _data(small_bag)
    index = next(s for op, s, _ in _records(data, 8, len(data) - 8) if op == 0x07)
    summary = next(s for op, s, _ in _records(data, 8, len(data) - 8) if op == 0x08)
    for name, offset, match in (('index', index + 12, 'data section CRC mismatch'),
                                ('summary', summary + 12, 'summary section CRC mismatch')):
        damaged = bytearray(data)
        damaged[offset] ^= 0x01
        with pytest.raises(TraceFormatError, match=match):
            read_bag(_copy(small_bag, tmp_path / name, bytes(damaged)))


def test_every_byte_changed_is_detected_or_harmless(small_bag, tmp_path):
    data = _data(small_bag)
    original = iter_raw_messages(small_bag)[0]
    offsets = sorted(set(range(64)) | set(range(len(data) - 400, len(data)))
                     | set(range(64, len(data), 13)))
    path = tmp_path / 'damaged.mcap'
    for offset in offsets:
        damaged = bytearray(data)
        damaged[offset] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            read_bag(path)
            messages, truncated = iter_raw_messages(path)
        except TraceFormatError as err:
            assert str(path) in str(err) and 'byte ' in str(err), (offset, str(err))
        else:   # only a change that makes a CRC read 0 can pass, and then the data is intact
            assert messages == original and not truncated, offset


# -- corrupt structure (no CRC to catch it: bags of older recorders) ------------------------------
def _inner(data: bytes, chunk: tuple[int, int, int], opcode: int) -> int:
    return next(s for op, s, _ in _records(data, chunk[1], chunk[2]) if op == opcode)


@pytest.mark.parametrize('where', ['header length', 'chunk records length', 'chunk size',
                                   'schema name length', 'message length', 'record opcode',
                                   'channel id'])
def test_absurd_lengths_and_bad_fields_are_trace_format_errors(small_bag, tmp_path, where):
    """Lengths that used to raise OverflowError, MemoryError or struct.error."""
    data = bytearray(_without_crcs(_data(small_bag)))
    first, second = _chunks(bytes(data))[:2]
    if where == 'header length':
        offset, value = 9, struct.pack('<Q', 2**64 - 1)
    elif where == 'chunk records length':
        offset, value = second[0] + 41, struct.pack('<Q', 2**63)
    elif where == 'chunk size':
        offset, value = second[0] + 25, struct.pack('<Q', 2**64 - 2)
    elif where == 'schema name length':
        offset, value = _inner(bytes(data), first, 0x03) + 11, struct.pack('<I', 2**32 - 1)
    elif where == 'message length':
        offset, value = _inner(bytes(data), second, 0x05) + 1, struct.pack('<Q', 2**62)
    elif where == 'record opcode':
        offset, value = second[0], b'\x42'
    else:
        offset, value = _inner(bytes(data), second, 0x05) + 9, struct.pack('<H', 999)
    data[offset:offset + len(value)] = value
    bag = _copy(small_bag, tmp_path / 'bag', bytes(data))
    with pytest.raises(TraceFormatError, match=r'bag\.mcap: corrupt at byte \d+: ') as info:
        read_bag(bag)
    assert info.value.__cause__ is None
    assert main(['inspect', str(bag)]) == 1


@pytest.mark.parametrize('where', ['chunk records length', 'schema name length',
                                   'short message length', 'channel metadata length'])
def test_fields_a_little_longer_or_shorter_than_their_record_are_errors(small_bag, tmp_path,
                                                                         where):
    """A field length that stays inside the file (no CRC to catch it) still does not read."""
    data = bytearray(_without_crcs(_data(small_bag)))
    first, second = _chunks(bytes(data))[:2]
    if where == 'chunk records length':
        offset = second[0] + 41
        value = struct.pack('<Q', struct.unpack_from('<Q', data, offset)[0] + 1)
    elif where == 'schema name length':
        offset = _inner(bytes(data), first, 0x03) + 11
        value = struct.pack('<I', struct.unpack_from('<I', data, offset)[0] + 3)
    elif where == 'short message length':
        offset, value = _inner(bytes(data), second, 0x05) + 1, struct.pack('<Q', 10)
    else:
        channel = _inner(bytes(data), first, 0x04)
        topic = struct.unpack_from('<I', data, channel + 13)[0]
        encoding = struct.unpack_from('<I', data, channel + 17 + topic)[0]
        offset = channel + 21 + topic + encoding
        value = struct.pack('<I', struct.unpack_from('<I', data, offset)[0] - 1)
    data[offset:offset + len(value)] = value
    bag = _copy(small_bag, tmp_path / 'bag', bytes(data))
    with pytest.raises(TraceFormatError, match=r'bag\.mcap: corrupt at byte \d+: ') as info:
        read_bag(bag)
    assert info.value.__cause__ is None


def test_bags_without_crcs_still_read(small_bag, tmp_path):
    bag = _copy(small_bag, tmp_path / 'old', _without_crcs(_data(small_bag)))
    read = read_bag(bag)
    assert not read.truncated and len(read.skills) == GROUPS * PER_GROUP


def test_inconsistent_task_record_is_a_trace_format_error(tmp_path):
    recorder = TraceRecorder(tmp_path / 'bag')
    recorder.open()
    msg = fmt.message_class(fmt.TASK_RECORD)(
        robot_id='r', task_id='t', profile='tello', task_class='normal', task_type='T1',
        task='x', tuf=fmt.message_class(f'{fmt.PACKAGE}/msg/TimeUtility')(
            ert_s=1.0, alpha=1.0, beta=1.0), arrival_stamp=fmt.stamp(0.0), prompt_tokens=1,
        task_tokens=1, text='', token_pieces=[], cut_tokens=np.array([1, 2], dtype=np.uint32),
        cut_stamps=[fmt.stamp(1.0)], dispatch_stamps=[], start_stamps=[], end_stamps=[],
        estimated_execution_s=np.array([], dtype=np.float64), segment_texts=[],
        segment_success=np.array([], dtype=np.bool_), segment_errors=[], status='FINISHED',
        finish_reason='eos', error='', suspensions=0, preemptions=0, done_stamp=fmt.stamp(1.0))
    recorder._write(fmt.TASKS_TOPIC, msg, 1)
    recorder.close()
    with pytest.raises(TraceFormatError, match=r'/lrtrace/tasks message at byte \d+: .*differ'):
        read_bag(tmp_path / 'bag')


# -- truncation -----------------------------------------------------------------------------------
@pytest.mark.parametrize('metadata', [True, False], ids=['with-metadata', 'without-metadata'])
def test_cut_bags_recover_every_complete_chunk(small_bag, tmp_path, metadata, caplog):
    data = _data(small_bag)
    ends = [end for _, _, end in _chunks(data)]
    cuts = sorted({c for end in ends for c in (end - 1, end, end + 1)} | {
        len(data) - 1, len(data) - 8, len(data) - 40, 0, 5, 8, 20})
    for cut in cuts:
        complete = sum(end <= cut for end in ends)
        bag = _copy(small_bag, tmp_path / f'cut{cut}', data[:cut], metadata=metadata)
        if complete == 0:
            header_end = _chunks(data)[0][0]
            first = cut if cut < 8 else 8 if cut < header_end else header_end
            with pytest.raises(TraceFormatError,
                               match=f'cut short at byte {first}\\b.*nothing to recover'):
                read_bag(bag)
            continue
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger='lrtrace.reader'):
            read = read_bag(bag)
        assert read.truncated and read.truncated_at is not None and read.truncated_at <= cut
        assert len(read.skills) == PER_GROUP * (complete - 1), cut
        assert [s.segment_index for s in read.skills] == sorted(
            s.segment_index for s in read.skills)
        assert 'cut short' in caplog.text and ('metadata.yaml' in caplog.text) == metadata
    assert main(['inspect', str(tmp_path / f'cut{ends[2]}')]) == 0


def test_the_zero_filled_end_a_power_cut_leaves_counts_as_cut(small_bag, tmp_path):
    data = _data(small_bag)
    ends = [end for _, _, end in _chunks(data)]
    for name, cut, complete in (('boundary', ends[2], 3), ('inside', ends[3] - 100, 3),
                                ('index', ends[1] + 5, 2)):
        holed = data[:cut] + bytes(-cut % 4096 + 4096)
        read = read_bag(_copy(small_bag, tmp_path / name, holed, metadata=False))
        assert read.truncated and len(read.skills) == PER_GROUP * (complete - 1), name
    # a few zeros at the end are no hole: a chunk that runs into them is corrupt
    damaged = data[:ends[3] - 100] + bytes(100)
    with pytest.raises(TraceFormatError, match='chunk CRC mismatch'):
        read_bag(_copy(small_bag, tmp_path / 'zeros', damaged, metadata=False))


def test_killed_recording_without_footer_reads_to_its_last_chunk(tmp_path):
    recorder = TraceRecorder(tmp_path / 'killed', chunk_size=1 << 20, source='killed')
    recorder.open()
    for i in range(7):
        recorder.record_skill('tello-01', 'task-0', i, _skill(i))
    recorder.flush()
    recorder.record_skill('tello-01', 'task-0', 7, _skill(7))   # in the open chunk: lost
    read = read_bag(tmp_path / 'killed')    # the recorder is still open: no footer yet
    assert read.truncated and len(read.skills) == 7 and read.source == 'killed'
    recorder.close()
    assert not read_bag(tmp_path / 'killed').truncated


# -- other MCAP writers ---------------------------------------------------------------------------
@pytest.mark.parametrize('compression', [CompressionType.NONE, CompressionType.ZSTD,
                                         CompressionType.LZ4])
def test_files_of_the_mcap_writer_read_and_their_corruption_is_detected(tmp_path, compression):
    path = tmp_path / 'other.mcap'
    with path.open('wb') as stream:
        writer = Writer(stream, chunk_size=300, compression=compression, enable_crcs=True,
                        enable_data_crcs=True)
        writer.start('ros2', 'test')
        channels = {topic: writer.register_channel(topic, 'cdr', writer.register_schema(
            msgtype, 'ros2msg', b'')) for topic, msgtype in fmt.TOPICS.items()}
        meta = fmt.message_class(fmt.TRACE_META)(version=1, producer='mcap', source='other',
                                                 keys=[], values=[])
        writer.add_message(channels[fmt.META_TOPIC], 0, fmt.serialize(meta), 0)
        for i in range(12):
            msg = fmt.message_class(fmt.SKILL_EXECUTION)(
                robot_id='r', goal_id='g', segment_index=i, skill='mf', call='mf(1)',
                start_stamp=fmt.stamp(i), end_stamp=fmt.stamp(i + 0.5), success=True, error='')
            writer.add_message(channels[fmt.SKILLS_TOPIC], i * 10**9, fmt.serialize(msg), i)
        writer.finish()
    data = path.read_bytes()
    scan = scan_mcap(path)
    assert scan.chunks > 2 and not scan.truncated and len(read_bag(path).skills) == 12
    chunks = [(s, e) for op, s, e in _records(data, 8, len(data) - 8) if op == 0x06]
    cut = tmp_path / 'cut.mcap'
    cut.write_bytes(data[:chunks[1][1] + 1])
    assert 0 < len(read_bag(cut).skills) < 12 and read_bag(cut).truncated
    chunk = chunks[0][0]
    damaged = bytearray(data)
    damaged[chunk + 60] ^= 0x04
    cut.write_bytes(bytes(damaged))
    with pytest.raises(TraceFormatError, match=f'byte {chunk}: '):
        read_bag(cut)


# -- the campaign ---------------------------------------------------------------------------------
def test_bag_fault_campaign_finds_no_crash_and_no_silent_corruption(tmp_path):
    result = _load_campaign().run_bag_campaign(seed=1, cases=50, workdir=tmp_path)
    assert result['cases'] == 50
    assert result['crashes'] == 0 and result['silent_corruptions'] == 0, result['problems']
    assert result['under_recovered_truncations'] == 0 and result['unclear_errors'] == 0
    assert result['recovered_truncations'] > 0 and result['detected'] > 0
    assert set(result['by_kind']) == {'byte', 'bitflip', 'truncate', 'truncate-no-metadata',
                                      'zero'}
