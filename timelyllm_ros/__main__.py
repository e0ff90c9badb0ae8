"""``python -m timelyllm_ros`` runs the ``timelyllm`` command line."""

import sys

from timelyllm_ros.cli import main

sys.exit(main())
