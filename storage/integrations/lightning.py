"""PyTorch Lightning's checkpoints in a ckptflow store: a ``CheckpointIO`` plugin.

    trainer = Trainer(plugins=[CkptflowCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=...)])
    trainer.fit(model, ckpt_path="last")

Lightning decides when to save and what (``ModelCheckpoint``, top-k, ``last.ckpt``) and
addresses checkpoints by path; it lists a directory to find ``last*.ckpt`` and compares
modification times. So each checkpoint path stays a real file, a *pointer*: a small JSON
document naming a store and the version holding the checkpoint. The store is the pointer's
own directory unless the plugin is given one URL for all of them. What always holds:

- a pointer is written only after its version is committed, and atomically: a crash at any
  moment leaves every pointer naming a committed version (at worst an older one);
- a version is deleted only after the pointer that named it was overwritten or removed, and
  each save makes a version of its own, so no other pointer names it;
- the plugin deletes only a version it saved for that very path in the store it saves that path
  to: the pointer records its store, the path it was written for and a random token, the
  version's manifest the same path and token, and all of them must match. A pointer copied from
  another run's directory, or crafted, deletes nothing (the version is kept, with a warning);
- a pointer is read only if the version it names carries its token: a pointer copied away from
  the directory of its store (which it names as ``.``) would name another checkpoint, and is refused;
- the dict Lightning hands over is stored without pickling (tensors as datasets, the rest as
  JSON); namespaces, paths and sets in hyper-parameters are tagged and come back as they were;
  any other object is refused, naming its key path (see :mod:`.pyvalues`).

``async_save=True`` returns once the state is copied to host memory; the write, the commit
and the pointer follow in the background while training goes on (Lightning's
``AsyncCheckpointIO`` pattern, without its second copy of the state).
"""

from __future__ import annotations

import logging
import posixpath
import secrets
import threading
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ..errors import CheckpointError
from ..files.location import redact, translate_errors
from ..format.pyvalues import from_storable, to_storable
from ..save.async_save import SaveHandle
from ..store import CheckpointStore
from ..versions.metadata import write_json
from .pointers import (
    POINTER_FORMAT,
    SAME_DIR,
    Pointer,
    check_pointed,
    directory,
    pointer_location,
    read_pointer,
)

log = logging.getLogger(__name__)


# Lightning's hyper-parameters (the module's and the data module's): an object there that cannot be
# stored is left out with a warning (a loss module, an enum), not a failed fit (see :mod:`.pyvalues`).
HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")


class CkptflowCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over ckptflow stores.

    ``url``: one store for every checkpoint (default: the directory of each checkpoint
    path, e.g. ``ModelCheckpoint``'s ``dirpath``). ``storage_options``: fsspec options for
    the stores and pointers (an S3 endpoint, a profile). Nothing is pickled or unpickled.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        async_save: bool = False,
    ) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.async_save = async_save
        self._stores: dict[str, CheckpointStore] = {}
        self._inflight: tuple[SaveHandle, threading.Event] | None = None
        self._failure: BaseException | None = None

    # -- Lightning's interface ---------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "CkptflowCheckpointIO takes no per-save storage_options; give them to "
                "CkptflowCheckpointIO(storage_options=...)"
            )
        path = str(path)
        state = to_storable(checkpoint, omit_under=HPARAM_KEYS)
        self._finish_inflight()
        store, store_ref = self._store_for(path)
        written_for, token = self._written_for(path, store_ref), secrets.token_hex(16)
        facts: dict[str, Any] = {
            "epoch": _count(checkpoint.get("epoch")),
            "step": _count(checkpoint.get("global_step")),
            "user": {
                "lightning_path": posixpath.basename(path),
                "lightning_pointer": written_for,
                "lightning_token": token,
            },
        }
        new = {"store": store_ref, "path": written_for, "token": token}
        if not self.async_save:
            info = store.save(state, **facts)
            self._point(path, {**new, "version": info.version})
            return
        handle = store.save_async(state, **facts)
        pointed = threading.Event()  # a future's waiters wake before its callbacks have run
        handle.on_commit(
            lambda info: self._point_in_background(path, {**new, "version": info.version}, pointed)
        )
        self._inflight = (handle, pointed)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """The checkpoint a pointer names, in whichever store (``weights_only`` is moot: nothing here
        unpickles). Refused if the version it names does not carry its token (see the module note)."""
        self._finish_inflight()
        path = str(path)
        pointer = self._read_pointer(path)
        if pointer is None:
            raise FileNotFoundError(f"no checkpoint at {path}")
        store = self._open(pointer.store_url)
        check_pointed(pointer, path, store)
        state = store.load(pointer.version, map_location=_device(map_location))
        return from_storable(state)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path``, then the version it names if the plugin saved it for
        that path in its store (otherwise the version is kept, with a warning)."""
        path = str(path)
        self._finish_inflight()
        pointer = self._read_pointer(path)
        if pointer is None:
            return
        loc, name = pointer_location(path, self.storage_options)
        with translate_errors(loc, "removing"):
            loc.remove_file(loc.path(name))
        self._delete_version(pointer, path)

    def teardown(self) -> None:
        """Wait for the save in flight (raising its failure) and close the stores."""
        try:
            self._finish_inflight()
        finally:
            for store in self._stores.values():
                store.close()
            self._stores.clear()

    # -- pointers ----------------------------------------------------------------

    def _point(self, path: str, new: dict[str, Any]) -> None:
        """Write the pointer ``new`` (store, version, path, token) at ``path``, then delete the version
        the pointer there named before, if the plugin saved it for that path in that store.

        Runs in the caller's thread (sync saves) or the writer's (async ones); every call from
        Lightning first waits for the one in flight, so two never overlap."""
        old = self._read_pointer(path)
        loc, name = pointer_location(path, self.storage_options)
        write_json(loc, name, {"ckptflow_pointer": POINTER_FORMAT, **new})
        if old is not None and old.token != new["token"]:
            self._delete_version(old, path)

    def _point_in_background(self, path: str, new: dict[str, Any], pointed: threading.Event) -> None:
        try:
            self._point(path, new)
        except BaseException as exc:  # raised by the next call from Lightning's thread
            self._failure = exc
        finally:
            pointed.set()

    def _read_pointer(self, path: str) -> Pointer | None:
        """The pointer at ``path`` with its store's URL resolved, or None if there is no file."""
        return read_pointer(path, self.storage_options)

    def _delete_version(self, pointer: Pointer, path: str) -> None:
        """Delete the version the pointer at ``path`` named, if this plugin saved it for that path in
        its own store for that path; else keep it and say why (a copied or crafted pointer)."""
        store, store_ref = self._store_for(path)
        try:
            named = self._open(pointer.store_url).url
        except CheckpointError:  # a URL no filesystem opens: not this plugin's store
            named = redact(pointer.store_url)
        written_for = self._written_for(path, store_ref)
        if pointer.token is None:
            why = "the pointer was written by an earlier ckptflow, which recorded no token"
        elif named != store.url:
            why = f"it is not the store this plugin saves {path} to ({store.url})"
        elif pointer.written_for != written_for:
            why = f"the pointer was written for {pointer.written_for}"
        else:
            info = store.find(pointer.version)
            if info is None:
                return  # gone already
            if (
                info.user.get("lightning_token") == pointer.token
                and info.user.get("lightning_pointer") == written_for
            ):
                store.delete(pointer.version)
                return
            why = "that version was not saved for this pointer"
        log.warning("%s named version %d of %s, which is kept: %s", path, pointer.version, named, why)

    # -- stores ------------------------------------------------------------------

    def _store_for(self, path: str) -> tuple[CheckpointStore, str]:
        """The store a checkpoint at ``path`` goes to, and how its pointer names it."""
        if self.url is None:
            return self._open(directory(path)), SAME_DIR
        store = self._open(self.url)
        return store, store.url

    def _written_for(self, path: str, store_ref: str) -> str:
        """What a pointer at ``path`` and its version record as the path: its name beside a store
        in its own directory (which may be moved whole), else its full URL."""
        if store_ref == SAME_DIR:
            return posixpath.basename(path)
        loc, name = pointer_location(path, self.storage_options)
        return loc.display(name)

    def _open(self, url: str) -> CheckpointStore:
        if url not in self._stores:
            self._stores[url] = CheckpointStore(url, storage_options=self.storage_options)
        return self._stores[url]

    def _finish_inflight(self) -> None:
        """Wait for the save in flight and its pointer; raise what failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            handle, pointed = inflight
            handle.wait()  # raises if the save failed: then no pointer is written
            pointed.wait()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise CheckpointError(f"a checkpoint was committed but its pointer was not written: {failure}")


def load_from_checkpoint(
    cls: Any,
    path: Any,
    *,
    map_location: Any = None,
    strict: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path)`` for a checkpoint this plugin wrote: the module (or data
    module) ``cls`` built from the checkpoint's hyper-parameters, ``kwargs`` overriding them, with
    its weights loaded (``strict`` as Lightning's). Lightning's own classmethod reads ``path`` with
    ``torch.load`` and cannot read a pointer (``UnpicklingError ... operand 123``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.core.saving import _load_state

    checkpoint = CkptflowCheckpointIO(storage_options=storage_options).load_checkpoint(path, map_location)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    assert isinstance(model, pl.LightningModule)
    weights = checkpoint.get("state_dict") or {}
    first = next((t for t in weights.values() if hasattr(t, "device")), None)
    return model.to(first.device) if first is not None else model


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and value >= 0 else None


def _device(map_location: Any) -> Any:
    """Lightning passes a device, a string, a dict or a callable; a store takes a device."""
    if map_location is None or callable(map_location) or isinstance(map_location, dict):
        return "cpu"
    return map_location
