"""Fault campaign for LRTrace bags (issue 13, item 9): corrupt and cut a real bag, read it back.

    python3 benchmarks/bag_faults.py [--cases 300] [--seed 0] [--workdir DIR] [--json]

It records a small real bag with the project's recorder (a simulated WID1 run, several chunks),
then, case by case, applies one seeded fault to a copy of its ``.mcap`` file and reads the copy
with :func:`lrtrace.reader.read_bag` and the ``lrtrace inspect`` command. The faults, in turn:

* ``byte``: one byte anywhere in the file overwritten with another value;
* ``bitflip``: one bit flipped inside a chunk's records (the messages);
* ``truncate``: the file cut at a random offset, ``metadata.yaml`` kept (a copy that stopped);
* ``truncate-no-metadata``: the same without ``metadata.yaml`` (a killed recorder);
* ``zero``: a run of 1..64 bytes zeroed (a hole in a sparse file).

Each case ends in one outcome: ``detected`` (a :class:`~timelyllm_ros.errors.TraceFormatError`),
``recovered_truncation`` (a cut file read back with ``truncated`` set and exactly the messages of
every chunk complete before the cut), ``under_recovered`` (a cut file that lost flushed chunks),
``flagged_partial`` (a corruption read as a cut file: flagged, a subset of the original),
``intact`` (the fault changed nothing that is read, e.g. zeros over zeros), ``silent_corruption``
(read without complaint but different from the original) or ``crash`` (any other exception, from
the reader or the inspect command). ``unclear_errors`` counts errors that name no file or no byte
offset. :func:`run_bag_campaign` returns the counts (the repository's fault campaign calls it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import random
import shutil
import struct
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mcap.records import Channel, Chunk, Message, Schema
from mcap.stream_reader import StreamReader, breakup_chunk

from lrtrace.cli import main as lrtrace_main
from lrtrace.reader import RawMessage, iter_raw_messages, read_bag
from lrtrace.recorder import record_simulation, with_drawn_skill_times
from timelyllm_ros.errors import TraceFormatError
from timelyllm_ros.evaluation.simulation import simulate
from timelyllm_ros.evaluation.workloads import resolve_workload

FAULT_KINDS = ('byte', 'bitflip', 'truncate', 'truncate-no-metadata', 'zero')
OUTCOMES = ('detected', 'recovered_truncation', 'under_recovered', 'flagged_partial', 'intact',
            'silent_corruption', 'crash')
BAG_NAME = 'bag'

MessageKey = tuple[str, str, int, bytes]


def record_reference_bag(path: Path, tasks: int = 6, chunk_size: int = 1024,
                         seed: int = 0) -> dict[str, int]:
    """Record a small real bag: the first ``tasks`` goals of WID1, simulated, every topic.

    Args:
        path: the bag directory to create.
        tasks: goals to simulate and record.
        chunk_size: the recorder's chunk size (small, so the bag has several chunks).
        seed: seeds the workload and the simulation.

    Returns:
        Messages written per topic.
    """
    _, specs = resolve_workload('wid1', seed=seed)
    specs = with_drawn_skill_times(sorted(specs, key=lambda t: t.arrival_time)[:tasks],
                                   seed=seed)
    result = simulate(specs, 'timelyllm', seed=seed)
    return record_simulation(result, path, chunk_size=chunk_size, source='bag fault campaign')


def _top_level_records(data: bytes) -> Iterator[tuple[int, int, int]]:
    """``(opcode, start, end)`` of each top-level record of an intact MCAP file."""
    pos = 8
    while pos + 9 <= len(data) - 8:
        opcode, length = struct.unpack_from('<BQ', data, pos)
        yield opcode, pos, pos + 9 + length
        pos += 9 + length


def reference_chunks(data: bytes) -> list[tuple[int, int, Counter[MessageKey]]]:
    """Per chunk of an intact file: where its records start and end, and its messages.

    Read with the ``mcap`` package (CRCs checked), independently of :mod:`lrtrace.reader`.
    """
    spans = []
    for opcode, start, end in _top_level_records(data):
        if opcode == 0x06:
            compression_len = struct.unpack_from('<I', data, start + 9 + 28)[0]
            spans.append((start + 9 + 32 + compression_len + 8, end))
    records = StreamReader(io.BytesIO(data), emit_chunks=True, validate_crcs=True).records
    chunks = [r for r in records if isinstance(r, Chunk)]
    if len(chunks) != len(spans):
        raise AssertionError(f'{len(chunks)} chunks read, {len(spans)} found')
    schemas: dict[int, str] = {}
    channels: dict[int, tuple[str, int]] = {}
    out = []
    for (start, end), chunk in zip(spans, chunks, strict=True):
        keys: Counter[MessageKey] = Counter()
        for record in breakup_chunk(chunk, validate_crc=True):
            if isinstance(record, Schema):
                schemas[record.id] = record.name
            elif isinstance(record, Channel):
                channels[record.id] = (record.topic, record.schema_id)
            elif isinstance(record, Message):
                topic, schema_id = channels[record.channel_id]
                keys[(topic, schemas.get(schema_id, ''), record.log_time,
                      bytes(record.data))] += 1
        out.append((start, end, keys))
    return out


def _key(message: RawMessage) -> MessageKey:
    return (message.topic, message.msgtype, message.log_time_ns, message.data)


def _fault(kind: str, data: bytes, rng: random.Random,
           chunks: Sequence[tuple[int, int, Counter[MessageKey]]]) -> tuple[bytes, dict[str, Any]]:
    """Apply one fault of a kind; returns the damaged bytes and what was done."""
    size = len(data)
    if kind == 'byte':
        offset = rng.randrange(size)
        value = (data[offset] + rng.randrange(1, 256)) % 256
        return data[:offset] + bytes([value]) + data[offset + 1:], {
            'offset': offset, 'old': data[offset], 'new': value}
    if kind == 'bitflip':
        start, end, _ = rng.choice(chunks)
        offset = rng.randrange(start, end)
        bit = rng.randrange(8)
        return data[:offset] + bytes([data[offset] ^ (1 << bit)]) + data[offset + 1:], {
            'offset': offset, 'bit': bit}
    if kind in ('truncate', 'truncate-no-metadata'):
        cut = rng.randrange(size)
        return data[:cut], {'offset': cut}
    if kind == 'zero':
        offset = rng.randrange(size)
        length = min(rng.randint(1, 64), size - offset)
        return data[:offset] + bytes(length) + data[offset + length:], {
            'offset': offset, 'length': length}
    raise ValueError(f'unknown fault kind {kind!r}')


def _read(bag: Path) -> tuple[str, Counter[MessageKey] | None, bool, str]:
    """Read a damaged bag: ``('ok', messages, truncated, '')``, ``('error', …)`` or crash."""
    try:
        read_bag(bag)
        messages, truncated = iter_raw_messages(bag)
    except TraceFormatError as err:
        return 'error', None, False, str(err)
    except Exception as err:  # noqa: BLE001 - what the campaign counts
        return 'crash', None, False, f'{type(err).__name__}: {err}'
    return 'ok', Counter(_key(m) for m in messages), truncated, ''


def _inspect(bag: Path) -> str:
    """Run ``lrtrace inspect --segments --skills`` on a bag: '' or what went wrong."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = lrtrace_main(['inspect', str(bag), '--segments', '--skills'])
    except Exception as error:  # noqa: BLE001 - what the campaign counts
        return f'{type(error).__name__}: {error}'
    if status not in (0, 1):
        return f'exit status {status}'
    return ''


