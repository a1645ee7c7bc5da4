import os
import sys

# Make `from utils import ...` work whatever the rootdir.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    # --slow: many more hypothesis examples in test_fuzz.py (CUSTOM_OPS_FUZZ_EXAMPLES=N sets the
    # count directly and wins over --slow).
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the fuzz tests with many more examples (minutes)")


def pytest_configure(config):
    if config.getoption("--slow", default=False):
        os.environ.setdefault("CUSTOM_OPS_FUZZ_SLOW", "1")
