"""The `kvlab fleet` command lines of reports/fleet's worked examples, and their illustrative prices.

Stdlib only, so the page (kvlab.report.fleet) can quote the commands that kvlab.bench.fleet_report
runs without importing the simulator.
"""

PRICE_H100_HOUR = 2.50  # USD per card-hour: an illustrative input, not a quote; replace with yours
PRICE_PER_MTOK = 0.90  # USD per million output tokens on a shared pay-per-token pool: illustrative too
DATACENTRE = ("llama-3-70b --gpu h100 --rate 50 --duration 60 --prompt-len 4096 --output-len 512 "
              f"--slo ttft:2000 tpot:50 --find-min-cards --price-per-card-hour {PRICE_H100_HOUR} "
              f"--price-per-mtok {PRICE_PER_MTOK} --seed 0")
VARIANTS = (("MHA", "--kv-heads 64"), ("GQA-8", ""), ("MLA 512+64", "--mla-rank 512 --mla-rope-dim 64"))
DTYPES = ("fp16", "fp8")
EDGE = ("smollm2-135m --gpu jetson-agx-orin-64gb --rate 10 --burstiness inf --duration 60 --prompt-len 32 "
        "--output-len 8 --prefix-fraction 1 --prefix-len 1536 --max-num-seqs 8 --slo e2el:50 --seed 0")
DRAFT = "reports/fleet/llama-3.2-1b"  # Llama-3.2-1B's published config.json shape (16 layers, GQA-8, 1.24B)
SPECULATIVE = f"{DATACENTRE} --kv-cache-dtype fp8 --tensor-parallel-size 8"
ACCEPTANCE = (0.5, 0.7, 0.9)
DAY = ("llama-3-8b --gpu h100 --kv-cache-dtype fp8 --rate 100 --duration 86400 --prompt-len uniform:1024:0.5 "
       "--output-len uniform:256:0.5 --replicas {replicas} --tensor-parallel-size {tp} --router least-loaded "
       "--simulator fast --seed 0")
