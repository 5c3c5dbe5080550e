"""``output_folder``: where the examples write when the user names no folder. Every rank gets the same temporary
folder, and nothing of it is left once the job has ended."""

import os
import textwrap

from _support.launch import launch

from ds_odc.training.distributed import output_folder

RANK_SCRIPT = textwrap.dedent("""
    import os
    import torch.distributed as dist
    from _support.launch import emit
    from ds_odc.training.distributed import output_folder, shutdown_and_exit

    dist.init_process_group("gloo")
    path = output_folder(None, prefix="ds_odc_example_")
    emit({"rank": dist.get_rank(), "path": path, "exists": os.path.isdir(path)})
    shutdown_and_exit()  # as the examples end: the hard exit skips atexit, so it removes the folder itself
""")


def test_a_named_folder_is_used_as_given():
    assert output_folder("my/run") == "my/run"


def test_every_rank_gets_the_same_temporary_folder_and_it_is_removed_at_the_end(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = launch(script, 2, timeout=120, env={"TMPDIR": str(scratch)}).check()
    paths = {r["path"] for r in out.results}
    assert len(out.results) == 2 and len(paths) == 1 and all(r["exists"] for r in out.results), out.results
    assert paths.pop().startswith(str(scratch) + os.sep)
    assert not list(scratch.glob("ds_odc_example_*")), list(scratch.iterdir())
