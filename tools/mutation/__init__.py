"""Mutation testing of ncclpy's contracts (``python -m tools.mutation``, docs/testing.md)."""
