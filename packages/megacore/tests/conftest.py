import sys
from pathlib import Path

# Shared test models (tiny_stack.py) import by name here and in spawned ranks,
# which inherit this sys.path from the parent.
sys.path.insert(0, str(Path(__file__).parent))
