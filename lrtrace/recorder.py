"""Record LRTrace bags: rosbag2 directories in MCAP storage, written through rosbags.

:class:`TraceRecorder` is a context-manager writer (STYLE.md habit 17): it refuses to overwrite
an existing path, writes the :data:`~lrtrace.format.VERSION_LATEST` header message first and
stores one message per task, segment, segment execution and skill execution (see
:mod:`lrtrace.format`).

Crash safety: rosbags' MCAP writer keeps the open chunk in memory and only closes a chunk at
1 MiB, writing it through a buffered file. The recorder closes the chunk itself as soon as it
holds ``chunk_size`` bytes and flushes the file (optionally ``fsync``) after every chunk, so a
recorder killed with SIGKILL leaves an ``.mcap`` file that is readable up to its last closed
chunk. Such a file has no summary section, no footer and no ``metadata.yaml``;
:mod:`lrtrace.reader` reads it up to where it stops.

Corruption is detected: rosbags writes every CRC of the MCAP file as 0 ("not computed"); the
recorder writes the CRC-32 of every chunk's records as the chunk is written, and on close the
data-section CRC (``DataEnd``) and the summary CRC (``Footer``), as the MCAP specification
defines them, so that a reader (:mod:`lrtrace.reader`, the ``mcap`` package) refuses altered
bytes instead of returning altered data.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from io import BytesIO
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from rosbags.interfaces import Connection
from rosbags.rosbag2 import StoragePlugin, Writer, WriterError
from rosbags.rosbag2.enums import CompressionMode
from rosbags.rosbag2.storage_mcap import McapWriter

from lrtrace import format as fmt
from timelyllm_ros.core.request import Generation, Segment, TaskSpec
from timelyllm_ros.core.task_record import STAMP_FIELDS, STAMP_LIST_FIELDS, task_record_fields
from timelyllm_ros.errors import TraceFormatError
from timelyllm_ros.language.execution import MeasuredTimes
from timelyllm_ros.language.plan import SkillCall
from timelyllm_ros.language.profiles import RobotProfile, load_profile
from timelyllm_ros.language.segmenter import segment_text
from timelyllm_ros.robots.backend import SkillRecord

__all__ = ['DEFAULT_CHUNK_SIZE', 'TraceRecorder', 'record_simulation', 'simulation_skill_records',
           'with_drawn_skill_times', 'write_mcap_crcs']

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 32 * 1024
"""Bytes of messages after which a chunk is closed and flushed to disk."""

PRODUCER = 'lrtrace (timelyllm_ros)'


_MAGIC_SIZE = 8
_FOOTER_SIZE = 1 + 8 + 8 + 8 + 4        # opcode, length, summary start/offset start, CRC
_DATA_END_SIZE = 1 + 8 + 4              # opcode, length, data section CRC
_CHUNK_CRC_AT = 1 + 8 + 8 + 8 + 8       # opcode, length, start and end time, uncompressed size
_CRC_BLOCK = 1 << 20


class _OffsetBuffer(BytesIO):
    """An in-memory buffer whose ``tell()`` is the file offset it will be written at."""

    def __init__(self, base: int) -> None:
        super().__init__()
        self.base = base

    def tell(self) -> int:
        return self.base + super().tell()


def _crc_of_file(stream: Any, start: int, end: int, crc: int = 0) -> int:
    """CRC-32 of the bytes ``[start, end)`` of a binary file, read in blocks."""
    stream.seek(start)
    left = end - start
    while left > 0:
        block = stream.read(min(left, _CRC_BLOCK))
        if not block:
            raise OSError(f'file ends {left} bytes early')
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def write_mcap_crcs(path: Path) -> bool:
    """Fill in the data-section and summary CRCs of a closed MCAP file written by rosbags.

    Args:
        path: the ``.mcap`` file (closed: footer and closing magic written).

    Returns:
        Whether both CRCs were written (``False``: the file does not end the way rosbags'
        writer ends it, and is left as it is).
    """
    with path.open('r+b') as stream:
        size = stream.seek(0, os.SEEK_END)
        footer = size - _MAGIC_SIZE - _FOOTER_SIZE
        if footer < _MAGIC_SIZE:
            return False
        stream.seek(footer)
        opcode, length, summary_start, _, _ = struct.unpack('<BQQQI', stream.read(_FOOTER_SIZE))
        data_end = summary_start - _DATA_END_SIZE
        if opcode != 0x02 or length != _FOOTER_SIZE - 9 or not _MAGIC_SIZE < data_end < footer:
            return False
        stream.seek(data_end)
        if struct.unpack('<BQ', stream.read(9)) != (0x0F, 4):
            return False
        data_crc = _crc_of_file(stream, 0, data_end)
        stream.seek(data_end + 9)
        stream.write(struct.pack('<I', data_crc))
        summary_crc = _crc_of_file(stream, summary_start, footer + _FOOTER_SIZE - 4)
        stream.seek(footer + _FOOTER_SIZE - 4)
        stream.write(struct.pack('<I', summary_crc))
    return True


BAG_ROS_DISTRO = 'jazzy'
"""The ROS distribution a bag names when written outside ROS: rosbag2 format 9, which the
recorder writes, is Jazzy's."""


