"""ep_comm: expert-parallel dispatch and combine with DeepEP V1's `Buffer` call surface."""

from ep_comm.buffer import Buffer
from ep_comm.collectives import EPCommError
from ep_comm.config import Config
from ep_comm.event import EventOverlap
from ep_comm.handle import DispatchHandle
from ep_comm.low_latency_backend import LowLatencyHandle

__version__ = "0.2.0"

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "EPCommError",
    "EventOverlap",
    "LowLatencyHandle",
    "__version__",
]
