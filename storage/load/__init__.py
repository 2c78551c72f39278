"""Loading.

Read a committed version's blobs back into tensors, and verify every byte against its checksums.
"""
