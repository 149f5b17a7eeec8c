"""`python -m workers` (or `torchrun --nproc-per-node N -m workers`): one worker rank."""

import sys

from workers.worker import main

sys.exit(main())
