"""LRTrace bags read by rosbag2 itself (what ``ros2 bag info`` and ``ros2 bag play`` use).

Needs a ROS 2 workspace with rosbag2 (``rosbag2_py`` and its MCAP storage plugin) and this
package built with ``colcon build`` (the generated message classes); skipped otherwise.
"""

from __future__ import annotations

import pytest

rosbag2_py = pytest.importorskip('rosbag2_py',
                                 reason='rosbag2_py missing: run in a ROS 2 workspace with '
                                        'rosbag2 built')
pytest.importorskip('timelyllm_ros.msg',
                    reason='interfaces not generated: colcon build this package first')

from rclpy.serialization import deserialize_message  # noqa: E402
from rosidl_runtime_py.utilities import get_message  # noqa: E402

from lrtrace import format as fmt  # noqa: E402
from lrtrace.recorder import TraceRecorder, record_simulation  # noqa: E402
from timelyllm_ros.evaluation.simulation import simulate  # noqa: E402
from timelyllm_ros.evaluation.workloads import resolve_workload  # noqa: E402

pytestmark = pytest.mark.ros


@pytest.fixture(scope='module')
def bag(tmp_path_factory):
    _, tasks = resolve_workload('wid1', seed=0)
    path = tmp_path_factory.mktemp('bags') / 'wid1'
    counts = record_simulation(simulate(tasks[:4], 'timelyllm', seed=0), path)
    return path, counts


def test_rosbag2_reads_the_metadata(bag):
    path, counts = bag
    info = rosbag2_py.Info().read_metadata(str(path), 'mcap')
    assert info.storage_identifier == 'mcap'
    assert info.message_count == sum(counts.values())
    topics = {t.topic_metadata.name: t for t in info.topics_with_message_count}
    assert {name: t.topic_metadata.type for name, t in topics.items()} == fmt.TOPICS
    assert {name: t.message_count for name, t in topics.items()} == counts
    assert {t.topic_metadata.serialization_format for t in topics.values()} == {'cdr'}


def test_rosbag2_reads_every_message_with_the_generated_types(bag):
    path, counts = bag
    reader = rosbag2_py.SequentialReader()
    reader.open(rosbag2_py.StorageOptions(uri=str(path), storage_id='mcap'),
                rosbag2_py.ConverterOptions('cdr', 'cdr'))
    types = {t.name: get_message(t.type) for t in reader.get_all_topics_and_types()}
    seen: dict[str, int] = {}
    robots = set()
    while reader.has_next():
        topic, data, _ = reader.read_next()
        msg = deserialize_message(data, types[topic])
        seen[topic] = seen.get(topic, 0) + 1
        if topic == fmt.TASKS_TOPIC:
            robots.add(msg.robot_id)
            assert msg.text and len(msg.segment_texts) == len(msg.start_stamps)
        elif topic == fmt.META_TOPIC:
            assert msg.version == fmt.VERSION_LATEST
    assert seen == {topic: n for topic, n in counts.items() if n}
    assert len(robots) == counts[fmt.TASKS_TOPIC]


def test_a_live_recording_starts_when_the_recorder_starts(tmp_path):
    path = tmp_path / 'live'
    with TraceRecorder(path, source='test', start_time=1_700_000_000.0) as recorder:
        recorder.record_segment_done('drone_0', 'g', 0, 1_700_000_001.0, 1_700_000_003.5)
    info = rosbag2_py.Info().read_metadata(str(path), 'mcap')
    assert info.starting_time.nanoseconds == 1_700_000_000 * 10**9
    assert info.duration.nanoseconds == 3_500_000_000
