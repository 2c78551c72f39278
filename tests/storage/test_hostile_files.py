"""A store's files may be hostile as files, not only as contents: a symlink out of the store, a
FIFO, a directory, a sparse giant, a tar index naming members the tarball lacks.

Before storage/localfs.py, a manifest or shard symlinked to a file outside the store was read
(``verify`` said ok on a shard linked to a copy elsewhere); a FIFO manifest hung listing, a FIFO
shard hung ``load``; a directory manifest made ``versions()`` raise IsADirectoryError; an archived
manifest naming a file its tarball lacks raised KeyError; ``ls --json`` printed NaN (not JSON);
a view far larger than its stored bytes crashed ``restore --format safetensors`` with a raw
allocation error. Each case now refuses only the version concerned, with a CheckpointError.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.storage import CheckpointError, CheckpointStore, ManifestError, StoreOptions
from ckptflow.storage.errors import UnsafeFileError
from ckptflow.storage.format.manifest import SEAL_KEY, seal
from tests.test_cli import invoke

STATE_1 = {"w": torch.arange(4, dtype=torch.float32)}
STATE_2 = {"w": torch.arange(4, dtype=torch.float32) + 1}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=1))
    s.save(STATE_1, epoch=1)
    s.save(STATE_2, epoch=2)
    return s


def vdir(store: CheckpointStore, version: int) -> Path:
    return Path(store.loc.root) / f"v{version:06d}"


def shard(store: CheckpointStore, version: int) -> Path:
    [found] = vdir(store, version).glob("*.h5")
    return found


def assert_only_version_1_is_listed(store: CheckpointStore) -> None:
    assert [v.version for v in store.versions()] == [1]
    assert torch.equal(store.load(1)["w"], STATE_1["w"])


def edit_manifest(store: CheckpointStore, version: int, edit: Any) -> None:
    path = vdir(store, version) / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(seal(manifest, SEAL_KEY)))


class TestSymlinksOutOfTheStore:
    def test_a_manifest_linked_outside_is_never_read(self, store: CheckpointStore, tmp_path: Path) -> None:
        outside = tmp_path / "outside"
        outside.mkdir()
        manifest = vdir(store, 2) / "manifest.json"
        shutil.copy(manifest, outside / "manifest.json")
        manifest.unlink()
        manifest.symlink_to(outside / "manifest.json")
        assert_only_version_1_is_listed(store)
        with pytest.raises(UnsafeFileError, match="outside the store"):
            store.load(2)

    def test_a_version_directory_linked_outside_is_never_read(
        self, store: CheckpointStore, tmp_path: Path
    ) -> None:
        outside = tmp_path / "elsewhere"
        shutil.move(vdir(store, 2), outside)
        vdir(store, 2).symlink_to(outside)
        assert_only_version_1_is_listed(store)
        with pytest.raises(CheckpointError):
            store.load(2)

    @pytest.mark.parametrize("verify", [True, False])
    def test_a_shard_linked_to_a_copy_outside_is_refused(
        self, store: CheckpointStore, tmp_path: Path, verify: bool
    ) -> None:
        """The copy outside has the right bytes: checksums alone would pass it."""
        copy = tmp_path / "copy.h5"
        shutil.copy(shard(store, 2), copy)
        shard(store, 2).unlink()
        (vdir(store, 2) / copy.name).symlink_to(copy)
        edit_manifest(store, 2, lambda m: m["shards"][0].update(file=copy.name))
        with pytest.raises(UnsafeFileError, match=r"symlink|outside the store"):
            store.load(2, verify=verify)
        with pytest.raises(CheckpointError):
            store.verify(2)
        result = invoke("verify", store.loc.root, "--version", "2")
        assert result.exit_code == 1 and "Traceback" not in result.output


class TestSpecialFiles:
    def test_a_fifo_manifest_does_not_hang_listing(self, store: CheckpointStore) -> None:
        manifest = vdir(store, 2) / "manifest.json"
        manifest.unlink()
        os.mkfifo(manifest)
        found: list[Any] = []
        lister = threading.Thread(target=lambda: found.append(store.versions()), daemon=True)
        lister.start()
        lister.join(30)
        if lister.is_alive():  # release the reader blocked in open(): the bug
            os.close(os.open(manifest, os.O_WRONLY | os.O_NONBLOCK))
            lister.join(5)
            pytest.fail("listing a store with a FIFO manifest hung")
        assert [v.version for v in found[0]] == [1]

    def test_a_fifo_shard_does_not_hang_load(self, store: CheckpointStore) -> None:
        path = shard(store, 2)
        path.unlink()
        os.mkfifo(path)
        outcome: list[BaseException | None] = []

        def load() -> None:
            try:
                store.load(2, verify=False)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        loader.join(30)
        if loader.is_alive():
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            loader.join(5)
            pytest.fail("loading a version whose shard is a FIFO hung")
        assert isinstance(outcome[0], UnsafeFileError), outcome
        assert "FIFO" in str(outcome[0])

    def test_a_directory_manifest_makes_its_version_unreadable(self, store: CheckpointStore) -> None:
        manifest = vdir(store, 2) / "manifest.json"
        manifest.unlink()
        manifest.mkdir()
        assert_only_version_1_is_listed(store)

    def test_a_directory_shard_is_refused(self, store: CheckpointStore) -> None:
        path = shard(store, 2)
        path.unlink()
        path.mkdir()
        with pytest.raises(UnsafeFileError, match="directory"):
            store.load(2, verify=False)

    def test_a_sparse_giant_manifest_is_refused_unread(self, store: CheckpointStore) -> None:
        manifest = vdir(store, 2) / "manifest.json"
        os.truncate(manifest, 12 << 30)  # 12 GiB of holes: read whole, it would exhaust memory
        assert_only_version_1_is_listed(store)
        with pytest.raises(ManifestError, match="more than"):
            store.load(2)


class TestArchives:
    def test_an_archived_manifest_naming_a_missing_member_makes_its_tarball_unreadable(
        self, store: CheckpointStore
    ) -> None:
        from ckptflow.storage.archive.tarindex import INDEX_SEAL_KEY

        store.archive([1, 2])
        store.drop_loose([1, 2])
        [index] = (Path(store.loc.root) / "archive").glob("*.index.json")
        raw = json.loads(index.read_text())
        raw["extra"]["manifests"]["1"]["shards"][0]["file"] = "other.h5"  # the index's seal covers it
        index.write_text(json.dumps(seal(raw, INDEX_SEAL_KEY)))
        assert store.versions() == []
        assert "v000001/other.h5" in str(store.survey().bad_archives)
        with pytest.raises(CheckpointError, match=r"index\.json cannot be read.*--reindex"):
            store.load(1)
        result = invoke("verify", store.loc.root, "--all")
        assert result.exit_code == 1 and "Traceback" not in result.output

    @staticmethod
    def archived(store: CheckpointStore) -> Path:
        store.archive([1, 2])
        store.drop_loose([1, 2])
        [index] = (Path(store.loc.root) / "archive").glob("*.index.json")
        return index

    @pytest.mark.parametrize(
        "manifests",
        [[], None, {"1": 5}, "version 5 under key 1"],
        ids=["a list", "null", "not an object", "another version"],
    )
    def test_archived_manifests_of_the_wrong_shape_make_the_index_unreadable(
        self, store: CheckpointStore, tmp_path: Path, manifests: Any
    ) -> None:
        from ckptflow.storage.archive.tarindex import INDEX_SEAL_KEY

        index = self.archived(store)
        raw = json.loads(index.read_text())
        if manifests == "version 5 under key 1":
            raw["extra"]["manifests"]["1"]["version"] = 5
        else:
            raw["extra"]["manifests"] = manifests
        index.write_text(json.dumps(seal(raw, INDEX_SEAL_KEY)))
        assert store.versions() == []
        [error] = store.survey().bad_archives.values()
        assert any(what in str(error) for what in ("extra.manifests", "[1]", "under '1'")), error
        for args in (["verify", store.loc.root, "--all"], ["ls", store.loc.root]):
            result = invoke(*args)
            assert "Traceback" not in result.output, args
        tar = next(index.parent.glob("*.tar"))
        result = invoke("extract", str(tar), "--epoch", "1", "--out", str(tmp_path / "out"))
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output

    @pytest.mark.parametrize("what", ["the tarball", "the archive directory"])
    def test_archives_linked_outside_are_never_read(
        self, store: CheckpointStore, tmp_path: Path, what: str
    ) -> None:
        index = self.archived(store)
        adir = index.parent
        if what == "the tarball":
            tar = next(adir.glob("*.tar"))
            shutil.move(tar, tmp_path / tar.name)
            tar.symlink_to(tmp_path / tar.name)
        else:
            shutil.move(adir, tmp_path / "archive")
            adir.symlink_to(tmp_path / "archive")
        with pytest.raises(CheckpointError):
            store.load(1)
        result = invoke("verify", store.loc.root, "--all")
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output


class TestOutput:
    def test_a_crafted_nan_metric_makes_its_version_unreadable_and_ls_json_stays_json(
        self, store: CheckpointStore
    ) -> None:
        """Saving refuses non-finite metrics; a manifest holding one made ``ls --json`` print NaN."""
        path = vdir(store, 2) / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest[SEAL_KEY]  # format 2, written before the seal, is still read
        manifest.update(format_version=2, metrics={"loss": float("nan")})
        path.write_text(json.dumps(manifest))
        result = invoke("ls", store.loc.root, "--json")
        assert result.exit_code == 0, result.output

        def refuse(constant: str) -> None:
            raise ValueError(f"not JSON: {constant}")

        document = json.loads(result.stdout, parse_constant=refuse)
        assert [v["version"] for v in document["versions"]] == [1]
        assert "it holds NaN" in document["unreadable"][0]["error"]  # refused as it is read

    def test_a_view_too_big_to_write_out_fails_restore_in_one_line(
        self, store: CheckpointStore, tmp_path: Path
    ) -> None:
        """A stride-0 view of 10**13 elements over 4 stored ones: valid, but not writable whole."""
        edit_manifest(store, 2, lambda m: m["tensors"][0].update(shape=[10**13], stride=[0]))
        out = tmp_path / "r.safetensors"
        result = invoke(
            "restore", store.loc.root, "--version", "2", "--format", "safetensors", "--out", str(out)
        )
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output and "cannot be written out whole" in result.output
        assert not out.exists()


class TestWhatIsWrittenCanBeRead:
    """The reader's limits hold at save time too: before, a state nested 70 levels deep saved
    fine and then was unreadable (so was one over 1,000 levels, with a raw RecursionError)."""

    @staticmethod
    def nested(levels: int) -> dict[str, Any]:
        state: dict[str, Any] = {"w": torch.ones(2)}
        node = state
        for _ in range(levels):
            node["n"] = {}
            node = node["n"]
        return state

    def test_a_state_the_reader_would_refuse_is_refused_before_writing(self, tmp_path: Path) -> None:
        from ckptflow.storage import UnsupportedValueError

        store = CheckpointStore(tmp_path / "store")
        for levels in (70, 5000):
            with pytest.raises(UnsupportedValueError, match="nests more than"):
                store.save(self.nested(levels), epoch=1)
        with pytest.raises(UnsupportedValueError, match="metadata nests"):
            store.save({"w": torch.ones(2)}, epoch=1, user={"a": self.nested(100)["n"]})
        assert list(Path(store.loc.root).glob("v*")) == []

    def test_a_state_at_the_limit_saves_loads_shows_and_archives(self, tmp_path: Path) -> None:
        store = CheckpointStore(tmp_path / "store")
        store.save(self.nested(60), epoch=1)
        assert store.load(1)["n"]["n"]["n"] is not None
        for args in (["show", store.loc.root, "--json"], ["archive", store.loc.root, "--versions", "1"]):
            result = invoke(*args)
            assert result.exit_code == 0, (args, result.output)
        assert sorted(store.archived()) == [1]  # its copy in the index reads back
        assert torch.equal(store.load(1)["w"], torch.ones(2))


class TestMoreHostileFiles:
    """Cases found by the adversarial run after the first round of fixes."""

    @pytest.mark.parametrize("what", ["manifest", "shard", "version directory"])
    def test_a_symlink_loop_leaves_only_its_version_unreadable(
        self, store: CheckpointStore, what: str
    ) -> None:
        path = {
            "manifest": vdir(store, 2) / "manifest.json",
            "shard": shard(store, 2),
            "version directory": vdir(store, 2),
        }[what]
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.symlink_to(path)  # a loop
        if what == "shard":
            with pytest.raises(UnsafeFileError):
                store.load(2, verify=False)
        else:
            assert_only_version_1_is_listed(store)
        result = invoke("ls", store.loc.root)
        assert result.exit_code == 0 and "Traceback" not in result.output, result.output

    @pytest.mark.parametrize("what", ["a directory", "a symlink loop", "a sparse giant"])
    def test_an_index_that_is_no_file_is_reported_not_hidden(self, store: CheckpointStore, what: str) -> None:
        index = TestArchives.archived(store)
        index.unlink()
        if what == "a directory":
            index.mkdir()
        elif what == "a symlink loop":
            index.symlink_to(index)
        else:
            index.touch()
            os.truncate(index, 12 << 30)
        assert store.versions() == []
        assert list(store.survey().bad_archives) == [index.name.replace(".index.json", ".tar")]
        result = invoke("verify", store.loc.root, "--all")
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output

    def test_two_tensors_on_one_blob_each_get_their_own_dtype_and_shape(self, store: CheckpointStore) -> None:
        """A second entry on the same blob with another dtype and shape came back as the first's tensor."""

        def alias(m: dict[str, Any]) -> None:
            m["tensors"].append({**m["tensors"][0], "path": "alias", "dtype": "int32", "shape": [2, 2]})
            m["structure"]["alias"] = {"$tensor": len(m["tensors"]) - 1}

        edit_manifest(store, 2, alias)
        state = store.load(2)
        assert (state["w"].dtype, list(state["w"].shape)) == (torch.float32, [4])
        assert (state["alias"].dtype, list(state["alias"].shape)) == (torch.int32, [2, 2])
        assert torch.equal(state["alias"].reshape(-1).view(torch.float32), STATE_2["w"])
        assert torch.equal(store.load(2, keys=["alias"])["alias"], state["alias"])

    def test_archiving_never_copies_a_file_from_outside_the_store(
        self, store: CheckpointStore, tmp_path: Path
    ) -> None:
        copy = tmp_path / "copy.h5"
        shutil.copy(shard(store, 2), copy)
        name = shard(store, 2).name
        shard(store, 2).unlink()
        (vdir(store, 2) / name).symlink_to(copy)
        result = invoke("archive", store.loc.root, "--versions", "2")
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert not list((Path(store.loc.root) / "archive").glob("*.index.json"))

    @pytest.mark.parametrize("name", ["v000004\n", "v\u0660\u0660\u0660\u0660\u0660\u0664", "v00004"])
    def test_only_ascii_six_digit_names_are_versions(self, name: str) -> None:
        from ckptflow.storage.format.names import parse_version_dir

        assert parse_version_dir(name) is None
        assert parse_version_dir("v000004") == 4 and parse_version_dir("v1000000") == 1000000
