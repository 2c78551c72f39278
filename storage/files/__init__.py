"""Where a store lives and how bytes move.

fsspec locations, confined local files, and ranged, hashed reads and writes.
"""
