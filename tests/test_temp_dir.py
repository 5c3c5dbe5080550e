"""The suite's temporary-folder check (tests/conftest.py), run on a small suite of its own in a fresh pytest: a test
that leaves a folder behind fails by name, a tidy one and the folders torch makes there pass, and the run leaves nothing in
the temporary folder it was given."""

import os
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

SUITE = '''
import os, tempfile

def test_leaves_a_folder():
    tempfile.mkdtemp(prefix="forgotten_")

def test_tidies_up(tmp_path):
    (tmp_path / "kept_by_pytest").write_text("x")
    with tempfile.TemporaryDirectory():
        pass

def test_torchs_own_folders_are_not_the_tests_fault():
    os.mkdir(os.path.join(os.environ["TMPDIR"], "torchelastic_abc"))
    os.mkdir(os.path.join(os.environ["TMPDIR"], "torchinductor_someone"))
'''


def test_a_test_that_leaves_files_in_the_temp_dir_fails_and_the_run_leaves_nothing(tmp_path):
    suite, system_temp = tmp_path / "suite", tmp_path / "system_temp"
    suite.mkdir()
    system_temp.mkdir()
    (suite / "conftest.py").write_text(CONFTEST.read_text())
    (suite / "test_leaks.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k not in ("TMP", "TEMP", "PYTEST_ADDOPTS")}
    env["TMPDIR"] = str(system_temp)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 passed, 1 error" in out, out  # the leak is an error at teardown of the test that made it
    assert "test_leaks.py::test_leaves_a_folder left ['forgotten_" in out, out
    assert list(system_temp.iterdir()) == [], out
