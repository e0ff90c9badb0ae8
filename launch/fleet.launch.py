"""A simulated (or emulated, or real) fleet: one planner, N drones, M arms, optional recorder.

    ros2 launch timelyllm_ros fleet.launch.py drones:=3 arms:=1 backend:=sim engine:=sim \
        policy:=timelyllm record:=true bag:=/tmp/fleet_bag
    ros2 launch timelyllm_ros fleet.launch.py engine:=cpu model:=smollm2 \
        engine_options:='threads=2 kv_tokens=8192' backend:=emulator

Every planner parameter (timelyllm_ros.nodes.planner.PARAMETERS) is a launch argument of the
same name (``ros2 launch timelyllm_ros fleet.launch.py --show-args`` lists them).

Each controller runs in its own namespace (``drone_0``, ``arm_0``, …): send it a task with
``ros2 topic pub --once /drone_0/task std_msgs/msg/String "{data: 'find the cat'}"``. A robot
executes one plan at a time; tasks that arrive meanwhile wait FIFO, at most
``max_queued_tasks`` of them, further ones are refused (see ``<robot>/plan_results``).
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue

from timelyllm_ros.nodes.planner import PARAMETERS as PLANNER_PARAMETERS


def _controllers(context, *args, **kwargs):
    backend = LaunchConfiguration('backend').perform(context)
    max_queued = int(LaunchConfiguration('max_queued_tasks').perform(context))
    nodes = []
    for kind, executable, count in (('drone', 'drone_controller', 'drones'),
                                    ('arm', 'arm_controller', 'arms')):
        for i in range(int(LaunchConfiguration(count).perform(context))):
            name = f'{kind}_{i}'
            nodes.append(Node(
                package='timelyllm_ros', executable=executable, namespace=name,
                name='controller', output='screen',
                parameters=[{'robot_id': name, 'backend': backend,
                             'max_queued_tasks': max_queued}]))
    return nodes


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument('drones', default_value='3', description='drone controllers'),
        DeclareLaunchArgument('arms', default_value='1', description='arm controllers'),
        DeclareLaunchArgument('backend', default_value='sim',
                              description='robot backend: sim | emulator | real'),
        *[DeclareLaunchArgument(name, default_value=str(default),
                                description=descriptor.description)
          for name, default, descriptor in PLANNER_PARAMETERS],
        DeclareLaunchArgument('max_queued_tasks', default_value='8',
                              description='tasks a busy robot queues (FIFO) before refusing'),
        DeclareLaunchArgument('record', default_value='false',
                              description='start the LRTrace recorder'),
        DeclareLaunchArgument('bag', default_value='fleet_bag',
                              description='bag directory of the recorder'),
        Node(package='timelyllm_ros', executable='planner', name='planner', output='screen',
             parameters=[{name: ParameterValue(LaunchConfiguration(name), value_type=type(default))
                          for name, default, _ in PLANNER_PARAMETERS}]),
        OpaqueFunction(function=_controllers),
        Node(package='timelyllm_ros', executable='lrtrace_recorder', name='lrtrace_recorder',
             output='screen', parameters=[{'bag': LaunchConfiguration('bag')}],
             condition=IfCondition(LaunchConfiguration('record'))),
    ])
