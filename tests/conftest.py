import sys
from pathlib import Path

import jax

# Tests compare against float64-free independent computations; keep CPU defaults.
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
