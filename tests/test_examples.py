"""The main job (examples/compare.py -> examples/sft.py) on 2 CPU ranks: four modes, one loss curve."""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import cpu_env
from _support.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_stock_and_odc_modes_give_the_same_loss_curve(tmp_path):
    """stock+local-sort, stock+lb-micro, odc+lb-micro, odc+lb-mini (through DeepSpeed's own loop) in one launch, every
    minibatch trained by each mode in turn (the order rotating): fp32, losses agree to 1e-4 relative (measured 1.4e-7;
    tests/training/test_recipe_stock_loop.py holds the two loops to the rounding bound), every mode fits the
    automatic cost, lb-mini gives the rank with the long sample fewer samples, what the job prints about lb-mini
    against lb-micro is what its own metrics say, and it draws the busy/wait plot where it says. Nothing here asserts
    a timing (the job's timings move with other programs' load)."""
    out, plot = tmp_path / "runs.json", tmp_path / "plot" / "busy-wait.png"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "compare.py"), "--json", str(out), "--plot",
                           str(plot)], env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = json.loads(out.read_text())
    runs, shown = job["runs"], job["step_by_step"]
    assert shown["max_rel_loss_diff"] < 1e-4
    assert {label: run["config"]["loop"] for label, run in runs.items()} == {
        "stock + local-sort": "recipe", "stock + lb-micro": "recipe", "odc + lb-micro": "recipe", "odc + lb-mini": "stock"}
    assert "largest relative loss difference" in proc.stdout and "automatic cost at the end" in proc.stdout
    # Interleaved: step i starts with mode i mod 4, so every mode takes every place in the order.
    labels = list(runs)
    assert len(labels) == 4 and len(job["order"]) == 20
    assert all(order == labels[i % 4:] + labels[:i % 4] for i, order in enumerate(job["order"])), job["order"]
    # The table shows no bubble for stock next to ODC's (its waits hide in the collectives), but each mode's speed.
    rows = dict(re.findall(r"^((?:stock|odc) \+ \S+)\s+[\d.]+\s+[\d.]+x  (.+)$", proc.stdout, re.MULTILINE))
    assert len(rows) == 4, proc.stdout
    assert all(v.startswith("in every layer (*)") for k, v in rows.items() if k.startswith("stock")), rows
    assert all(re.match(r"\d+\.\d%", v) for k, v in rows.items() if k.startswith("odc")), rows
    # Every minibatch holds one long sample among short ones: once the cost is fitted, lb-mini gives the rank with
    # the long sample one sample and the other three (lb-micro: 2/2) -- a plan, not a timing, so it holds under load.
    mini, micro = runs["odc + lb-mini"]["steps"], runs["odc + lb-micro"]["steps"]
    timed = range(6, 20)
    alone = sum(max(s["per_rank"], key=lambda r: r["tokens"])["microbatches"] == 1 for s in (mini[i] for i in timed))
    assert alone >= 10, [[r["microbatches"] for r in s["per_rank"]] for s in mini]
    assert all(len({r["microbatches"] for r in s["per_rank"]}) == 1 for s in micro)
    # The printed comparison is the run's own: recomputed from the metrics it wrote (medians of per-step numbers).
    waited_less = sum(mini[i]["bubble_rate"] < micro[i]["bubble_rate"] for i in timed)
    medians = [statistics.median(s[i]["bubble_rate"] for i in timed) for s in (mini, micro)]
    assert shown["steps"] == 14 and shown["waited_less"] == waited_less and shown["heaviest_rank_one_sample"] == alone
    assert (f"fewer samples than another in {shown['heaviest_rank_fewer_samples']} of 14 steps, one sample alone in "
            f"{alone}") in proc.stdout, proc.stdout
    assert (f"lb-mini's ranks waited less in {waited_less} of 14 steps; bubble {medians[0]:.1%} against "
            f"{medians[1]:.1%} (median step)") in proc.stdout, proc.stdout
    assert f"per-rank busy and waiting time per step: {plot}" in proc.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for label, run in runs.items():
        assert len(run["steps"]) == 20
        for step in run["steps"]:
            assert {"loss", "samples_per_s", "tokens_per_s", "bubble_rate", "step_time_s", "peak_mem_bytes",
                    "per_rank", "cost"} <= set(step)
            assert {"busy_s", "wait_s", "microbatches", "tokens", "sq_tokens"} <= set(step["per_rank"][0])
            assert 0.0 <= step["bubble_rate"] < 1.0
        assert run["steps"][-1]["cost"]["fitted"], label  # the automatic cost left its prior
    # By default the plot goes to a folder that git ignores, so the job leaves nothing in the checkout.
    usage = subprocess.run([sys.executable, str(ROOT / "examples" / "compare.py"), "--help"], capture_output=True,
                           text=True, timeout=60, env=cpu_env({"COLUMNS": "1000"})).stdout
    default = Path(re.search(r"\(default: (\S+); '' draws nothing\)", usage).group(1)).relative_to(ROOT)
    assert f"{default.parts[0]}/" in (ROOT / ".gitignore").read_text().split(), default


