"""Saving.

Plan a state into shards, stage it off the training tensors, write it, commit it (also per rank, and
in the background).
"""
