"""ncclpy's binding to libnccl: the copy CuPy loaded, bound with ctypes (loaded on first use)."""
from .config import Config, NcclConfigStruct
from .lib import (CudaUnavailableError, NcclLib, get_lib, is_loaded, loaded_nccl_paths,
                  nccl_version_code, require_version)

__all__ = ["Config", "NcclConfigStruct", "CudaUnavailableError", "NcclLib", "get_lib",
           "is_loaded", "loaded_nccl_paths", "nccl_version_code", "require_version"]
