"""Where kvtier.pool (and older callers) import the CUDA engine from; it lives in kvtier.transfer.cuda.

Owns nothing: it names CudaEngine and PATHS of kvtier.transfer.cuda.engine. It must never
grow code of its own.
"""

from kvtier.transfer.cuda.engine import PATHS, CudaEngine

__all__ = ["PATHS", "CudaEngine"]
