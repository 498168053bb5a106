"""overlap_sched"""

__version__ = "0.1.0"
