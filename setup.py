"""pip / setuptools entry for the ROS-free core (``pip install -e .``).

``colcon build`` uses CMakeLists.txt + package.xml instead (ament_cmake, for the interfaces).
"""

from glob import glob

from setuptools import find_packages, setup

package_name = 'timelyllm_ros'

setup(
    name=package_name,
    version='0.1.0',
    description='Time-sensitive LLM serving middleware for robot fleets (TimelyLLM + LRTrace).',
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.10',
    packages=find_packages(exclude=['test', 'test.*', 'benchmarks']),
    package_data={
        'timelyllm_ros': ['data/calibration/*.yaml', 'py.typed'],
        'lrtrace': ['data/traces/*.yaml', 'data/workloads/*.yaml', 'data/authors/*'],
    },
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        ('share/' + package_name, ['package.xml']),
        ('share/' + package_name + '/robot_profiles', glob('robot_profiles/*.yaml')),
        ('share/' + package_name + '/launch', glob('launch/*.launch.py')),
        ('share/' + package_name + '/msg', glob('msg/*.msg')),
        ('share/' + package_name + '/action', glob('action/*.action')),
        ('lib/' + package_name, glob('scripts/*')),
    ],
    install_requires=[
        'numpy>=1.26,<3',
        'pydantic>=2.6,<3',
        'PyYAML>=6.0,<7',
        'matplotlib>=3.8,<4',
        'tqdm>=4.66,<5',
        'rosbags>=0.10,<0.12',
        'mcap>=1.2,<2',
    ],
    extras_require={
        'robots': ['djitellopy>=2.5,<3', 'neuromeka>=3.5,<4'],
        'test': ['pytest>=8,<10', 'hypothesis>=6.100,<7',
                 'djitellopy>=2.5,<3', 'neuromeka>=3.5,<4'],
    },
    entry_points={
        'console_scripts': [
            'timelyllm = timelyllm_ros.cli:main',
            'lrtrace = lrtrace.cli:main',
        ],
    },
    zip_safe=False,
)
