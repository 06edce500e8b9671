"""Read at start-up by every Python process the suite starts (tests/conftest.py puts this folder first on their
PYTHONPATH): they collect reference cycles as the test processes do (tests/conftest.py: ``gc.set_threshold``),
nothing else. A test that sets PYTHONPATH itself (a sitecustomize of its own first) runs at Python's defaults."""

import gc

# The threshold of tests/conftest.py: a `zoo` run traces and lowers its programs, millions of new objects, and spent
# 0.5-0.7 s of its 4-13 s of CPU in the collector at Python's default (700) (tests/test_train.py's runs, measured).
gc.set_threshold(10_000, 10, 10)
