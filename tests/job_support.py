"""Jobs of bare rank processes, for the tests that kill ranks with SIGKILL (a World's ranks answer
its parent and cannot die mid-call): the environment a launcher gives a rank, and free ports."""

import os
import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_environment(rank: int, port: int, world_size: int) -> None:
    """The variables DeepSpeed's launcher sets for ``rank`` of a one-host job on the CPU."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
        }
    )
