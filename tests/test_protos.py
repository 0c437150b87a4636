"""The generated gRPC code in common/protocol/proto/ matches protos/."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh():
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
