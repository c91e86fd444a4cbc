"""Test configuration: make ``gpu_util`` importable from every test directory."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)
_root = os.path.dirname(_here)
if _root not in sys.path:
    sys.path.insert(0, _root)
