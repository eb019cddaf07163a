"""Two torchrun agents on loopback as two "nodes" (c10d rendezvous) form one gloo world of 4 and run the selftest.

This is the README's multi-node command with HOST = 127.0.0.1: each agent
gets `--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT` and the same `--rdzv-id`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid

from tests.e2e.test_cli import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_agents_form_one_world_of_four() -> None:
    port, run_id = _free_port(), f"wb-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                run_id,
                "--node-rank",
                str(node),
                "--max-restarts",
                "0",
                "-m",
                "wholebatch",
                "selftest",
                "--json",
                "--timeout",
                "60",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=180))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.communicate()
    codes = [a.returncode for a in agents]
    assert codes == [0, 0], outputs
    # Rank 0 lives on whichever agent the rendezvous made node 0; it alone prints.
    printed = [out for out, _ in outputs if out.strip()]
    assert len(printed) == 1, outputs
    doc = json.loads(printed[0])
    assert doc["passed"] and doc["world_size"] == 4 and doc["nodes"] == 2
    assert len(doc["checks"]) >= 12
