"""`python -m engine_core`: the scheduler process (started by the launcher or on its own)."""

import sys

from engine_core.core import main

sys.exit(main())
