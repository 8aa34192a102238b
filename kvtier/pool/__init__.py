"""The pool: the public API engines call (pool.py), the values it returns (handles.py), and what
it needs to run a remote tier (remote_link.py threads, breaker.py health)."""

from kvtier.pool.breaker import BreakerState, CircuitBreaker
from kvtier.pool.handles import LoadHandle, MatchResult, PoolExhausted
from kvtier.pool.pool import TieredPool

__all__ = ["BreakerState", "CircuitBreaker", "LoadHandle", "MatchResult", "PoolExhausted", "TieredPool"]
