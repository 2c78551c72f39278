"""Object stores and mirrors.

S3 client settings, parallel multipart transfers, verified big-file copies, mirroring a store.
"""
