import sys
from pathlib import Path

# tests/launch.py is a helper module, importable from every test file.
sys.path.insert(0, str(Path(__file__).parent))
