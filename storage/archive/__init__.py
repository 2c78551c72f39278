"""Archives.

Committed versions consolidated into tarballs, their indexes, checking a tarball's tar structure
against its index, extraction, and rebuilding an index from a tarball.
"""
