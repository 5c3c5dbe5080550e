"""Supervised fine-tuning with DeepSpeed ZeRO-3, with or without ODC, on imbalanced sequence lengths.

    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/sft.py --deepspeed ds_configs/zero3_odc_fp32_cpu.json \\
        --balancer lb-mini --model tiny --preset baselines-longtail --length-scale 0.004 --steps 5

The logged loss is the global mean token loss of each minibatch, the same quantity in every mode, so stock and ODC
runs can be compared step by step. ``--metrics-json`` writes per-step throughput, bubble rate and per-rank busy/wait.
The training loop itself is ``ds_odc/recipes/train.py``: read it there, or call ``ds_odc.recipes.train.train(args)``.
"""

from ds_odc.recipes.train import main

if __name__ == "__main__":
    main(description=__doc__)
