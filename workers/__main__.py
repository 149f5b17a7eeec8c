"""`python -m workers` (or `torchrun --nproc-per-node N -m workers`): one worker rank."""

import os
import sys

# libgomp reads this once, as torch loads it, so it is set before the first torch import. Its
# default lets an OpenMP thread spin through 300,000 checks at every barrier: when another
# process holds one of the cores, the thread that still has a core burns it waiting for the
# descheduled one, and a two-thread rank ran 7x slower beside one busy process. A short spin
# costs a few percent on an idle box. An explicit GOMP_SPINCOUNT in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from workers.worker import main  # noqa: E402

sys.exit(main())
