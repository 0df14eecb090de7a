"""A TCP relay that delays every chunk, each way, by a set time: link latency where the kernel has
no netem (`tc ... netem delay` is the real thing; tests/helpers/netns.py uses it where it exists).

    python -m tests.helpers.delay_relay LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS

SIGUSR1 turns the delay on, SIGUSR2 off (it starts off), so one relay serves both runs of a
comparison and its own cost is in both. Order and bytes are kept: one queue per direction, each
chunk written when it is due. Prints "relaying" once it listens.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

state = {"delay_s": 0.0}


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + state["delay_s"], data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, b""))
    try:
        await sender
    except ConnectionError:
        pass


async def main(listen: str, target: str, delay_ms: float) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: state.update(delay_s=delay_ms / 1000))
    loop.add_signal_handler(signal.SIGUSR2, lambda: state.update(delay_s=0.0))
    target_host, target_port = target.rsplit(":", 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    print("relaying", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