def test_the_main_job_refuses_modes_that_would_draw_other_minibatches():
    """The main job's check before training: samplers that cut other minibatches (here another seed) are named."""
    from ds_odc.balancer.sampler import BalancedBatchSampler
    job = load_script(ROOT / "examples" / "compare.py")

    def sampler(seed: int) -> BalancedBatchSampler:
        return BalancedBatchSampler(list(range(2, 42)), world_size=2, rank=0, minibatch_size=2, max_tokens=None,
                                    cost="tokens", seed=seed)

    job.check_same_minibatches({"a": sampler(0), "b": sampler(0)}, steps=10)
    with pytest.raises(SystemExit, match=r"^b trains other samples than a in steps \[0, "):
        job.check_same_minibatches({"a": sampler(0), "b": sampler(1)}, steps=10)


def test_sft_checks_the_data_up_front_and_fits_the_cost_on_one_rank(tmp_path):
    """1 CPU rank, the GPU fit check in miniature: samples over --max-tokens are truncated and counted in the metrics
    JSON; packed microbatches (their count varies per step) let the automatic cost fit a, b, c, d, and the fit tool
    prints its own fit of the run next to it. With the default --oversize error the run stops before training,
    naming the dataset index."""
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(ROOT / "examples" / "sft.py"), "--deepspeed", str(ROOT / "ds_configs" / "zero3_odc_fp32_cpu.json"),
            "--length-scale", "0.004", "--max-tokens", "40", "--minibatch-size", "6", "--num-samples", "96"]
    metrics = tmp_path / "m.json"
    ok = subprocess.run(base + ["--oversize", "truncate", "--steps", "12", "--metrics-json", str(metrics)],
                        env=cpu_env(), capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    run = json.loads(metrics.read_text())
    assert run["data"]["oversize"] == "truncate" and run["data"]["truncated_samples"] > 0
    assert "samples truncated to max_tokens=40" in ok.stdout and "automatic cost:" in ok.stdout
    assert len({step["per_rank"][0]["microbatches"] for step in run["steps"]}) > 1
    assert run["steps"][-1]["cost"]["fitted"] and run["steps"][-1]["cost"]["c_measured"]
    fit = subprocess.run([sys.executable, "-m", "ds_odc.balancer.fit", str(metrics)], env=cpu_env(),
                         capture_output=True, text=True, timeout=120)
    assert fit.returncode == 0 and "automatic" in fit.stdout and "--cost-coeffs" in fit.stdout, fit.stdout + fit.stderr
    bad = subprocess.run(base + ["--steps", "1"], env=cpu_env(), capture_output=True, text=True, timeout=180)
    assert bad.returncode != 0
    assert f"dataset index {run['data']['first_truncated'][0]}" in bad.stdout + bad.stderr


def test_sft_lb_mini_sp_splits_long_samples_and_keeps_the_loss_curve(tmp_path):
    """examples/sft.py --balancer lb-mini-sp on 2 CPU ranks: samples longer than --max-tokens are trained whole,
    split over both ranks, and every step's loss equals lb-mini's with no budget (each sample whole on one rank),
    to 1e-5 relative (measured 1e-7)."""
    lengths = tmp_path / "lengths.txt"
    per_step = [[150 + 10 * step] + [12 + 4 * i for i in range(7)] for step in range(4)]  # one long sample each
    lengths.write_text("\n".join(str(n) for step in per_step for n in step))
    runs = {}
    for balancer, budget in (("lb-mini", []), ("lb-mini-sp", ["--max-tokens", "96"])):
        metrics = tmp_path / f"{balancer}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "examples" / "sft.py"), "--deepspeed", str(ROOT / "ds_configs" / "zero3_odc_fp32_cpu.json"),
               "--balancer", balancer, "--lengths-file", str(lengths), "--no-shuffle", "--minibatch-size", "4",
               "--steps", "4", "--cost", "tokens", "--quiet", "--metrics-json", str(metrics), *budget]
        proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        runs[balancer] = json.loads(metrics.read_text())
    assert runs["lb-mini-sp"]["split_samples_rank0"] == 4  # the long sample of every step
    assert runs["lb-mini-sp"]["data"]["truncated_samples"] == 0
    for a, b in zip(runs["lb-mini"]["steps"], runs["lb-mini-sp"]["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])


def test_lb_mini_without_odc_is_refused():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "examples" / "sft.py"), "--deepspeed", str(ROOT / "ds_configs" / "zero3_fp32_cpu.json"),
           "--balancer", "lb-mini", "--steps", "1"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "only ODC can run" in proc.stdout + proc.stderr


def test_e2e_benchmark_pipeline_on_cpu(tmp_path):
    """benchmarks/e2e.py end to end at CPU scale (tiny model, lengths scaled by 0.01): a stock mode with the block
    settings, ODC + LB-Mini through the recipe's loop and through DeepSpeed's own (/stock-loop), and FSDP2 run, the
    table compares them (the stock loop with FSDP2 on the same rows, and with the recipe's loop), the profiled
    minibatch is reported and kept out of the timing, and the metrics feed the cost fit."""
    out = tmp_path / "e2e"
    modes = ("stock-blocks+lb-micro", "odc+lb-mini", "odc+lb-mini/stock-loop", "fsdp2")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--model", "tiny", "--workload", "longtail",
           "--scale", "0.01", "--steps", "3", "--modes", ",".join(modes), "--profile", "--compare-to", "odc+lb-mini",
           "--out", str(out), "--run-timeout", "240"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=800)
    failed_at = proc.stdout.find(" FAILED")  # a failed mode's own message, which the tables' tail would not show
    failure = proc.stdout[failed_at:failed_at + 4000] if failed_at >= 0 else proc.stdout[-3000:]
    assert proc.returncode == 0, failure + proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout, failure
    table = proc.stdout[proc.stdout.index("tiny / longtail"):]
    for mode in modes:
        assert mode in table
    stock_row = next(line for line in table.splitlines() if line.startswith("odc+lb-mini/stock-loop "))
    # against FSDP2 on the same rows (the loop is not part of the rows), none with plain, against the recipe's loop
    assert re.search(r"\d\.\d\dx\s+-\s+\d\.\d\dx$", stock_row), stock_row
    recipe_loop, stock_loop = (json.loads((out / f"tiny-longtail-{m}.json").read_text())
                               for m in ("odc+lb-mini", "odc+lb-mini-stock-loop"))
    assert stock_loop["config"]["loop"] == "stock" and stock_loop["profile_rank0"]["layer_forward_calls"] > 0
    for a, b in zip(stock_loop["steps"], recipe_loop["steps"], strict=True):  # the same minibatches, the same loss
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
    e2e = load_script(ROOT / "benchmarks" / "e2e.py")
    assert e2e.parse_mode("odc+lb-mini/stock-loop", "longtail").rows == e2e.parse_mode("fsdp2", "longtail").rows
    with pytest.raises(SystemExit, match="fsdp2/stock-loop.*does not run DeepSpeed"):
        e2e.parse_mode("fsdp2/stock-loop", "longtail")
    assert "profile of one more minibatch" in table
    replays = table[table.index("simulator replaying each run"):table.index("profile of one more minibatch")]
    assert re.search(r"with \S+'s cost", replays), replays  # every run also priced by one mode's fit
    for mode in ("stock-blocks+lb-micro", "odc+lb-mini", "fsdp2"):  # each run priced by its own fit and replayed
        row = next(line for line in replays.splitlines() if line.startswith(mode + " "))
        # predicted/measured, the balance bound (s/step) and measured/bound, the cross-priced ratio, the own fit
        assert re.search(r"\d\.\d\dx\s+\d+\.\d{3}\s+\d+\.\d\dx\s+\d\.\d\dx   fit of the run's timed rank-steps",
                         row), row
    odc = json.loads((out / "tiny-longtail-odc+lb-mini.json").read_text())
    assert len(odc["steps"]) == 4 and odc["config"]["profile_step"] == 3
    assert odc["profile_rank0"]["layer_forward_calls"] > 0
    assert all(r["sq_tokens"] >= r["tokens"] for step in odc["steps"] for r in step["per_rank"])
    fit = subprocess.run([sys.executable, "-m", "ds_odc.balancer.fit", str(out / "tiny-longtail-odc+lb-mini.json"),
                          str(out / "tiny-longtail-fsdp2.json")], env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert fit.returncode == 0 and "--cost fitted --cost-coeffs" in fit.stdout, fit.stdout + fit.stderr


def test_e2e_stops_a_mode_past_its_time_with_its_ranks_and_says_so(tmp_path):
    """A mode that runs past ``--run-timeout`` is stopped with every rank it started (not only torchrun), the call
    names it and its limit, still runs the next mode and prints the table, and exits non-zero."""
    out = tmp_path / "e2e"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--model", "tiny", "--workload", "longtail",
           "--scale", "0.01", "--steps", "2", "--modes", "odc+lb-mini,odc+lb-micro", "--run-timeout", "4",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:]
    for mode in ("odc+lb-mini", "odc+lb-micro"):  # both tried: the first one's timeout did not end the call
        assert f"{mode} FAILED: the launch ran past its time limit of 4 s (--run-timeout)" in proc.stdout, proc.stdout
    assert "tiny / longtail" in proc.stdout and "2 of 2 modes failed" in proc.stderr
    left = []  # processes whose command line names this call's folder (the ranks do), zombies aside
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = stat.read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if str(out) in cmdline and state != "Z":
            left.append(cmdline)
    assert not left, f"ranks outlived their launch: {left}"


