"""The on-disk format.

Manifests and their checks, file names, the JSON structure of a state, dtypes, HDF5 layout, checksums.
Pure descriptions of what a version's files hold; nothing here decides when or where they are written.
"""
