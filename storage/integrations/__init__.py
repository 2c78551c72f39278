"""Adapters that put other training frameworks' checkpoints into a ckptflow store.

- :mod:`.lightning`: a PyTorch Lightning ``CheckpointIO`` plugin (needs ``lightning``);
- :mod:`.hf`: a Hugging Face ``TrainerCallback`` and the restore that resumes from it
  (needs ``transformers``);
- :mod:`.pyvalues`: the Python values those frameworks put into a checkpoint (argparse
  namespaces, paths, sets) turned into values a store holds, and back.

Each framework is imported only by its own module, so the storage library keeps working
without them. Torch's own ``torch.distributed.checkpoint`` needs no adapter: a store's
``dcp_writer()`` and ``dcp_reader()`` are DCP's storage writer and reader.
"""