def test_packed_table_and_attention_benchmark_on_cpu(tmp_path):
    """The longtail-packed table at CPU scale on 1 rank (ODC packed and unpacked, plain training): every mode runs,
    the table and profile print with each mode beside plain training on the same rows, and packed rows train the same losses as one sample per microbatch (attention and
    chunked loss are exact up to fp32 rounding: 1e-4 relative, measured ~4e-6); then the attention micro-benchmark."""
    out = tmp_path / "e2e"
    modes = "odc+lb-mini,odc+lb-mini/unpacked,plain"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--model", "tiny", "--workload", "longtail-packed",
           "--nproc", "1", "--scale", "0.01", "--steps", "3", "--modes", modes, "--profile", "--out", str(out),
           "--run-timeout", "240"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("tiny / longtail-packed"):]
    assert "vs plain same rows" in table and "vs fsdp2 same rows" in table and "per layer forward" in table
    packed_row = next(line for line in table.splitlines() if line.startswith("odc+lb-mini "))
    assert packed_row.rstrip().endswith("x"), packed_row  # compared with plain on packed rows of this call
    runs = {m: json.loads((out / f"tiny-longtail-packed-{m.replace('/', '-')}.json").read_text())
            for m in modes.split(",")}
    packed, unpacked = runs["odc+lb-mini"], runs["odc+lb-mini/unpacked"]
    assert packed["config"]["max_tokens"] and not unpacked["config"]["max_tokens"]
    assert max(r["microbatches"] for s in unpacked["steps"] for r in s["per_rank"]) == 4  # one sample each
    assert max(r["microbatches"] for s in packed["steps"] for r in s["per_rank"]) == 1  # packed: one row
    for a, b in zip(packed["steps"], unpacked["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"])
    assert packed["config"]["attn_implementation"] == "ds_odc_varlen" and packed["config"]["loss_chunk_tokens"]

    bench = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--row-tokens", "256",
                            "--head-dim", "8", "--reps", "1", "--shapes", "longtail,128-documents", "--sweep",
                            "--out", str(tmp_path)], env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    written = json.loads((tmp_path / "attention.json").read_text())
    ours = [r for r in written["results"] if r["kernel"] in ("ds_odc_varlen (auto)", "ds_odc_varlen bucketed")]
    assert len(ours) == 4 and all(r["max_abs_diff"] <= 1e-5 for r in ours)
    assert [r["length"] for r in written["sweep"]] == [256]


