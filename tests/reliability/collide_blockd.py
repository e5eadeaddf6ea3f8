"""blockd with a deliberately weak hash, for collision tests.

`python -m tests.reliability.collide_blockd` takes blockd's own flags and runs blockd's
own server, with one change: the directory's `BlockHasher` keeps only the first
COLLIDE_BYTES bytes of each xxh3-128 digest (0: every hash is equal). blockd has no
flag or environment hook for this, so this launcher injects the hasher through
`build_server(config, directory)`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import xxhash

from blockd.__main__ import build_parser, config_from_args
from blockd.directory import BlockDirectory
from blockd.hashing import HASH_BYTES, BlockHasher
from blockd.logs import configure_logging
from blockd.server import build_server


def weak_digest(kept: int):
    def digest(data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data)[:kept].ljust(HASH_BYTES, b"\0")

    return digest


async def serve(argv: list[str]) -> int:
    config = config_from_args(build_parser().parse_args(argv))
    configure_logging(config.log_format)
    kept = int(os.environ.get("COLLIDE_BYTES", "0"))
    directory = BlockDirectory(config.directory, hasher=BlockHasher(weak_digest(kept)))
    server, address = build_server(config, directory)
    await server.start()
    if config.ready_file is not None:
        tmp = config.ready_file.with_name(config.ready_file.name + ".tmp")
        tmp.write_text(address + "\n")
        os.replace(tmp, config.ready_file)
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(serve(sys.argv[1:])))
