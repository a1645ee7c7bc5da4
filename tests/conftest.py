import os
import sys

# Make `from utils import ...` work whatever the rootdir.
sys.path.insert(0, os.path.dirname(__file__))
