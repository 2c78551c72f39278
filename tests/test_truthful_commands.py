"""What verify, prune and ls say is what the store holds: archived versions, unreadable ones, tarballs.

Each class fixes a command that used to say something false:

- ``verify --all`` skipped archived versions (nothing printed, exit 1 on a store whose
  versions all live in tarballs; "no committed checkpoint" on an S3 store of archives);
- plain ``verify`` checked the version below an unreadable newest one and exited 0;
- ``prune --dry-run`` listed every archived version as removed and kept none, then failed,
  while the real prune kept the newest: the two now print one plan;
- library versions were numbered from 0 whatever the epoch (``save(epoch=1)`` made version 0);
- an unreadable newest version blocked every resumed run (the writer now sets it aside).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointStore, StoreOptions
from tests.test_cli import WIDE, flip_byte, invoke


def _fill_archived(url: str, storage_options: dict | None = None, *, loose_tail: int = 0) -> CheckpointStore:
    """Versions 1-6 (epoch = version, val_loss falling), archived three to a tarball; the last
    ``loose_tail`` versions are left loose instead."""
    store = CheckpointStore(url, storage_options=storage_options, options=StoreOptions(shards=2, threads=2))
    for epoch in range(1, 7):
        store.save({"w": torch.full((8,), float(epoch))}, epoch=epoch, metrics={"val_loss": 10.0 - epoch})
    archived = [v for v in range(1, 7) if v <= 6 - loose_tail]
    for start in range(0, len(archived), 3):
        group = archived[start : start + 3]
        store.archive(group)
        store.drop_loose(group)
    return store


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


class TestVerifyAll:
    def test_every_archived_version_is_verified_one_line_each(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        _fill_archived(url)
        assert not list(Path(url).glob("v0*"))  # every version lives in a tarball
        result = invoke("verify", url, "--all")
        assert result.exit_code == 0, result.output
        lines = _lines(result.stdout)
        assert [line.split()[:2] for line in lines] == [["ok", "version"]] * 6
        assert [int(line.split()[2]) for line in lines] == [1, 2, 3, 4, 5, 6]
        assert all(".tar[v00000" in line for line in lines)

    def test_a_corrupt_tarball_fails_its_versions_and_only_them(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        store = _fill_archived(url, loose_tail=1)
        member = store.info(5).url  # .../epochs-000004-000006.tar[v000005]? (4, 5 archived; 6 loose)
        tar = Path(member.split("[")[0])
        flip_byte(tar)  # the middle of the tarball: a member's bytes
        result = invoke("verify", url, "--all")
        assert result.exit_code == 1
        ok = [int(line.split()[2]) for line in _lines(result.stdout)]
        bad = _lines(result.stderr)
        assert bad and all(line.startswith("error: version ") for line in bad)
        failed = [int(line.split()[2].rstrip(":")) for line in bad]
        assert sorted(ok + failed) == [1, 2, 3, 4, 5, 6]
        assert set(failed) <= {4, 5} and 6 in ok

    @pytest.mark.s3
    def test_an_s3_store_of_archives(self, s3_bucket) -> None:
        bucket, options = s3_bucket
        url = f"s3://{bucket}/mirror"
        _fill_archived(url, options)
        import json

        result = invoke("verify", url, "--all", "--storage-options", json.dumps(options))
        assert result.exit_code == 0, result.output
        assert [int(line.split()[2]) for line in _lines(result.stdout)] == [1, 2, 3, 4, 5, 6]


class TestVerifyNewestUnreadable:
    def test_a_truncated_newest_manifest_is_the_finding(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        store = CheckpointStore(url, options=StoreOptions(shards=1))
        for epoch in (1, 2, 3):
            store.save({"w": torch.ones(4) * epoch}, epoch=epoch)
        manifest = Path(url) / "v000003" / "manifest.json"
        manifest.write_bytes(manifest.read_bytes()[:40])
        result = invoke("verify", url)
        assert result.exit_code == 1
        assert result.stdout == ""
        [line] = _lines(result.stderr)
        assert line.startswith("error: version 3, the newest in ")
        assert "unreadable" in line and "version 2 is the newest readable one" in line
        from ckptflow.storage import UnreadableVersionError

        with pytest.raises(UnreadableVersionError):
            store.verify()
        assert store.verify(2).version == 2  # an explicit version is still checked
        assert invoke("verify", url, "--version", "2").exit_code == 0


class TestPruneDryRunIsThePrune:
    """The dry run prints the plan the real prune then carries out, line for line."""

    @staticmethod
    def _both(url: str, *policy: str) -> tuple[list[str], list[str]]:
        before = sorted(p.relative_to(url) for p in Path(url).rglob("*"))
        dry = invoke("prune", url, *policy, "--dry-run", env=WIDE)
        assert dry.exit_code == 0, dry.output
        assert sorted(p.relative_to(url) for p in Path(url).rglob("*")) == before  # changed nothing
        real = invoke("prune", url, *policy, env=WIDE)
        assert real.exit_code == 0, real.output
        return _lines(dry.stdout), _lines(real.stdout)

    @staticmethod
    def _same(dry: list[str], real: list[str]) -> None:
        words = {"would remove": "removed", "would also keep": "also kept", "would keep": "kept"}
        translated = []
        for line in dry:
            for old, new in words.items():
                if line.startswith(old):
                    line = new + line[len(old) :]
                    break
            translated.append(line.replace("would free", "freed"))
        assert translated == real

    def test_all_archived(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        _fill_archived(url)
        dry, real = self._both(url, "--keep-last", "2")
        self._same(dry, real)
        # 5 and 6 are kept; 4 shares their tarball, so it stays; 1-3 go with theirs
        assert [line.split()[2] for line in real if line.startswith("removed")] == ["1", "2", "3"]
        assert real[-2].startswith("also kept version 4 (epochs-000004-000006.tar holds kept versions 5, 6)")
        assert real[-1].startswith("kept versions: 4, 5, 6;")
        assert [v.version for v in CheckpointStore(url).versions()] == [4, 5, 6]

    def test_mixed_loose_and_archived_with_keep_best(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        _fill_archived(url, loose_tail=3)  # 1-3 in a tarball, 4-6 loose
        store = CheckpointStore(url)
        store.save({"w": torch.zeros(8)}, epoch=7, metrics={"val_loss": 9.5})  # worse than 2-6
        dry, real = self._both(url, "--keep-last", "1", "--keep-best", "val_loss", "--best-mode", "min")
        self._same(dry, real)
        # keeps 7 (newest) and 6 (best); 1-3 share a tarball with no kept version: all removed
        assert [line.split()[2] for line in real if line.startswith("removed")] == ["1", "2", "3", "4", "5"]
        assert [v.version for v in CheckpointStore(url).versions()] == [6, 7]
        assert not list((Path(url) / "archive").glob("*.tar"))

    def test_a_store_without_versions_is_an_error_in_both_modes(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        CheckpointStore(url).save({"w": torch.ones(2)}, epoch=1)
        CheckpointStore(url).delete(1)
        for extra in ([], ["--dry-run"]):
            result = invoke("prune", url, "--keep-last", "1", *extra)
            assert result.exit_code == 1
            assert result.stderr.startswith("error: no committed checkpoint")


class TestVersionsFollowEpochs:
    def test_save_with_an_epoch_makes_that_version(self, tmp_path: Path) -> None:
        store = CheckpointStore(tmp_path / "store")
        assert [store.save({"w": torch.ones(2)}, epoch=e).version for e in (1, 2, 3)] == [1, 2, 3]
        assert store.verify(3).epoch == 3
        # an epoch that is not above every version takes the next free number, never another's
        assert store.save({"w": torch.ones(2)}, epoch=2).version == 4
        assert store.save({"w": torch.ones(2)}).version == 5


class TestSetAsideUnreadable:
    def test_a_writer_sets_the_unreadable_newest_aside_and_ls_shows_it(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        store = CheckpointStore(url)
        for epoch in (1, 2, 3):
            store.save({"w": torch.ones(4) * epoch}, epoch=epoch)
        (Path(url) / "v000003" / "manifest.json").write_text('{"format": "ckptflow-checkpoint"')
        assert store.latest().version == 2
        moved = store.set_aside_unreadable()
        assert [(v, Path(where).name.startswith("v000003.unreadable-")) for v, where, _ in moved] == [
            (3, True)
        ]
        aside = Path(moved[0][1])
        assert (aside / "manifest.json").exists() and list(aside.glob("shard-*.h5"))  # nothing deleted
        assert store.save({"w": torch.ones(4) * 3}, epoch=3).version == 3  # the number is free again
        listing = invoke("ls", url, env=WIDE)
        assert listing.exit_code == 0
        assert f"note: {aside} was set aside as unreadable" in listing.stdout
        gc = invoke("gc", url, "--min-age", "0")
        assert gc.exit_code == 0 and aside.exists()  # gc never touches it

    def test_a_newer_format_is_not_set_aside(self, tmp_path: Path) -> None:
        url = str(tmp_path / "store")
        store = CheckpointStore(url)
        store.save({"w": torch.ones(4)}, epoch=1)
        store.save({"w": torch.ones(4)}, epoch=2)
        manifest = Path(url) / "v000002" / "manifest.json"
        manifest.write_text(re.sub(r'"format_version":\d+', '"format_version":99', manifest.read_text()))
        from ckptflow.storage import FormatVersionError

        with pytest.raises(FormatVersionError, match="upgrade ckptflow"):
            store.set_aside_unreadable()
        assert manifest.exists()
