"""Triton kernels of the stock path's attention side; imported only when a stock op runs on CUDA (or by tests
under Triton's CPU interpreter)."""
