"""Adapters that plug kvtier into serving engines.

Owns nothing but the subpackages, one per engine (``kvtier.adapters.sglang``). Importing this
package must never import an engine: each adapter imports its engine only when used, so kvtier
installs and imports on machines without any engine.
"""
