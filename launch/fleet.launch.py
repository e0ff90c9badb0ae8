"""A simulated (or emulated, or real) fleet: one planner, N drones, M arms, optional recorder.

    ros2 launch timelyllm_ros fleet.launch.py drones:=3 arms:=1 backend:=sim engine:=sim \
        policy:=timelyllm-share record:=true bag:=/tmp/fleet_bag
    ros2 launch timelyllm_ros fleet.launch.py engine:=cpu model:=smollm2 \
        engine_options:='threads=2 kv_tokens=8192' backend:=emulator
    ros2 launch timelyllm_ros fleet.launch.py engine:=vllm-server \
        model:=/opt/models/smollm2 endpoints:=http://gpu1:8000,http://gpu2:8000
    ros2 launch timelyllm_ros fleet.launch.py drones:=0 arms:=0 robots:='boat:2 tello' \
        profiles_dir:=/path/to/profiles

``drones`` start ``drone_controller`` nodes (tello), ``arms`` ``arm_controller`` nodes (indy7);
``robots`` starts ``controller`` nodes of any robot kind: ``PROFILE[:COUNT]`` items (count 1 by
default), each robot named ``<profile>_<i>`` and given ``profiles_dir`` (a new kind needs no
edit here: its profile names its kind's module, see timelyllm_ros.robots.kind).

Every planner parameter (timelyllm_ros.nodes.planner.PARAMETERS) is a launch argument of the
same name (``ros2 launch timelyllm_ros fleet.launch.py --show-args`` lists them).

The planner is a lifecycle node: this launch file configures it (the engine loads the model)
and, once it is inactive, activates it; ``ros2 lifecycle get /planner`` says where it is. A
planner that fails to configure (bad engine, model or option) logs why and stays
unconfigured.

Every node uses relative names: the planner (and recorder) run in the ``fleet`` namespace
(default: the root), each controller in ``<fleet>/<robot>`` (``drone_0``, ``arm_0``, …); a
controller finds the planner's ``plan`` action, ``segment_done`` and ``skill_executions`` in
the namespace above its own, so any node restarts with one command and no remaps:

    ros2 run timelyllm_ros planner --ros-args -r __ns:=/<fleet> -p autostart:=true \
        [-p engine:=... the same planner arguments]
    ros2 run timelyllm_ros drone_controller --ros-args -r __ns:=/<fleet>/drone_0 \
        [-p backend:=emulator]     # node name and robot id come from the namespace

(A restarted planner with ``autostart`` also receives this launch file's ACTIVATE: it is
refused with a warning, the planner stays active.) Send a
robot a task with ``ros2 topic pub --once /drone_0/task timelyllm_ros/msg/Task "{task: 'find
the cat'}"``; its outcome arrives on ``/drone_0/plan_results``. A robot executes one plan at a
time; tasks that arrive meanwhile wait (urgent ones first), at most ``max_queued_tasks`` of
them, further ones are refused.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode, Node
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.parameter_descriptions import ParameterValue
from lifecycle_msgs.msg import Transition

from timelyllm_ros.language.profiles import check_profile_name
from timelyllm_ros.nodes.planner import PARAMETERS as PLANNER_PARAMETERS

MAX_ROBOTS_PER_KIND = 1000


def _fleet_namespace(context) -> str:
    return '/' + LaunchConfiguration('fleet').perform(context).strip('/')


def _nodes(context, *args, **kwargs):
    fleet = _fleet_namespace(context)
    backend = LaunchConfiguration('backend').perform(context)
    max_queued = int(LaunchConfiguration('max_queued_tasks').perform(context))
    profiles_dir = LaunchConfiguration('profiles_dir').perform(context)
    state_dir = LaunchConfiguration('state_dir').perform(context)
    robots = [(kind, executable, int(LaunchConfiguration(count).perform(context)), {})
              for kind, executable, count in (('drone', 'drone_controller', 'drones'),
                                              ('arm', 'arm_controller', 'arms'))]
    robots += [(profile, 'controller', count,
                {'robot_kind': profile, 'profiles_dir': profiles_dir})
               for profile, count in _robot_counts(LaunchConfiguration('robots')
                                                   .perform(context))]
    nodes = []
    for kind, executable, count, parameters in robots:
        for i in range(count):
            name = f'{kind}_{i}'
            nodes.append(Node(
                package='timelyllm_ros', executable=executable,
                namespace=f'{fleet.rstrip("/")}/{name}', name='controller', output='screen',
                parameters=[{'robot_id': name, 'backend': backend,
                             'max_queued_tasks': max_queued, 'state_dir': state_dir,
                             **parameters}, _sim_time()]))
    nodes.append(Node(
        package='timelyllm_ros', executable='lrtrace_recorder', name='lrtrace_recorder',
        namespace=fleet, output='screen',
        parameters=[{'bag': LaunchConfiguration('bag')}, _sim_time()],
        condition=IfCondition(LaunchConfiguration('record'))))
    return nodes


def _sim_time() -> dict[str, ParameterValue]:
    """The launch's ``use_sim_time``, given to every node it starts."""
    return {'use_sim_time': ParameterValue(LaunchConfiguration('use_sim_time'), value_type=bool)}


