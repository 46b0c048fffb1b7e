"""rollpool.chaos: an application composed from the services."""

from __future__ import annotations
