"""Collectives with one meaning on every backend (:mod:`.ops`), the uneven all_gather, and check
mode. Below the session: built on the backends' primitives."""