def _robot_counts(spec: str) -> list[tuple[str, int]]:
    """``'boat:2 tello'`` -> ``[('boat', 2), ('tello', 1)]`` (items split by spaces or commas)."""
    counts = []
    for item in spec.replace(',', ' ').split():
        profile, _, count = item.partition(':')
        check_profile_name(profile)
        if count and not (count.isdigit() and int(count) <= MAX_ROBOTS_PER_KIND):
            raise ValueError(f'robots: {item!r}: the count after ":" must be 0 to '
                             f'{MAX_ROBOTS_PER_KIND}')
        counts.append((profile, int(count) if count else 1))
    return counts


def _planner(context, *args, **kwargs):
    planner = LifecycleNode(
        package='timelyllm_ros', executable='planner', name='planner',
        namespace=_fleet_namespace(context), output='screen',
        parameters=[{name: ParameterValue(LaunchConfiguration(name), value_type=type(default))
                     for name, default, _ in PLANNER_PARAMETERS if name != 'autostart'},
                    _sim_time()])

    def transition(transition_id: int) -> EmitEvent:
        return EmitEvent(event=ChangeState(
            lifecycle_node_matcher=lambda action: action is planner,
            transition_id=transition_id))

    return [
        planner,
        RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=planner, goal_state='inactive',
            entities=[transition(Transition.TRANSITION_ACTIVATE)])),
        transition(Transition.TRANSITION_CONFIGURE),
    ]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument('use_sim_time', default_value='false',
                              description='every node on /clock time (the planner refuses '
                                          'goals until /clock has started)'),
        DeclareLaunchArgument('drones', default_value='3', description='drone controllers'),
        DeclareLaunchArgument('arms', default_value='1', description='arm controllers'),
        DeclareLaunchArgument('robots', default_value='',
                              description="controllers of any robot kind: 'PROFILE[:COUNT] "
                              "...', e.g. 'boat:2 tello' (named <profile>_<i>)"),
        DeclareLaunchArgument('backend', default_value='sim',
                              description='robot backend: sim | emulator | real'),
        DeclareLaunchArgument('fleet', default_value='',
                              description='namespace of the planner, its robots and recorder'),
        *[DeclareLaunchArgument(name, default_value=str(default),
                                description=descriptor.description)
          for name, default, descriptor in PLANNER_PARAMETERS if name != 'autostart'],
        DeclareLaunchArgument('max_queued_tasks', default_value='8',
                              description='tasks a busy robot queues before refusing'),
        DeclareLaunchArgument('state_dir', default_value='',
                              description="folder of the controllers' task journals (empty: "
                                          '$ROS_HOME/timelyllm)'),
        DeclareLaunchArgument('record', default_value='false',
                              description='start the LRTrace recorder'),
        DeclareLaunchArgument('bag', default_value='fleet_bag',
                              description='bag directory of the recorder'),
        OpaqueFunction(function=_planner),
        OpaqueFunction(function=_nodes),
    ])