def _name_ros_distro(metadata: Path) -> None:
    """Put the ROS distribution (``$ROS_DISTRO``, else :data:`BAG_ROS_DISTRO`) in a bag's
    ``metadata.yaml``, where rosbags writes its own name (``ros2 bag info`` showed
    "ROS Distro: rosbags")."""
    distro = os.environ.get('ROS_DISTRO') or BAG_ROS_DISTRO
    text = metadata.read_text(encoding='utf-8')
    metadata.write_text(text.replace('ros_distro: rosbags\n', f'ros_distro: {distro}\n', 1),
                        encoding='utf-8')


class _FlushingMcapWriter(McapWriter):
    """rosbags' MCAP storage writer that closes chunks at ``chunk_size`` and flushes them.

    It also writes the CRCs rosbags leaves at 0: each chunk's as the chunk is written, the
    data-section and summary CRCs on close.
    """

    def __init__(self, path: Path, compression: CompressionMode, *, chunk_size: int,
                 fsync: bool) -> None:
        super().__init__(path, compression)
        self.chunk_size = chunk_size
        self.fsync = fsync
        self.flushed_chunks = 0

    def write(self, connection: Connection, timestamp: int, data: bytes | memoryview) -> None:
        super().write(connection, timestamp, data)
        if self.chunk.bio.tell() >= self.chunk_size:
            self.close_chunk()

    def close_chunk(self) -> None:
        """Write the open chunk, with its CRC, and its message indexes in one go; flush."""
        with self.chunk.bio.getbuffer() as records:
            crc = zlib.crc32(records)
        file = self.bio
        buffer = _OffsetBuffer(file.tell())
        self.bio = buffer   # type: ignore[assignment]
        try:
            super().close_chunk()
        finally:
            self.bio = file
        with buffer.getbuffer() as record:
            if record[0] != 0x06:
                raise TraceFormatError(f'{self.path}: rosbags wrote no chunk record')
            struct.pack_into('<I', record, _CHUNK_CRC_AT, crc)
            file.write(record)
        self.bio.flush()
        if self.fsync:
            os.fsync(self.bio.fileno())
        self.flushed_chunks += 1

    def flush(self) -> None:
        """Close the open chunk (if it holds anything) and push it to the file."""
        if self.chunk.bio.tell():
            self.close_chunk()

    def close(self, version: int, metadata: str) -> None:
        """Write the summary and footer (rosbags), then the data-section and summary CRCs."""
        super().close(version, metadata)
        if not write_mcap_crcs(self.path):
            logger.warning('%s: unexpected MCAP layout, data and summary CRCs left at 0',
                           self.path)
        if self.fsync:
            with self.path.open('rb') as stream:
                os.fsync(stream.fileno())