def test_e2e_rounds_and_another_checkout_on_cpu(tmp_path):
    """--repeat runs the modes in rounds and reports each mode's median run and the median in-round ratio; a mode
    ending in @DIR runs from that checkout (here this one again), and a wrong @DIR fails before anything runs;
    --warmup sets the untimed minibatches of every mode (here none), and one that leaves none timed is refused."""
    out = tmp_path / "e2e"
    modes = f"odc+lb-mini,plain@{ROOT}"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--model", "tiny", "--workload", "longtail-packed",
           "--nproc", "1", "--scale", "0.01", "--steps", "2", "--modes", modes, "--repeat", "2", "--out", str(out),
           "--run-timeout", "240", "--warmup", "0"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("tiny / longtail-packed"):]
    assert "median of 2 rounds" in table and "samples/s of every round" in table, table
    assert "timed minibatches 1-2" in table, table
    rate = {(m, r): json.loads((out / f"tiny-longtail-packed-{m}-round{r}.json").read_text())["summary"]
            ["samples_per_s"] for m in ("odc+lb-mini", f"plain-at-{ROOT.name}") for r in (1, 2)}
    expected = sum(rate["odc+lb-mini", r] / rate[f"plain-at-{ROOT.name}", r] for r in (1, 2)) / 2
    odc_row = next(line for line in table.splitlines() if line.startswith("odc+lb-mini "))
    assert odc_row.rstrip().endswith(f"{expected:.2f}x"), (odc_row, expected)  # vs plain, same rows, same round

    wrong = subprocess.run(cmd[:cmd.index("--modes") + 1] + [f"odc+lb-mini@{tmp_path}", "--out", str(tmp_path / "w")],
                           env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "is not a checkout of this repository" in wrong.stderr, wrong.stderr[-2000:]
    assert not (tmp_path / "w").exists()  # refused before writing anything
    no_timed = subprocess.run(cmd[:-2] + ["--warmup", "2"], env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert no_timed.returncode != 0 and "--warmup 2: give 0 to 1" in no_timed.stderr, no_timed.stderr[-2000:]
