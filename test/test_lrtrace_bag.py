"""LRTrace bags: record → read back (rosbags and the mcap package), crash safety, fit, replay,
inspect and the ``lrtrace`` command's error paths."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from mcap.exceptions import McapError
from mcap.reader import make_reader
from mcap.records import Channel, Message, Schema
from mcap.stream_reader import StreamReader
from rosbags.rosbag2 import Reader, ReaderError, StoragePlugin, Writer

from lrtrace import format as fmt
from lrtrace.cli import main
from lrtrace.fit import fit_profile, write_profile
from lrtrace.inspect import format_table, plot_timeline, segment_rows, skill_rows, task_rows
from lrtrace.reader import read_bag
from lrtrace.recorder import TraceRecorder, record_simulation, with_drawn_skill_times
from lrtrace.replay import recorded_tasks, replay, traces_from_bags
from timelyllm_ros.core.request import TaskStatus
from timelyllm_ros.errors import TraceFormatError
from timelyllm_ros.evaluation.simulation import simulate
from timelyllm_ros.evaluation.workloads import WorkloadSpec, resolve_workload
from timelyllm_ros.language.profiles import load_profile, load_profile_file
from timelyllm_ros.robots.backend import SkillRecord

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def wid1_run():
    _, tasks = resolve_workload('wid1', seed=0)
    tasks = with_drawn_skill_times(sorted(tasks, key=lambda t: t.arrival_time)[:20], seed=0)
    return simulate(tasks, 'timelyllm', seed=0)


@pytest.fixture(scope='module')
def wid1_bag(wid1_run, tmp_path_factory):
    path = tmp_path_factory.mktemp('bags') / 'wid1'
    counts = record_simulation(wid1_run, path, chunk_size=2048, source='test wid1')
    return path, counts


def _ns(seconds: float) -> int | None:
    return None if math.isnan(seconds) else fmt.seconds_to_ns(seconds)


def _check_task(msg, generation) -> None:
    spec = generation.spec
    assert msg.task_id == spec.task_id and msg.robot_id == spec.robot_id
    assert (msg.profile, msg.task_class, msg.task_type) == (
        spec.profile, spec.task_class, spec.task_type)
    assert msg.task == spec.task
    assert (msg.tuf.ert_s, msg.tuf.alpha, msg.tuf.beta) == (
        spec.tuf.ert_s, spec.tuf.alpha, spec.tuf.beta)
    assert fmt.stamp_ns(msg.arrival_stamp) == fmt.seconds_to_ns(spec.arrival_time)
    assert msg.prompt_tokens == spec.prompt_tokens and msg.task_tokens == spec.task_tokens
    pieces = list(spec.script[:generation.tokens])
    assert list(msg.token_pieces) == pieces
    assert msg.text == ''.join(pieces) == ''.join(s.text for s in generation.segments)
    assert list(msg.cut_tokens) == list(np.cumsum([s.tokens for s in generation.segments]))
    assert list(msg.segment_texts) == [s.text for s in generation.segments]
    for name, attr in (('cut_stamps', 'cut_time'), ('dispatch_stamps', 'dispatch_time'),
                       ('start_stamps', 'start_time'), ('end_stamps', 'end_time')):
        assert [fmt.stamp_ns(s) for s in getattr(msg, name)] == [
            _ns(getattr(s, attr)) for s in generation.segments], name
    assert list(msg.estimated_execution_s) == [s.estimated_exec_s for s in generation.segments]
    assert msg.status == generation.status.name == 'FINISHED'
    assert fmt.stamp_ns(msg.done_stamp) == fmt.seconds_to_ns(generation.done_time)


def test_time_conversion_round_trips_to_the_nanosecond():
    for seconds in (0.0, 1e-9, 2.719727616, 123456.000000001, -1.5):
        ns = fmt.seconds_to_ns(seconds)
        stamp = fmt.stamp(seconds)
        assert 0 <= stamp.nanosec < 1_000_000_000
        assert fmt.stamp_ns(stamp) == ns
    assert math.isnan(fmt.stamp_seconds(fmt.stamp(math.nan)))
    with pytest.raises(TraceFormatError):
        fmt.seconds_to_ns(math.inf)


def test_recorded_bag_reads_back_intact_with_rosbags(wid1_run, wid1_bag):
    path, counts = wid1_bag
    assert (path / 'metadata.yaml').is_file()
    assert (path / f'{path.name}.mcap').read_bytes()[:8] == b'\x89MCAP0\r\n'
    generations = {g.task_id: g for g in wid1_run.generations}
    assert counts[fmt.TASKS_TOPIC] == len(generations) == 20
    assert counts[fmt.SKILLS_TOPIC] > 20
    store = fmt.typestore()
    seen: dict[str, int] = {}
    with Reader(path) as reader:
        assert reader.message_count == sum(counts.values())
        for connection, _, data in reader.messages():
            assert fmt.TOPICS[connection.topic] == connection.msgtype
            seen[connection.topic] = seen.get(connection.topic, 0) + 1
            msg = store.deserialize_cdr(data, connection.msgtype)
            if connection.topic == fmt.TASKS_TOPIC:
                _check_task(msg, generations[msg.task_id])
            elif connection.topic == fmt.META_TOPIC:
                assert msg.version == fmt.VERSION_LATEST and msg.source == 'test wid1'
    assert seen == counts
    bag = read_bag(path)
    assert not bag.truncated and bag.message_count == sum(counts.values())
    # skill executions of a segment fill its execution interval exactly
    for task in bag.tasks:
        for k in range(len(task.cut_tokens)):
            skills = [s for s in bag.skills if s.goal_id == task.task_id and s.segment_index == k]
            assert skills, (task.task_id, k)
            assert fmt.stamp_ns(skills[0].start_stamp) == fmt.stamp_ns(task.start_stamps[k])
            assert abs(fmt.stamp_ns(skills[-1].end_stamp) - fmt.stamp_ns(task.end_stamps[k])) <= 1


def test_recorded_bag_reads_back_with_the_mcap_package(wid1_run, wid1_bag):
    path, counts = wid1_bag
    generations = {g.task_id: g for g in wid1_run.generations}
    store = fmt.typestore()
    seen: dict[str, int] = {}
    with (path / f'{path.name}.mcap').open('rb') as stream:
        reader = make_reader(stream, validate_crcs=True)     # the recorder writes chunk CRCs
        assert reader.get_header().profile == 'ros2'
        for schema, channel, message in reader.iter_messages():
            assert schema is not None and schema.encoding == 'ros2msg'
            seen[channel.topic] = seen.get(channel.topic, 0) + 1
            msg = store.deserialize_cdr(message.data, schema.name)
            if channel.topic == fmt.TASKS_TOPIC:
                _check_task(msg, generations[msg.task_id])
    assert seen == counts


def test_recorder_refuses_to_overwrite(tmp_path):
    existing = tmp_path / 'bag'
    existing.mkdir()
    with pytest.raises(TraceFormatError, match='not overwriting'):
        TraceRecorder(existing).open()
    with TraceRecorder(tmp_path / 'new'):
        pass
    with pytest.raises(TraceFormatError, match='not overwriting'):
        with TraceRecorder(tmp_path / 'new'):
            pass
    assert read_bag(tmp_path / 'new').tasks == []


def test_bags_of_another_format_are_refused(tmp_path):
    store = fmt.typestore()
    with Writer(tmp_path / 'plain', version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conn = writer.add_connection('/chatter', 'std_msgs/msg/String', typestore=store)
        writer.write(conn, 1, store.serialize_cdr(store.types['std_msgs/msg/String'](data='x'),
                                                  'std_msgs/msg/String'))
    with pytest.raises(TraceFormatError, match='not an LRTrace bag'):
        read_bag(tmp_path / 'plain')
    meta_class = fmt.message_class(fmt.TRACE_META)
    with Writer(tmp_path / 'future', version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conn = writer.add_connection(fmt.META_TOPIC, fmt.TRACE_META, typestore=store)
        writer.write(conn, 0, fmt.serialize(meta_class(
            version=fmt.VERSION_LATEST + 1, producer='x', source='', keys=[], values=[])))
    with pytest.raises(TraceFormatError, match='version'):
        read_bag(tmp_path / 'future')
    (tmp_path / 'junk.mcap').write_bytes(b'not an mcap file at all')
    with pytest.raises(TraceFormatError):
        read_bag(tmp_path / 'junk.mcap')


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from lrtrace.recorder import TraceRecorder
    from timelyllm_ros.robots.backend import SkillRecord
    recorder = TraceRecorder(sys.argv[1], chunk_size=1024, source='killed')
    recorder.open()
    marked = False
    i = 0
    while True:
        recorder.record_skill('tello-01', 'task-0000', i, SkillRecord(
            'move_forward', f'mf({20 + i % 480})', {}, float(i), i + 0.5, True))
        i += 1
        if not marked and recorder.flushed_chunks >= 4:
            recorder.flush()
            print('FLUSHED', i, flush=True)
            marked = True
        if marked:
            time.sleep(0.0005)
""")