class TraceRecorder:
    """Writes one LRTrace bag (a rosbag2 directory in MCAP storage).

    Use as a context manager, or call :meth:`open` and :meth:`close`::

        with TraceRecorder('run1') as recorder:
            recorder.record_task(generation)

    Args:
        path: the bag directory to create (must not exist).
        chunk_size: bytes of messages after which a chunk is closed and flushed to disk; what
            a killed recorder loses is at most the open chunk.
        source: what is recorded, e.g. ``'simulation wid1/timelyllm/seed 0'`` or
            ``'robot tello-01 (djitellopy)'``; stored in the header message and used in the
            provenance of fitted profiles.
        info: extra key/value pairs for the header (workload, policy, robot, ...).
        fsync: also ``fsync`` after each chunk (survives a power cut, not only a kill).
        start_time: the log time (float seconds) of the header message: 0 by default (a
            simulation's clock starts at 0); a live recorder, whose messages carry wall-clock
            times, passes the time it starts, so that the bag's start and duration (``ros2
            bag info``) are those of the recording.
    """

    def __init__(self, path: str | Path, chunk_size: int = DEFAULT_CHUNK_SIZE, source: str = '',
                 info: Mapping[str, str] | None = None, fsync: bool = False,
                 start_time: float = 0.0) -> None:
        if chunk_size <= 0:
            raise ValueError('chunk_size must be > 0')
        self.path = Path(path)
        self.start_time = start_time
        self.chunk_size = chunk_size
        self.source = source
        self.info = dict(info or {})
        self.fsync = fsync
        self.counts: dict[str, int] = dict.fromkeys(fmt.TOPICS, 0)
        self._writer: Writer | None = None
        self._storage: _FlushingMcapWriter | None = None
        self._connections: dict[str, Connection] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._writer is not None

    def open(self) -> None:
        """Create the bag and write its header message.

        Raises:
            TraceFormatError: the path exists already (bags are never overwritten) or cannot
                be created.
        """
        if self._writer is not None:
            raise TraceFormatError(f'{self.path}: recorder already open')
        if self.path.exists():
            raise TraceFormatError(f'{self.path} exists already, not overwriting')
        writer = Writer(self.path, version=Writer.VERSION_LATEST,
                        storage_plugin=StoragePlugin.MCAP)
        # The storage class is looked up on the instance: plug in the flushing writer.
        writer.STORAGE_PLUGINS = {StoragePlugin.MCAP: functools.partial(  # type: ignore[dict-item]
            _FlushingMcapWriter, chunk_size=self.chunk_size, fsync=self.fsync)}  # a class factory
        writer.set_custom_data(fmt.CUSTOM_DATA_VERSION, str(fmt.VERSION_LATEST))
        writer.set_custom_data('lrtrace_source', self.source)
        try:
            writer.open()
        except (WriterError, OSError) as err:
            raise TraceFormatError(f'{self.path}: cannot create bag: {err}') from None
        self._writer = writer
        self._storage = writer.storage  # type: ignore[assignment]
        store = fmt.typestore()
        for topic, msgtype in fmt.TOPICS.items():
            self._connections[topic] = writer.add_connection(topic, msgtype, typestore=store)
        meta = fmt.message_class(fmt.TRACE_META)(
            version=fmt.VERSION_LATEST, producer=PRODUCER, source=self.source,
            keys=list(self.info), values=[str(v) for v in self.info.values()])
        self._write(fmt.META_TOPIC, meta, fmt.log_time_ns(self.start_time))
        self.flush()

    def close(self) -> None:
        """Write the index, the summary and ``metadata.yaml`` (idempotent)."""
        writer, self._writer = self._writer, None
        self._storage = None
        if writer is not None:
            writer.close()
            _name_ros_distro(self.path / 'metadata.yaml')

    def flush(self) -> None:
        """Close the open chunk now and push it to disk."""
        if self._storage is not None:
            self._storage.flush()

    @property
    def flushed_chunks(self) -> int:
        """Chunks written to the file so far."""
        return self._storage.flushed_chunks if self._storage is not None else 0

    def __enter__(self) -> TraceRecorder:
        self.open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Keep what was recorded even when the recording code failed: close normally.
        self.close()

    # -- records --------------------------------------------------------------------------------
    def _write(self, topic: str, msg: Any, log_time_ns: int) -> None:
        self._write_serialized(topic, fmt.serialize(msg), log_time_ns)

    def _write_serialized(self, topic: str, data: bytes, log_time_ns: int) -> None:
        if self._writer is None:
            raise TraceFormatError(f'{self.path}: recorder is not open')
        self._writer.write(self._connections[topic], log_time_ns, data)
        self.counts[topic] += 1

    def record_serialized(self, topic: str, data: bytes, log_time: float) -> None:
        """Write a message already serialized (CDR, e.g. by rclpy) on one of the bag's
        topics, at ``log_time`` seconds."""
        self._write_serialized(topic, data, fmt.log_time_ns(log_time))

    def record_task(self, generation: Generation, pieces: Sequence[str] | None = None) -> None:
        """Record one task: request, TUF, generated text and pieces, cuts and segment times.

        Args:
            generation: the scheduler's record of the task (normally in a terminal state).
            pieces: the generated token pieces; by default the first ``generation.tokens``
                pieces of the request's script (what the simulated engine emitted).
        """
        fields = task_record_fields(generation, pieces)
        for name in STAMP_FIELDS:
            fields[name] = fmt.stamp(fields[name])
        for name in STAMP_LIST_FIELDS:
            fields[name] = [fmt.stamp(t) for t in fields[name]]
        fields['tuf'] = fmt.message_class(f'{fmt.PACKAGE}/msg/TimeUtility')(**fields['tuf'])
        fields['cut_tokens'] = np.array(fields['cut_tokens'], dtype=np.uint32)
        fields['estimated_execution_s'] = np.array(fields['estimated_execution_s'],
                                                   dtype=np.float64)
        fields['segment_success'] = np.array(fields['segment_success'], dtype=np.bool_)
        msg = fmt.message_class(fmt.TASK_RECORD)(**fields)
        spec = generation.spec
        self._write(fmt.TASKS_TOPIC, msg, fmt.log_time_ns(generation.done_time,
                                                          spec.arrival_time))

    def record_segment(self, robot_id: str, task_id: str, segment: Segment) -> None:
        """Record a dispatched segment (``Segment`` message, stamped with its cut time)."""
        self.record_segment_fields(robot_id, task_id, segment.index, segment.text,
                                   [c.skill for c in segment.calls], segment.is_last,
                                   segment.cut_time, segment.estimated_exec_s)

    def record_segment_fields(self, robot_id: str, task_id: str, index: int, text: str,
                              skills: Sequence[str], is_last: bool, generated_time: float,
                              estimated_exec_s: float) -> None:
        """Record a segment given field by field (as the ROS ``segments`` topic carries it)."""
        msg = fmt.message_class(fmt.SEGMENT)(
            robot_id=robot_id, goal_id=task_id, index=index, text=text, skills=list(skills),
            is_last=is_last, generated_stamp=fmt.stamp(generated_time),
            estimated_execution_s=estimated_exec_s)
        self._write(fmt.SEGMENTS_TOPIC, msg, fmt.log_time_ns(generated_time))

    def record_segment_done(self, robot_id: str, task_id: str, index: int, start_time: float,
                            end_time: float, success: bool = True, error: str = '') -> None:
        """Record how a segment really ran (``SegmentDone``; float seconds in)."""
        msg = fmt.message_class(fmt.SEGMENT_DONE)(
            robot_id=robot_id, goal_id=task_id, index=index, start_stamp=fmt.stamp(start_time),
            end_stamp=fmt.stamp(end_time), success=success, error=error)
        self._write(fmt.SEGMENT_DONE_TOPIC, msg, fmt.log_time_ns(end_time, start_time))

    def record_skill(self, robot_id: str, task_id: str, segment_index: int,
                     record: SkillRecord) -> None:
        """Record one executed skill call (``SkillExecution``; float seconds in)."""
        msg = fmt.message_class(fmt.SKILL_EXECUTION)(
            robot_id=robot_id, goal_id=task_id, segment_index=segment_index,
            skill=record.skill, call=record.call, start_stamp=fmt.stamp(record.start_time),
            end_stamp=fmt.stamp(record.end_time), success=record.success, error=record.error)
        self._write(fmt.SKILLS_TOPIC, msg, fmt.log_time_ns(record.end_time, record.start_time))


