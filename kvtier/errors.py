"""kvtier's exceptions for settings it cannot use, shared by the pool, its tiers and the config layer.

Owns the classes only; it must never import another kvtier module. Every message names the
keyword, its value, what was expected or what this machine has, and the fix. The remote
store's own exceptions live in kvtier.tiers.remote.errors.
"""


class SettingError(ValueError):
    """A pool keyword whose value kvtier cannot use (here, or at all)."""


class DeviceError(SettingError):
    """``device`` names no device kvtier can put its pages on here (a typo, or CUDA absent)."""


class TierSizeError(SettingError):
    """A tier's size (``device_pages``, ``host_pages`` / ``host_bytes``) is more memory than the
    machine has free for it."""
