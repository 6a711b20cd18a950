"""kvlab fleet: size a serving fleet by simulating the engine's own scheduler with a virtual clock.

workload (who arrives when, asking for what), service (what one replica costs per step and
holds in KV), replica_engine (the engine's Scheduler and BlockManager driven step by step),
replica_fast (the same policy aggregated per step, for days of traffic), fleet (routing and
the run), results (percentiles, goodput, cost), calibrate (measuring the real engine).
"""
