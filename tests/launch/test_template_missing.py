"""A profile's template that is not there is one line with its fix (issue 42, item 5: site.md's example named
a site-template.j2 that does not exist, and the error had no HINT)."""

import os
import subprocess
import sys


def test_a_missing_template_is_one_line_with_a_hint(tmp_path):
    (tmp_path / "train.py").write_text("print('x')\n")
    (tmp_path / "profiles.toml").write_text('[site]\ntemplate = "site-template.j2"\n')
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--dry-run", "--executor", "sbatch",
                           "--profile", "site", "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HPC_DDP_PROFILES": str(tmp_path / "profiles.toml")})
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "error:" in x]
    assert "site-template.j2' not found HINT:" in line and "templates/sbatch.sh.j2" in line
