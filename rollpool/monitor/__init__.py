"""rollpool.monitor: Redis-backed live state, events and readers.

The only subpackage that imports redis-py. `embedded` starts a local
Redis-compatible server (the demo's default when no URL is given).
"""

from __future__ import annotations
