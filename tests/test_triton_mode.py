"""Triton fixes its mode (compiled or interpreted) when it is imported: the entry points choose it
first, and a process that set TRITON_INTERPRET too late is refused with the reason, never left to
fail inside Triton ("0 active drivers") or to report failing checks as a finished run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "kernels")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_bench_cli_imports_no_kernel_before_choosing_the_mode():
    done = _fresh("""
        import sys
        import dsfuse.bench.__main__
        assert "triton" not in sys.modules, sorted(m for m in sys.modules if m.startswith("dsfuse"))
    """)
    assert done.returncode == 0, done.stderr


def test_interpreter_set_after_import_is_refused_with_the_reason():
    done = _fresh("""
        import os, torch, triton  # Triton imported compiled (here by the caller; any import of it counts)
        from dsfuse.text_rope import apply_rope
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            apply_rope(torch.randn(1, 3, 2, 16), torch.randn(1, 3, 4), backend="triton")
        except ValueError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert "TRITON_INTERPRET is set now but was unset when Triton was imported" in done.stdout


def test_smoke_run_in_a_process_that_imported_triton_compiled_is_stopped():
    done = _fresh("""
        import triton  # imported compiled before the CLI chooses the interpreter
        from dsfuse.bench.__main__ import main
        main(["run", "--smoke", "text_rope"])
    """)
    assert done.returncode != 0
    assert "cannot start a smoke run in this process: TRITON_INTERPRET is set now but was unset" in done.stderr
