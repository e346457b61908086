"""`make demo`: the main job end to end on this machine, through the local executor.

Runs jobs/hello_ddp.toml on 2 simulated nodes x 2 ranks with real DDP (gloo), then says where
everything went.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    run_dir = REPO / "runs" / "demo-hello"
    cmd = [sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--run-dir", str(run_dir),
           str(REPO / "jobs" / "hello_ddp.toml")]
    print("$ hpc-ddp submit --executor local --run-dir runs/demo-hello jobs/hello_ddp.toml", flush=True)
    rc = subprocess.call(cmd, cwd=REPO)
    if rc == 0:
        print(f"\nDemo finished. Run dir: {run_dir}\n  spec:      {run_dir / 'spec.json'}\n"
              f"  rank logs: {run_dir / 'logs'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
