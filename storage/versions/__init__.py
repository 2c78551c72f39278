"""The life of a version.

The commit protocol and its states, where each version lives, retention, removal, the writer's
lease.
"""
