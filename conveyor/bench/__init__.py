"""Benchmarks: `conveyor bench serve | offline | step`.

args.py               the flags of the three commands (no heavy imports)
serve.py              `bench serve`: an HTTP load generator for any OpenAI-compatible server
  prompts.py          prompt text of a wanted token length (server /tokenize, tokenizer.json, or words)
  dataset.py          ShareGPT and synthetic workloads as text (lengths from conveyor.sim.workloads)
  images.py           generated pictures as data: URLs for a share of the requests (--image-fraction)
  client.py           one streamed request, timed chunk by chunk
  load.py             open loop (Poisson, max concurrency) and closed loop (N clients)
  results.py          throughput, TTFT, TPOT, ITL, E2E, effective throughput (conveyor.sim.run_metrics)
  plots.py            the PNG figures
offline.py            `bench offline`: conveyor's LLM API against transformers' generate, same workload
scheduler_cost.py     `bench step`: the scheduler's CPU cost per step, and one input preparation alone
"""
