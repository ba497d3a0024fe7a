"""tests/peers: the suites module imports by its plain name (``import suites``)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
