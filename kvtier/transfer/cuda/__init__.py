"""The CUDA copy engine, one module per concern: engine (path choice), plans, tickets, driver, one module per path."""

from kvtier.transfer.cuda.engine import PATHS, CudaEngine

__all__ = ["PATHS", "CudaEngine"]
