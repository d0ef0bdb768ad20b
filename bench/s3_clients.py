"""Which S3 client: upload and download throughput of boto3 (s3transfer) and obstore on the same endpoint.

    .venv/bin/pip install obstore && .venv/bin/python bench/s3_clients.py [--mb 512] [--rounds 3]

SeaweedFS on loopback (started here); two files of ``--mb``/2 each, uploaded and downloaded 2 at a time, each
client with 16 MiB parts and 4 in flight per file. Both clients offer the conditional writes the commit needs
(boto3: ``IfNoneMatch``/``IfMatch``; obstore: ``mode="create"`` / ``mode={"e_tag": ...}``), so throughput decides.
Prints the medians and the obstore/boto3 ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
from boto3.s3.transfer import TransferConfig  # noqa: E402

from tests.s3.server import seaweedfs  # noqa: E402

PART = 16 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import obstore  # noqa: PLC0415
    from obstore.store import S3Store  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="s3clients-") as t, seaweedfs(Path(t) / "weed", volume_mb=1024) as server:
        tmp = Path(t)
        files = []
        for i in range(2):
            f = tmp / f"f{i}"
            with open(f, "wb") as out:
                chunk = os.urandom(8 << 20)
                for _ in range(args.mb // 16):
                    out.write(chunk)
            files.append(f)
        total = sum(f.stat().st_size for f in files)
        env = server.env()
        b3 = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=4)
        ob = S3Store(
            server.bucket,
            endpoint=server.endpoint,
            access_key_id=env["AWS_ACCESS_KEY_ID"],
            secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region="us-east-1",
            client_options={"allow_http": True},
        )

        def timed(fn: object, items: list[tuple[Path, str]]) -> float:
            t0 = time.monotonic()
            with cf.ThreadPoolExecutor(2) as pool:
                list(pool.map(fn, items))  # type: ignore[arg-type]
            return time.monotonic() - t0

        res: dict[str, list[float]] = {k: [] for k in ("boto3 up", "obstore up", "boto3 down", "obstore down")}
        for r in range(args.rounds):
            keys = [(f, f"c-{uuid.uuid4().hex[:6]}/{f.name}") for f in files]
            order = ["boto3", "obstore"] if r % 2 == 0 else ["obstore", "boto3"]
            for who in order:
                if who == "boto3":
                    up = [(f, "b" + k) for f, k in keys]
                    res["boto3 up"].append(
                        timed(lambda fk: b3.upload_file(str(fk[0]), server.bucket, fk[1], Config=cfg), up)
                    )
                    res["boto3 down"].append(
                        timed(lambda fk: b3.download_file(server.bucket, fk[1], str(fk[0]) + ".b", Config=cfg), up)
                    )
                else:
                    up = [(f, "o" + k) for f, k in keys]
                    res["obstore up"].append(
                        timed(lambda fk: obstore.put(ob, fk[1], fk[0], chunk_size=PART, max_concurrency=4), up)
                    )

                    def get(fk: tuple[Path, str]) -> None:
                        with open(str(fk[0]) + ".o", "wb") as out:
                            for chunk in obstore.get(ob, fk[1]).stream(min_chunk_size=PART):
                                out.write(chunk)

                    res["obstore down"].append(timed(get, up))
        med = {k: statistics.median(v) for k, v in res.items()}
        for k, v in med.items():
            print(f"{k:13s} {v:6.2f} s  {total / v / 1e6:6.0f} MB/s")
        print(
            f"obstore/boto3 upload throughput {med['boto3 up'] / med['obstore up']:.2f}x, "
            f"download {med['boto3 down'] / med['obstore down']:.2f}x"
        )


if __name__ == "__main__":
    main()
