"""Child process for the kill -9 durability test in test_store.py.

Usage: store_writer_child.py <data_dir>. Commits one node row, prints "committed", then waits to
be killed with the connection still open.
"""

import sys
import time
from pathlib import Path

import trio

from llmgw.server.store import NodeRow, open_store

# Bounded so that a child whose test died before killing it does not linger.
MAX_LIFETIME_S = 60

NODE_NAME = "node-killed"


async def main() -> None:
    store = await open_store(Path(sys.argv[1]))
    now = time.time()
    await store.save_nodes([NodeRow(NODE_NAME, "0.1.0", '{"gpus": []}', "online", now, now, now)])
    print("committed", flush=True)
    await trio.sleep(MAX_LIFETIME_S)


if __name__ == "__main__":
    trio.run(main)
