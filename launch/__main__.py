"""`python -m launch`: see launch/cli.py."""

import sys

from launch.cli import main

sys.exit(main())
