"""A rank with no microbatch that forgets ``engine.step()`` (the README loop's ``k == 0`` rule), at 3 CPU ranks.

Tagged (``ds_odc.tag_minibatch``), the step's meeting compares the minibatch every rank is on: every rank must fail at
that step, naming the rank, well before the fence's timeout, instead of one update silently mixing two minibatches.
Untagged, the run can only fail at its end, when the rank that took fewer steps has finished: the timeout's error
must then say that rank has finished. And a loop that tags correctly trains exactly as one that does not.
"""

from pathlib import Path

import pytest

from _support.launch import launch

WORKER = Path(__file__).with_name("worker.py")
pytestmark = pytest.mark.slow
TIMEOUT_S = 30  # the fence's timeout_s in the tagged runs: the error must come long before it


@pytest.mark.parametrize("variant", ["unmanaged", "managed", "hybrid"])
def test_a_skipped_step_fails_at_that_step_naming_the_rank(variant):
    """Unmanaged and managed accumulation at 3 ranks; hybrid sharding (2 shard groups of 2) at 4, where the tags
    travel with the whole job's meeting."""
    counts, victim = ("2,1,1,0", 3) if variant == "hybrid" else ("2,1,0", 2)
    args = ["skipped_step", "--counts", counts, "--victim", victim, "--steps", 4, "--tag", "--timeout", TIMEOUT_S]
    args += {"unmanaged": [], "managed": ["--managed"], "hybrid": ["--shard-size", 2]}[variant]
    world = len(counts.split(","))
    r = launch(WORKER, world, args, timeout=180, launcher="plain")
    by_rank = {x["rank"]: x for x in r.results}
    assert sorted(by_rank) == list(range(world)), r.stdout[-3000:] + r.stderr[-6000:]
    others = ", ".join(str(rank) for rank in range(world) if rank != victim)
    for rank, report in by_rank.items():
        assert report["error_type"] == "MinibatchMismatch" and report["ranks"] == [victim], report
        assert report["step"] == (2 if rank == victim else 1), report  # the others at the skipped step, it one later
        assert report["after_s"] < TIMEOUT_S / 3, report  # measured 0.1 s
        error = report["error"]
        assert f"rank {victim}: epoch 0, step 2" in error and f"ranks {others}: epoch 0, step 1" in error, error
        assert f"Rank {victim} went past" in error and "engine.step()" in error and "k == 0" in error, error


@pytest.mark.parametrize("finish", ["shutdown", "destroy"])
def test_untagged_the_timeout_says_the_missing_rank_has_finished(finish):
    args = ["skipped_step", "--counts", "2,1,0", "--victim", 2, "--steps", 4, "--timeout", 8]
    r = launch(WORKER, 3, args + (["--destroy"] if finish == "destroy" else []), timeout=180, launcher="plain")
    by_rank = {x["rank"]: x for x in r.results}
    assert by_rank[2] == {"rank": 2, "error_type": None, "steps": 4}, by_rank  # it believes it trained 4 minibatches
    why = "reached shutdown()" if finish == "shutdown" else "destroyed its engine"
    for rank in (0, 1):
        report = by_rank[rank]
        assert report["error_type"] == "FenceTimeout" and report["ranks"] == [2] and report["step"] == 3, report
        assert f"rank 2 will not come: it has finished ({why})" in report["error"], report["error"]
        assert "engine.step()" in report["error"] and "k == 0" in report["error"], report["error"]


def test_a_rank_that_does_not_tag_is_named_by_those_that_do():
    """Rank 2 steps correctly but never tags: ranks 0 and 1 fail at the first step naming it (rank 2, which reads no
    tags, fails at its next collective when they are gone)."""
    args = ["skipped_step", "--counts", "2,1,0", "--steps", 2, "--tag", "--untagged", 2, "--skip-at", -1,
            "--timeout", TIMEOUT_S]
    r = launch(WORKER, 3, args, timeout=180, launcher="plain")
    by_rank = {x["rank"]: x for x in r.results}
    for rank in (0, 1):
        report = by_rank[rank]
        assert report["error_type"] == "MinibatchMismatch" and report["ranks"] == [2] and report["step"] == 0, report
        assert "rank 2: no tag" in report["error"] and "Rank 2 did not tag" in report["error"], report["error"]
    assert r.returncode != 0


def test_a_tagged_loop_trains_as_an_untagged_one():
    """The control: every rank tags correctly (one of them has no microbatch), and the result equals the
    single-process reference as the untagged loop's does."""
    r = launch(WORKER, 3, ["uneven", "--counts", "2,1,0", "--tag"], timeout=240).check().result
    assert r["optimizer"] == "OdcOptimizer"
    assert r["max_rel_diff"] < 1e-5, r  # measured 1e-8 .. 2e-7 untagged
