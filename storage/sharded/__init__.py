"""Sharded state (DTensor, FSDP2) through torch.distributed.checkpoint: its StorageWriter and
StorageReader over the ckptflow format (see :mod:`.api`)."""
