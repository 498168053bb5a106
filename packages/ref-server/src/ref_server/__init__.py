"""ref_server"""

__version__ = "0.1.0"
