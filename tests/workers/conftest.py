"""Make the repository root importable (workers/, protocol/, tests.helpers) without installing.
(lora_world, the LoRA tests' tiny model and adapters, is in tests/conftest.py: the engine's
end-to-end tests share it.)"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

