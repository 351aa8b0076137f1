"""Unit transfer benchmark: pulling a unit file in verified, resumable chunks, against one raw
bulk transfer of the same bytes, both over CURVE transports on loopback in this run.

Run: .venv/bin/python -m bench.deploy_transfer [--mbytes 64] [--repeats 3]

The raw transfer is one BandwidthProbe (the leader's link measurement). A pull adds what
deployment needs: a request per chunk, a write and fsync per chunk, and the sha256 check of the
whole file. Printed per chunk size: the best of the repeats in MB/s and its ratio to the best
raw transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peerd import protocol  # noqa: E402
from peerd.control.unit_store import UnitStore  # noqa: E402
from peerd.control.unit_transfer import ChunkServer, fetch_file  # noqa: E402
from peerd.wire.identity import ClusterSecret, KeyPair  # noqa: E402
from peerd.wire.transport import Endpoint, Transport, TransportError  # noqa: E402
from shards.manifest import UnitFile  # noqa: E402

SECRET = ClusterSecret(b"b" * 32)
HOST = "127.0.0.1"
CHUNK_SIZES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)


class Server:
    def __init__(self, files: dict[str, Path]):
        self.keys = KeyPair.generate()
        self.chunks = ChunkServer(lambda: files)
        self.transport = Transport(self.keys, SECRET, self.handle, HOST)
        self.ports = self.transport.start()
        self.tasks: set[asyncio.Task] = set()

    def handle(self, incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, protocol.Ping):
            incoming.reply(protocol.Pong(msg.req))
        elif isinstance(msg, protocol.BandwidthProbe):
            incoming.reply(protocol.BandwidthAck(msg.req, msg.tensors["payload"].nbytes))
        elif isinstance(msg, protocol.UnitChunkRequest):
            task = asyncio.create_task(self.answer(msg, incoming.reply))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def answer(self, msg, reply) -> None:
        reply(await self.chunks.answer(msg))


async def connect(server: Server) -> Transport:
    keys = KeyPair.generate()
    client = Transport(keys, SECRET, lambda incoming: None, HOST)
    client.start()
    client.admit(server.keys.public)
    server.transport.admit(keys.public)
    client.connect("server", Endpoint(HOST, server.ports.control, server.ports.data,
                                      server.keys.public))
    deadline = time.monotonic() + 10
    while True:
        try:
            await client.request("server", protocol.Ping(req=0), 0.5)
            return client
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def main(mbytes: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = np.random.default_rng(0).bytes(mbytes * 1024 * 1024)
        source = Path(tmp) / "unit.onnx"
        source.write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        server = Server({sha: source})
        client = await connect(server)
        probe = protocol.BandwidthProbe(
            req=0, tensors={"payload": np.frombuffer(data, dtype=np.uint8)})
        raw = []
        for _ in range(repeats):
            start = time.perf_counter()
            await client.request("server", probe, 120)
            raw.append(len(data) / (time.perf_counter() - start) / 1e6)
        print(f"{mbytes} MiB over CURVE on loopback; best of {repeats}")
        print(f"raw bulk transfer       {max(raw):8.1f} MB/s")
        for chunk in CHUNK_SIZES:
            speeds = []
            for attempt in range(repeats):
                store = UnitStore(Path(tmp) / f"store-{chunk}-{attempt}")
                start = time.perf_counter()
                await fetch_file(lambda m: client.request("server", m, 60), store,
                                 UnitFile("unit.onnx", sha, len(data)), chunk)
                speeds.append(len(data) / (time.perf_counter() - start) / 1e6)
            print(f"pull, {chunk // 1024:6d} KiB chunks {max(speeds):8.1f} MB/s   "
                  f"ratio to raw {max(speeds) / max(raw):.2f}")
        await client.close()
        await server.transport.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=int, default=64, help="file size in MiB (max 64)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(min(args.mbytes, 64), args.repeats))