def _stream_messages(path: Path) -> list[tuple[str, str, bytes]]:
    """Independent of lrtrace: the mcap stream reader, stopping where the file stops."""
    schemas: dict[int, Schema] = {}
    channels: dict[int, Channel] = {}
    out = []
    with path.open('rb') as stream:
        try:
            for record in StreamReader(stream, validate_crcs=True).records:
                if isinstance(record, Schema):
                    schemas[record.id] = record
                elif isinstance(record, Channel):
                    channels[record.id] = record
                elif isinstance(record, Message):
                    channel = channels[record.channel_id]
                    out.append((channel.topic, schemas[channel.schema_id].name, record.data))
        except McapError:   # EndOfFile: no footer, the writer was killed
            pass
    return out


def test_sigkilled_recorder_leaves_a_readable_mcap(tmp_path):
    path = tmp_path / 'killed'
    env = {**os.environ, 'PYTHONPATH': str(REPO) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    child = subprocess.Popen([sys.executable, '-c', _KILLED_WRITER, str(path)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()   # type: ignore[union-attr]
        assert line.startswith('FLUSHED'), line
        flushed = int(line.split()[1])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert not (path / 'metadata.yaml').exists()
    mcap_path = path / 'killed.mcap'
    with pytest.raises(ReaderError, match='magic'):   # no footer: rosbags gives up
        with Reader(mcap_path) as reader:
            list(reader.messages())
    messages = _stream_messages(mcap_path)
    skills = [m for m in messages if m[0] == fmt.SKILLS_TOPIC]
    assert messages[0][0] == fmt.META_TOPIC
    assert len(skills) >= flushed > 0
    store = fmt.typestore()
    for i, (_, msgtype, data) in enumerate(skills):
        msg = store.deserialize_cdr(data, msgtype)
        assert (msg.segment_index, msg.call) == (i, f'mf({20 + i % 480})')
        assert fmt.stamp_ns(msg.start_stamp) == i * 1_000_000_000
    bag = read_bag(path)            # lrtrace reads the .mcap up to where it stops
    assert bag.truncated and len(bag.skills) == len(skills) and bag.source == 'killed'
    assert bag.truncated_at is not None and bag.truncated_at <= mcap_path.stat().st_size


def _write_samples(path: Path, rng: np.random.Generator) -> dict[str, list[float]]:
    scan_values = load_profile('tello').skill('scan').exec_time.samples
    recorded: dict[str, list[float]] = {'scan': []}
    with TraceRecorder(path, source='synthetic samples') as recorder:
        t = 0.0
        for i, v in enumerate(range(20, 501, 20)):
            for skill, call, seconds in (
                    ('move_forward', f'mf({v})', 0.0072 * v + 1.8144 + rng.normal(0, 0.01)),
                    ('delay', f'd({v / 50:g})', v / 50),
                    ('scan', "s('cat')", scan_values[i % len(scan_values)])):
                recorder.record_skill('tello-01', f'task-{i}', 0, SkillRecord(
                    skill, call, {}, t, t + seconds, True))
                t += seconds + 0.1
                if skill == 'scan':
                    recorded['scan'].append(seconds)
        recorder.record_skill('tello-01', 'task-x', 0, SkillRecord(
            'move_forward', 'mf(100)', {}, t, t + 99.0, False, 'injected'))
    return recorded


def test_fit_recovers_known_models(tmp_path):
    recorded = _write_samples(tmp_path / 'samples', np.random.default_rng(0))
    fitted, report = fit_profile([tmp_path / 'samples'], 'tello')
    mf = fitted.skill('mf').exec_time
    assert mf.coefficients[0] == pytest.approx(1.8144, rel=0.05)
    assert mf.coefficients[1] == pytest.approx(0.0072, rel=0.05)
    assert fitted.skill('d').exec_time.coefficients == pytest.approx([0.0, 1.0], abs=1e-9)
    assert sorted(fitted.skill('scan').exec_time.samples) == pytest.approx(
        sorted(recorded['scan']))
    assert set(report.skills) == {'move_forward', 'delay', 'scan'}
    for fit in report.skills.values():
        assert fit.rel_error is not None and fit.rel_error < 0.05
    assert report.skills['move_forward'].samples == 25      # the failed call is left out
    out = write_profile(fitted, tmp_path / 'tello.yaml')
    again = load_profile_file(out)
    assert again.skill('mf').exec_time.coefficients == mf.coefficients
    assert 'fitted by lrtrace fit' in again.skill('mf').exec_time.source
    assert '25 samples' in again.skill('mf').exec_time.source
    assert 'fitted by lrtrace fit' in again.exec_time_provenance
    assert again.skill('tc').exec_time == load_profile('tello').skill('tc').exec_time


def test_fit_cli_json_shape(tmp_path, capsys):
    _write_samples(tmp_path / 'samples', np.random.default_rng(1))
    out = tmp_path / 'fitted.yaml'
    assert main(['fit', str(tmp_path / 'samples'), '--robot', 'tello', '--json',
                 '--out', str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report['skills']) == {'move_forward', 'delay', 'scan'}
    for entry in report['skills'].values():
        assert {'model', 'rel_error', 'samples'} <= set(entry)
        assert entry['model']['kind'] in ('parametric', 'sampled', 'constant')
        assert isinstance(entry['samples'], int) and entry['rel_error'] < 0.05
    assert load_profile_file(out).name == 'tello'
    assert main(['fit', str(tmp_path / 'samples'), '--robot', 'tello']) == 0
    assert 'move_forward' in capsys.readouterr().out


def test_replay_of_recorded_traces_finishes_every_task(wid1_run, wid1_bag):
    path, _ = wid1_bag
    traces = traces_from_bags([path])
    for generation in wid1_run.generations:
        trace = traces.get(int(generation.spec.task_type[1:]))
        assert trace.pieces == generation.spec.script
    assert any(traces.skill_times.values())
    tasks = recorded_tasks([path])
    assert len(tasks) == 20 and all(t.skill_times for t in tasks)
    summary = replay([path], policy='timelyllm', seed=0)
    assert summary['overall']['tasks'] == summary['overall']['completed'] == 20
    spec = WorkloadSpec(name='recorded', eps=0.5, max_tpe=4, trace_ids=sorted(traces.by_id),
                        agents=10, duration_s=60)
    summary = replay(traces, spec, seed=3, policy='seg-edf')
    assert summary['overall']['tasks'] == summary['overall']['completed'] > 0


def test_inspect_rows_and_timeline(wid1_run, wid1_bag, tmp_path, capsys):
    path, counts = wid1_bag
    rows = task_rows(path)
    assert [r['task'] for r in rows] == sorted(
        (g.task_id for g in wid1_run.generations),
        key=lambda t: next(g.done_time for g in wid1_run.generations if g.task_id == t))
    assert all(r['status'] == TaskStatus.FINISHED.name and r['response_s'] > 0 for r in rows)
    assert len(segment_rows(path)) == counts[fmt.SEGMENTS_TOPIC]
    assert len(skill_rows(path)) == counts[fmt.SKILLS_TOPIC]
    table = format_table(rows, ['task', 'type', 'plan'])
    assert table.splitlines()[0].split() == ['task', 'type', 'plan']
    assert len(table.splitlines()) == 21
    png = plot_timeline(path, tmp_path / 'timeline.png')
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert main(['inspect', str(path), '--skills', '--plot', str(tmp_path / 'b.png')]) == 0
    assert 'task-0000' in capsys.readouterr().out and (tmp_path / 'b.png').is_file()


def test_cli_record_profile_and_fit(tmp_path, capsys):
    out = tmp_path / 'rec'
    assert main(['record', '--workload', 'wid1', '--seed', '1', '--limit', '8',
                 '--out', str(out)]) == 0
    assert len(read_bag(out).tasks) == 8
    assert main(['profile', '--robot', 'indy7', '--backend', 'sim', '--repeats', '2',
                 '--out', str(tmp_path / 'prof')]) == 0
    capsys.readouterr()
    assert main(['fit', str(tmp_path / 'prof'), '--robot', 'indy7', '--json']) == 0
    report = json.loads(capsys.readouterr().out)['skills']
    assert report['move_joint']['rel_error'] < 1e-6
    assert report['move_joint']['model']['coefficients'] == pytest.approx([0.6, 0.006667])


def test_cli_errors_return_1(tmp_path, capsys):
    assert main(['fit', str(tmp_path / 'missing'), '--robot', 'tello']) == 1
    assert 'ERROR:' in capsys.readouterr().err
    _write_samples(tmp_path / 'samples', np.random.default_rng(2))
    assert main(['fit', str(tmp_path / 'samples'), '--robot', 'nobot']) == 1
    assert 'ERROR:' in capsys.readouterr().err
    assert main(['inspect', str(tmp_path / 'missing')]) == 1
    assert main(['replay', str(tmp_path / 'missing')]) == 1
    assert main(['profile', '--robot', 'nobot', '--out', str(tmp_path / 'p')]) == 1
    assert main(['record', '--workload', 'nope', '--out', str(tmp_path / 'r')]) == 1
    assert main(['record', '--out', str(tmp_path / 'samples')]) == 1   # exists: no overwrite
    err = capsys.readouterr().err
    assert err.count('ERROR:') == 5 and 'not overwriting' in err


def test_a_bag_names_the_ros_distribution(tmp_path, monkeypatch):
    import yaml

    from lrtrace.recorder import BAG_ROS_DISTRO

    monkeypatch.delenv('ROS_DISTRO', raising=False)
    with TraceRecorder(tmp_path / 'plain'):
        pass
    info = yaml.safe_load((tmp_path / 'plain' / 'metadata.yaml').read_text())
    assert info['rosbag2_bagfile_information']['ros_distro'] == BAG_ROS_DISTRO
    monkeypatch.setenv('ROS_DISTRO', 'kilted')
    with TraceRecorder(tmp_path / 'sourced'):
        pass
    info = yaml.safe_load((tmp_path / 'sourced' / 'metadata.yaml').read_text())
    assert info['rosbag2_bagfile_information']['ros_distro'] == 'kilted'
