"""Moving page bytes between tiers: the engine contract, the torch twin, the CUDA engine."""

from kvtier.transfer.engine import DoneTicket, JoinedTicket, ReloadTransform, Ticket, TransferEngine
from kvtier.transfer.torch_engine import TorchEngine

__all__ = ["DoneTicket", "JoinedTicket", "ReloadTransform", "Ticket", "TorchEngine", "TransferEngine"]
