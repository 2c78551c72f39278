"""Archives.

Committed versions consolidated into tarballs, their indexes, extraction, and rebuilding an index
from a tarball.
"""
