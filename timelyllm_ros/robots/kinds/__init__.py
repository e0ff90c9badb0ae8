"""The bundled robot kinds, one module per kind (see :mod:`timelyllm_ros.robots.kind`).

Every module of this package is imported when the kind registry is first read, and registers
its kind: a new bundled kind is a new module here plus its profile YAML.
"""
