import sys
from pathlib import Path

# Spawned ranks import the test modules (their rank functions) by name: they inherit
# this sys.path from the parent.
sys.path.insert(0, str(Path(__file__).parent))
