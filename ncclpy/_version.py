"""ncclpy's version, in one place below everything that reports it (``ncclpy --version``,
``ncclpy info``, the environment agreement); ``ncclpy.__version__`` is this."""
__all__ = ["__version__"]

__version__ = "0.1.0"
