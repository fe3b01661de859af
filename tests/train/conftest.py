"""The training tests' shared run lives in tests/conftest.py (the serving tests read it too)."""

from tiny_run import ROOT, TINY_TRAIN  # noqa: F401 (test_train_multiprocess imports them from here)
