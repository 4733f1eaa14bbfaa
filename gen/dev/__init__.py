"""Developer tools: knob sweeps, per-block timelines, profiling, machine code, the cost model's fit, single compiles."""
