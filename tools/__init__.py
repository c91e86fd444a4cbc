"""Developer tools of the ncclpy checkout (not installed with the package)."""
