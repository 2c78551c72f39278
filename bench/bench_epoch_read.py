"""Reading one epoch out of a 10-epoch tarball on S3, against downloading the tarball.

A local store saves 10 epochs (``--epoch-mib`` each), archives them into one
tarball and uploads it (with its index) to a local S3 server (SeaweedFS by
default, moto with ``--server moto``) on free 127.0.0.1 ports; then, from a
store opened on the S3 mirror, it times ``load(5)`` (range reads through
the index) against ``download_file`` of the whole tarball (parallel ranged
GETs, the fastest full download we have).
One run, one table; the ratio is the point.

    .venv/bin/python bench/bench_epoch_read.py [--epoch-mib 64] [--repeats 3] [--server seaweedfs|moto]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_transfer import KEY, SECRET, s3_server
from bench.common import MiB, markdown_table, median_seconds
from ckptflow.storage import CheckpointStore
from ckptflow.storage.remote.transfer import download_file, upload_file


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epoch-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server", choices=["seaweedfs", "moto"], default="seaweedfs")
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1")
    with s3_server(args.server) as (_, endpoint), tempfile.TemporaryDirectory(prefix="ckptflow-") as tmp:
        run(Path(tmp), endpoint, args)


def run(tmp: Path, endpoint: str, args: argparse.Namespace) -> None:
    import boto3

    options = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    local = CheckpointStore(tmp / "store")
    numel = args.epoch_mib * MiB // 4
    for epoch in range(1, 11):
        local.save({"model": {"w": torch.full((numel,), float(epoch))}}, epoch=epoch, version=epoch)
    index = local.archive(list(range(1, 11)))
    tar = tmp / "store" / "archive" / index.tar
    upload_file(tar, f"s3://bench/run/archive/{index.tar}", storage_options=options)
    idx = tar.with_name(index.tar.removesuffix(".tar") + ".index.json")
    upload_file(idx, f"s3://bench/run/archive/{idx.name}", storage_options=options)
    remote = CheckpointStore("s3://bench/run", storage_options=options)
    assert [v.version for v in remote.versions()] == list(range(1, 11))

    def load_one() -> None:
        state = remote.load(5)
        assert float(state["model"]["w"][0]) == 5.0

    def download_all() -> None:
        download_file(f"s3://bench/run/archive/{index.tar}", str(tmp / "dl.tar"), storage_options=options)
        os.remove(tmp / "dl.tar")

    one = median_seconds(load_one, args.repeats)
    whole = median_seconds(download_all, args.repeats)
    mib = index.size / MiB
    rate = args.epoch_mib * MiB / one / 1e6
    print(
        f"10 epochs of {args.epoch_mib} MiB, one {mib:.0f} MiB tarball on {args.server} S3, "
        f"median of {args.repeats}"
    )
    rows = [
        [
            "`load(5)` from the tarball (range reads)",
            f"{one:.2f}",
            f"{rate:.0f}",
            f"{whole / one:.1f}x faster",
        ],
        ["`download_file` of the whole tarball", f"{whole:.2f}", f"{index.size / whole / 1e6:.0f}", "1.0x"],
    ]
    header = ["read", "seconds", "MB/s of the bytes needed", "vs downloading the tarball"]
    print(markdown_table(header, "lrrr", rows))


if __name__ == "__main__":
    main()