# -- simulations ----------------------------------------------------------------------------------
def with_drawn_skill_times(tasks: Iterable[TaskSpec], seed: int = 0) -> list[TaskSpec]:
    """Give each scripted task per-call durations drawn from its profile's models.

    A simulated robot then executes with exactly these durations (in plan order per skill), so
    the recorder can attribute every skill call's start and end. Tasks that already carry
    measured skill times (the authors' workloads) are kept as they are.
    """
    rng = np.random.default_rng(seed)
    out: list[TaskSpec] = []
    for task in tasks:
        if task.skill_times is not None or task.script is None:
            out.append(task)
            continue
        profile = load_profile(task.profile)
        drawn: list[tuple[str, float]] = []
        for cut in segment_text(profile, ''.join(task.script)):
            for statement in cut.statements:
                if statement.kind == 'text':
                    continue
                for _ in range(statement.repeat):
                    for call in statement.calls:
                        model = profile.skill(call.skill).exec_time
                        drawn.append((call.skill, model.sample_s(call.args, rng)))
        out.append(replace(task, skill_times=tuple(drawn)) if drawn else task)
    return out


def _segment_calls(segment: Segment) -> list[SkillCall]:
    calls: list[SkillCall] = []
    for statement in segment.statements:
        if statement.kind == 'text':
            continue
        for _ in range(statement.repeat):
            calls.extend(statement.calls)
    return calls


