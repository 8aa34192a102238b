"""Copy engines whose chosen reload raises as it is started, before it copies anything: for tests of
a load that must give back everything it took when its copy cannot start."""

from __future__ import annotations

import traceback

from kvtier.transfer import TorchEngine
from tests.deferred_engine import DeferredEngine


class FailingReload:
    """An engine mixin whose `fail_at`-th reload since `arm` (whole and per-layer reloads, from 1)
    raises; `general` records, per reload call since `arm`, whether the pool's general load path
    (`_submit_load`) made it. Unarmed (`fail_at` 0) it never raises."""

    def __init__(self, device_tier, host_tier) -> None:
        super().__init__(device_tier, host_tier)
        self.arm(0)

    def arm(self, fail_at: int) -> None:
        self.fail_at, self.calls, self.general = fail_at, 0, []

    def _count(self) -> None:
        self.calls += 1
        self.general.append(any(frame.name == "_submit_load" for frame in traceback.extract_stack()))
        if self.calls == self.fail_at:
            raise RuntimeError("injected: the reload could not start")

    def reload(self, host_slots, device_slots, ready=None):
        self._count()
        return super().reload(host_slots, device_slots, ready)

    def reload_layers(self, host_slots, device_slots, layers, ready=None):
        self._count()
        return super().reload_layers(host_slots, device_slots, layers, ready)


class FailingTorchEngine(FailingReload, TorchEngine):
    pass


class FailingDeferredEngine(FailingReload, DeferredEngine):
    pass
