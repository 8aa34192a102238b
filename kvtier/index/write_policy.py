"""Write policies: when a page is copied to the tier below.

Owns the three decisions a write policy makes; the pool asks, then acts.
- write_through: copy down on commit.
- write_through_selective: copy down once the page has been hit twice; a page evicted
  before that is dropped.
- write_back: copy down only when evicted; a dirty page is never dropped.
It must never move bytes or look at slots beyond the hit count it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2


@dataclass(frozen=True)
class WritePolicy:
    name: str

    def __post_init__(self) -> None:
        if self.name not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.name!r}")

    def copy_on_commit(self) -> bool:
        return self.name == "write_through"

    def copy_on_hit(self, hits: int) -> bool:
        return self.name == "write_through_selective" and hits >= SELECTIVE_HITS

    @property
    def copies_on_hit(self) -> bool:
        """copy_on_hit can be True for some hit count (only write_through_selective)."""
        return self.name == "write_through_selective"

    @property
    def keeps_every_page(self) -> bool:
        """copy_on_evict is True whatever the hits (every policy but write_through_selective)."""
        return self.name != "write_through_selective"

    def copy_on_evict(self, hits: int) -> bool:
        """A dirty page being evicted: copy it down (True) or drop it (False)."""
        return self.name != "write_through_selective" or hits >= SELECTIVE_HITS
