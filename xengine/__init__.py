"""xengine: optimal tensor rematerialization on heterogeneous devices."""

__version__ = "0.1.0"
