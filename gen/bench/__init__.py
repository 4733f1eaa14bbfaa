"""gen bench: batch sweeps against FP16 and other INT4 kernels, with clocks, energy and reports; `--e2e`:
whole models, dense against INT4, decode and prefill in CUDA graphs."""
