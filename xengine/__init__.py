"""xengine: optimal tensor rematerialization on heterogeneous devices."""

import os

# torch.profiler (used to capture graphs and to measure CPU memory) prints kineto's status
# lines on stderr from C++, and c10's CPU allocator warns there once per process that a block
# allocated before profiling started was freed during it (the step's start state, which the
# memory measurement subtracts anyway); they would bury our messages. C++ errors still print.
# Effective when xengine is imported before torch (run.py and the experiments do so); a value
# already in the environment wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

__version__ = "0.1.0"
