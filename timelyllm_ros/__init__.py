"""timelyllm_ros: time-sensitive LLM serving for robot fleets (TimelyLLM, paper 000)."""

from pkgutil import extend_path

# A colcon build generates timelyllm_ros.msg / .action into the installed copy of this
# package; extending the path lets them resolve when the source tree comes first on sys.path
# (tests run from the checkout in a ROS 2 workspace).
__path__ = extend_path(__path__, __name__)