def _classify(kind: str, read: str, keys: Counter[MessageKey] | None, truncated: bool,
              original: Counter[MessageKey], expected: Counter[MessageKey]) -> str:
    """The outcome of one case (see the module docstring)."""
    cut = kind.startswith('truncate')
    if read == 'crash':
        return 'crash'
    if read == 'error':
        return 'under_recovered' if cut and expected else 'detected'
    assert keys is not None
    if truncated:
        if not keys <= original:
            return 'silent_corruption'
        if not cut:
            return 'flagged_partial'
        return 'recovered_truncation' if keys == expected else 'under_recovered'
    return 'intact' if keys == original else 'silent_corruption'


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence a logger's warnings (one per cut file) for the campaign's duration."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_bag_campaign(seed: int, cases: int, workdir: Path) -> dict[str, Any]:
    """Record a bag, then read back ``cases`` damaged copies of it (faults in turn by kind).

    Args:
        seed: seeds the recorded run and every fault.
        cases: damaged copies to read.
        workdir: an existing directory for the bag and the copies (left with the last copy).

    Returns:
        ``cases``, one count per outcome (``crashes``, ``silent_corruptions``, ``detected``,
        ``recovered_truncations``, ``under_recovered_truncations``, ``flagged_partial``,
        ``intact``), ``unclear_errors``, the counts per fault kind, the bag's size and message
        count, and up to 10 ``problems`` (cases that crashed, altered data silently, lost
        flushed data or gave an unclear error) to reproduce.
    """
    workdir = Path(workdir)
    reference = workdir / 'reference' / BAG_NAME
    if reference.parent.exists():
        shutil.rmtree(reference.parent)
    reference.parent.mkdir(parents=True)
    record_reference_bag(reference, seed=seed)
    mcap_name = f'{BAG_NAME}.mcap'
    data = (reference / mcap_name).read_bytes()
    metadata = (reference / 'metadata.yaml').read_bytes()
    chunks = reference_chunks(data)
    original: Counter[MessageKey] = sum((keys for _, _, keys in chunks), Counter())
    if Counter(_key(m) for m in iter_raw_messages(reference)[0]) != original:
        raise AssertionError('the intact bag does not read back as recorded')
    rng = random.Random(seed)
    case_dir = workdir / 'case' / BAG_NAME
    counts = dict.fromkeys(OUTCOMES, 0)
    by_kind = {kind: dict.fromkeys(OUTCOMES, 0) for kind in FAULT_KINDS}
    unclear = 0
    problems: list[dict[str, Any]] = []
    with _quiet('lrtrace.reader'):
        for case in range(cases):
            kind = FAULT_KINDS[case % len(FAULT_KINDS)]
            damaged, detail = _fault(kind, data, rng, chunks)
            if case_dir.exists():
                shutil.rmtree(case_dir)
            case_dir.mkdir(parents=True)
            (case_dir / mcap_name).write_bytes(damaged)
            if kind != 'truncate-no-metadata':
                (case_dir / 'metadata.yaml').write_bytes(metadata)
            read, keys, truncated, error = _read(case_dir)
            inspect_error = _inspect(case_dir)
            if inspect_error and read != 'crash':
                read, error = 'crash', f'inspect: {inspect_error}'
            expected: Counter[MessageKey] = Counter()
            if kind.startswith('truncate'):
                for _, end, chunk_keys in chunks:
                    if end <= detail['offset']:
                        expected += chunk_keys
            outcome = _classify(kind, read, keys, truncated, original, expected)
            counts[outcome] += 1
            by_kind[kind][outcome] += 1
            clear = read != 'error' or (str(case_dir) in error and 'byte ' in error)
            unclear += not clear
            if (outcome in ('crash', 'silent_corruption', 'under_recovered') or not clear) and (
                    len(problems) < 10):
                problems.append({'case': case, 'kind': kind, **detail, 'outcome': outcome,
                                 'error': error[:300]})
    return {
        'seed': seed, 'cases': cases, 'bag_bytes': len(data),
        'bag_messages': sum(original.values()), 'bag_chunks': len(chunks),
        'crashes': counts['crash'], 'silent_corruptions': counts['silent_corruption'],
        'detected': counts['detected'], 'recovered_truncations': counts['recovered_truncation'],
        'under_recovered_truncations': counts['under_recovered'],
        'flagged_partial': counts['flagged_partial'], 'intact': counts['intact'],
        'unclear_errors': unclear,
        'by_kind': {kind: {k: v for k, v in row.items() if v} for kind, row in by_kind.items()},
        'problems': problems,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the campaign and print its counts (exit status 1 if any case crashed or lied)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--cases', type=int, default=300, help='damaged copies to read')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--workdir', help='keep the bag and the last copy here')
    parser.add_argument('--json', action='store_true', help='print the counts as JSON')
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        workdir = (Path(args.workdir) if args.workdir else
                   Path(stack.enter_context(tempfile.TemporaryDirectory(prefix='bag-faults-'))))
        workdir.mkdir(parents=True, exist_ok=True)
        result = run_bag_campaign(args.seed, args.cases, workdir)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f'{key}: {value}')
    bad = result['crashes'] + result['silent_corruptions'] + result[
        'under_recovered_truncations'] + result['unclear_errors']
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