def simulation_skill_records(profile: RobotProfile, generation: Generation
                             ) -> list[tuple[int, SkillRecord]]:
    """Per-call timings of a simulated task, as ``(segment index, SkillRecord)``.

    Only tasks with recorded per-skill durations (``spec.skill_times``) can be attributed
    call by call; segments whose calls are not all covered are left out (a simulated robot
    draws those durations itself and never reports them). Robot jitter scales a segment's
    calls together, as the simulated robot does.
    """
    spec = generation.spec
    if not spec.skill_times:
        return []
    measured = MeasuredTimes(profile, spec.skill_times)
    out: list[tuple[int, SkillRecord]] = []
    for segment in generation.segments:
        if math.isnan(segment.start_time) or math.isnan(segment.end_time):
            break
        calls = _segment_calls(segment)
        durations = [measured.take(call.skill) for call in calls]
        if not calls or any(d is None for d in durations):
            continue
        seconds = [float(d) for d in durations if d is not None]
        span = segment.end_time - segment.start_time
        total = sum(seconds)
        scale = span / total if segment.success and total > 0 else 1.0
        now = segment.start_time
        for call, duration in zip(calls, seconds, strict=True):
            end = now + duration * scale
            failed = not segment.success and end >= segment.end_time
            if failed:
                end = segment.end_time
            out.append((segment.index, SkillRecord(
                skill=call.skill, call=call.text, args=dict(call.args), start_time=now,
                end_time=end, success=not failed, error=segment.error if failed else '')))
            now = end
            if failed:
                break
    return out


def record_simulation(result: Any, path: str | Path, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      source: str = '', info: Mapping[str, str] | None = None) -> dict[str, int]:
    """Record every task of a :class:`~timelyllm_ros.evaluation.simulation.SimulationResult` into
    a bag.

    Per task: its ``TaskRecord``, each dispatched ``Segment``, each executed segment's
    ``SegmentDone`` and, where the durations are known (see :func:`simulation_skill_records`),
    one ``SkillExecution`` per skill call.

    Args:
        result: the simulation result.
        path: the bag directory to create.
        chunk_size: see :class:`TraceRecorder`.
        source: what was simulated; defaults to ``simulation (<policy>)``.
        info: extra header key/value pairs.

    Returns:
        Messages written per topic.

    Raises:
        TraceFormatError: the path exists already.
    """
    header = {'policy': result.policy, **(info or {})}
    source = source or f'simulation ({result.policy}); simulated robots, not hardware'
    with TraceRecorder(path, chunk_size=chunk_size, source=source, info=header) as recorder:
        for generation in result.generations:
            spec = generation.spec
            recorder.record_task(generation)
            for segment in generation.segments:
                recorder.record_segment(spec.robot_id, spec.task_id, segment)
                if not math.isnan(segment.end_time):
                    recorder.record_segment_done(spec.robot_id, spec.task_id, segment.index,
                                                 segment.start_time, segment.end_time,
                                                 segment.success, segment.error)
            profile = load_profile(spec.profile)
            for index, record in simulation_skill_records(profile, generation):
                recorder.record_skill(spec.robot_id, spec.task_id, index, record)
        counts = dict(recorder.counts)
    logger.info('recorded %d tasks into %s', counts[fmt.TASKS_TOPIC], path)
    return counts
