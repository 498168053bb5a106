"""ep_comm"""

__version__ = "0.1.0"
